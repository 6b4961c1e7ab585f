"""Exact resume through real Trainer runs (fork launcher, gloo, CPU).

One uninterrupted run checkpoints after every step through ModelCheckpoint; runs resumed from
its checkpoints with ``trainer.fit(ckpt_path=...)`` must end bitwise equal to it on every rank.
``sync_every`` is 3, so step 2 is just before a sync, 3 is at one and 4 just after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_swarm import SwarmStrategy
from lightning_swarm.callbacks.resume import SwarmResume
from lightning_swarm.resume.files import ANCHORS_FILE, MMAP_ENV, swarm_root
from tests.resume_utils import (
    assert_bitwise_equal,
    fit,
    load_ranks,
    record_file_again,
)

MAX_STEPS = 8


@pytest.fixture(scope="module")
def full_run_1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 islands of 1 rank, checkpoints after every step."""
    root = tmp_path_factory.mktemp("full1")
    fit(root / "out", devices=2, island_size=1, max_steps=MAX_STEPS, ckpt_dir=root / "ckpts")
    return root


def _ckpt(root: Path, step: int) -> Path:
    return root / "ckpts" / f"step={step}.ckpt"


def _resume_and_compare(
    root: Path, tmp: Path, step: int, devices: int, island_size: int, **kw: object
) -> list[dict]:
    fit(
        tmp / "resumed",
        devices=devices,
        island_size=island_size,
        max_steps=MAX_STEPS,
        ckpt_path=_ckpt(root, step),
        **kw,  # type: ignore[arg-type]
    )
    full, resumed = load_ranks(root / "out", devices), load_ranks(tmp / "resumed", devices)
    for rank in range(devices):
        assert_bitwise_equal(full[rank], resumed[rank], f"resume at step {step}, rank {rank}")
    return resumed


@pytest.mark.parametrize("step", [2, 3, 4])
def test_exact_resume_two_islands_of_one(full_run_1: Path, tmp_path: Path, step: int) -> None:
    resumed = _resume_and_compare(full_run_1, tmp_path, step, devices=2, island_size=1)
    for rank, info in enumerate(resumed):
        assert f"island {rank}: restored round(s) [{step // 3}]" in info["summary"]
        assert "memory-mapped" in info["summary"] and "no catch-up needed" in info["summary"]
    # islands really differ between syncs at the stop point: rank 0's state alone would not do
    if step % 3 != 0:
        ckpt = torch.load(_ckpt(full_run_1, step), weights_only=True)
        saved_id = ckpt["swarm"]["save_id"]
        island1 = torch.load(
            swarm_root(_ckpt(full_run_1, step)) / saved_id / "island-00001.pt", weights_only=True
        )
        assert not torch.equal(
            ckpt["state_dict"]["net.0.weight"], island1["module"]["net.0.weight"]
        )


def test_checkpoint_layout_and_pruning(full_run_1: Path) -> None:
    ckpt = torch.load(_ckpt(full_run_1, 4), weights_only=True)
    record = ckpt["swarm"]
    assert record["outer_steps"] == [1] and record["inner_steps"] == [4]
    assert record["anchor_dtype"] == "float32" and record["fingerprint"]["num_islands"] == 2
    saves = list(swarm_root(_ckpt(full_run_1, 4)).iterdir())
    assert [p.name for p in saves] == [record["save_id"]]
    assert sorted(p.name for p in saves[0].iterdir()) == [
        ANCHORS_FILE,
        "island-00000.pt",
        "island-00001.pt",
    ]


def test_eager_switches_resume_exactly(
    full_run_1: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resumed = _resume_and_compare(
        full_run_1, tmp_path / "config", 4, devices=2, island_size=1, anchors={"mmap": False}
    )
    assert "eager read (anchors.mmap=false)" in resumed[0]["summary"]
    monkeypatch.setenv(MMAP_ENV, "0")
    resumed = _resume_and_compare(full_run_1, tmp_path / "env", 4, devices=2, island_size=1)
    assert f"eager read ({MMAP_ENV}=0)" in resumed[1]["summary"]


def test_legacy_anchor_file_resumes_exactly(full_run_1: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(full_run_1 / "ckpts", root / "ckpts")
    shutil.copytree(full_run_1 / "out", root / "out")
    ckpt = torch.load(_ckpt(root, 4), weights_only=True)
    anchors = swarm_root(_ckpt(root, 4)) / ckpt["swarm"]["save_id"] / ANCHORS_FILE
    torch.save(
        torch.load(anchors, weights_only=True), anchors, _use_new_zipfile_serialization=False
    )
    record_file_again(_ckpt(root, 4), ANCHORS_FILE)
    resumed = _resume_and_compare(root, tmp_path, 4, devices=2, island_size=1)
    assert "legacy format read eagerly" in resumed[0]["summary"]
    assert "checksums verified" in resumed[0]["summary"]


def test_plain_checkpoint_starts_fresh_anchors_from_its_weights(
    full_run_1: Path, tmp_path: Path
) -> None:
    ckpt = torch.load(_ckpt(full_run_1, 4), weights_only=True)
    del ckpt["swarm"]
    plain = tmp_path / "plain.ckpt"
    torch.save(ckpt, plain)
    # sync_at_end=False: the counters below are the schedule's rounds only
    fit(tmp_path / "out", devices=2, island_size=1, max_steps=5, ckpt_path=plain, sync_at_end=False)
    for info in load_ranks(tmp_path / "out", 2):
        assert info["summary"] is None
        assert info["inner_steps"] == [1] and info["outer_steps"] == [0]
        assert torch.equal(
            info["start_anchors"][0]["net.0.weight"], ckpt["state_dict"]["net.0.weight"]
        )


def test_damaged_island_file_fails_before_training(full_run_1: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(full_run_1 / "ckpts", root / "ckpts")
    ckpt = torch.load(_ckpt(root, 4), weights_only=True)
    island = swarm_root(_ckpt(root, 4)) / ckpt["swarm"]["save_id"] / "island-00001.pt"
    island.write_bytes(island.read_bytes()[:100])
    with pytest.raises(Exception, match=r"rank 1: swarm state file .*island-00001.pt is truncated"):
        fit(
            tmp_path / "out",
            devices=2,
            island_size=1,
            max_steps=MAX_STEPS,
            ckpt_path=_ckpt(root, 4),
        )
    assert not (tmp_path / "out").exists()  # no rank reached the end of a training run


def test_rejoining_island_catches_up(full_run_1: Path, tmp_path: Path) -> None:
    """Island 1 restores from step 2 (round 0), island 0 from step 7 (round 2)."""
    old, new = _ckpt(full_run_1, 2), _ckpt(full_run_1, 7)
    fit(
        tmp_path / "out",
        devices=2,
        island_size=1,
        max_steps=8,
        ckpt_path=new,
        callbacks=[SwarmResume(island_ckpt_paths={1: old})],
        sync_at_end=False,  # the counters below are the schedule's rounds only
    )
    info = load_ranks(tmp_path / "out", 2)
    assert "caught up optimizer(s) [0] to round(s) [2]" in info[1]["summary"]
    assert "no catch-up needed" in info[0]["summary"]
    old_ckpt, new_ckpt = (torch.load(p, weights_only=True) for p in (old, new))
    old_dir = swarm_root(old) / old_ckpt["swarm"]["save_id"]
    new_dir = swarm_root(new) / new_ckpt["swarm"]["save_id"]
    local = torch.load(old_dir / "island-00001.pt", weights_only=True)["module"]
    anchor_old = torch.load(old_dir / ANCHORS_FILE, weights_only=True)["outer"][0]["anchors"]
    anchor_new = torch.load(new_dir / ANCHORS_FILE, weights_only=True)["outer"][0]["anchors"]
    for name, value in local.items():
        expected = anchor_new[name] + (value - anchor_old[name])
        assert torch.equal(info[1]["start_params"][name], expected), name
        assert torch.equal(info[1]["start_anchors"][0][name], anchor_new[name])
    assert info[1]["outer_steps"] == [2] and info[1]["inner_steps"] == [8]


def test_bfloat16_anchors_resume_exactly(tmp_path: Path) -> None:
    root = tmp_path / "full"
    fit(
        root / "out",
        devices=2,
        island_size=1,
        max_steps=MAX_STEPS,
        ckpt_dir=root / "ckpts",
        anchor_dtype=torch.bfloat16,
    )
    record = torch.load(_ckpt(root, 4), weights_only=True)["swarm"]
    assert record["anchor_dtype"] == "bfloat16"
    resumed = _resume_and_compare(
        root, tmp_path, 4, devices=2, island_size=1, anchor_dtype=torch.bfloat16
    )
    assert resumed[0]["anchor_dtypes"] == ["torch.bfloat16"]
    assert "written as bfloat16" in resumed[0]["summary"]


# A momentum ramp whose every round differs: rounds at steps 3 and 6 and the end-of-fit round
# at 8 use 0, 1/3 and 2/3 of the outer momentum (warm-up over all 3 rounds, no cool-down).
RAMP = {"outer_momentum_warmup": 1.0, "outer_momentum_cooldown": 0.0}


@pytest.mark.parametrize("transport", ["allreduce", "swarm"])
def test_exact_resume_mid_momentum_ramp(tmp_path: Path, transport: str) -> None:
    """The momentum a round uses is a function of the restored round count: a resume between
    rounds of the ramp ends bitwise equal to the run that never stopped, on both transports."""
    root = tmp_path / "full"
    kw: dict[str, object] = {**RAMP, "transport": transport}
    fit(root / "out", devices=2, island_size=1, max_steps=MAX_STEPS, ckpt_dir=root / "ckpts", **kw)
    full = load_ranks(root / "out", 2)
    momentum = full[0]["outer_momentum"]
    assert momentum == pytest.approx([0.9 * 2 / 3]), "the last round's momentum"
    for step in (4, 7):  # after the first and the second round
        _resume_and_compare(root, tmp_path / f"at{step}", step, devices=2, island_size=1, **kw)


@pytest.fixture(scope="module")
def full_run_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 islands of 2 ranks (4 processes), checkpoints after every step."""
    root = tmp_path_factory.mktemp("full2")
    fit(root / "out", devices=4, island_size=2, max_steps=MAX_STEPS, ckpt_dir=root / "ckpts")
    return root


@pytest.mark.parametrize("step", [2, 3, 4])
def test_exact_resume_two_islands_of_two(full_run_2: Path, tmp_path: Path, step: int) -> None:
    resumed = _resume_and_compare(full_run_2, tmp_path, step, devices=4, island_size=2)
    assert [f"island {r // 2}:" in info["summary"] for r, info in enumerate(resumed)] == [True] * 4


def test_resume_callback_needs_the_swarm_strategy(tmp_path: Path) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False)
    with pytest.raises(TypeError, match="SwarmResume needs Trainer\\(strategy=SwarmStrategy"):
        SwarmResume().setup(trainer, None, "fit")  # type: ignore[arg-type]
    strategy = SwarmStrategy()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    SwarmResume(island_ckpt_paths={1: "a.ckpt"}).setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert strategy.checkpointer.island_ckpt_paths == {1: Path("a.ckpt")}


def test_failed_resume_is_not_retried_by_the_next_fit(tmp_path: Path) -> None:
    """``fit(ckpt_path=bad)`` fails; a later ``fit()`` on the same Trainer starts fresh."""
    import torch.distributed as dist

    from tests.resume_utils import DumpFinal, StepDataModel

    fit(tmp_path / "full", devices=1, island_size=1, max_steps=2, ckpt_dir=tmp_path / "ckpts")
    bad = tmp_path / "ckpts" / "step=2.ckpt"
    record = torch.load(bad, weights_only=True)["swarm"]
    island = swarm_root(bad) / record["save_id"] / "island-00000.pt"
    island.write_bytes(island.read_bytes()[:100])
    pl.seed_everything(0)
    # One in-process rank (popen launches no child for devices=1): the Trainer and its
    # SwarmResume keep their state from one fit to the next, as in a script or a notebook.
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SwarmStrategy(sync_every=3, sync_at_end=False, start_method="popen"),
        max_steps=4,  # the failed fit leaves Lightning's loops restored to step 2
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[DumpFinal(tmp_path / "out")],
    )
    model = StepDataModel()
    try:
        with pytest.raises(Exception, match=r"island-00000.pt is truncated"):
            trainer.fit(model, ckpt_path=bad)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer.fit(model)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (info,) = load_ranks(tmp_path / "out", 1)
    assert info["summary"] is None, "the second fit restored a checkpoint it was not given"
    assert info["outer_steps"] == [0] and info["inner_steps"] == [2] and info["global_step"] == 4
    for name, value in before.items():
        assert torch.equal(info["start_params"][name], value), name
        assert torch.equal(info["start_anchors"][0][name], value), name


# -- interrupted saves --------------------------------------------------------------------------
class _CrashingIO(TorchCheckpointIO):
    """Plays a crash after the swarm files and before the Lightning file of one save."""

    def __init__(self, name: str, call: int) -> None:
        super().__init__()
        self.name, self.call, self.calls = name, call, 0

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        if Path(path).name == self.name:
            self.calls += 1
            if self.calls == self.call:
                raise OSError(f"simulated crash before {self.name} was written")
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


class _SaveLatest(pl.Callback):
    """Overwrites one ``latest.ckpt`` after every step (before ModelCheckpoint's own save)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.directory / "latest.ckpt")


def _save_ids(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize(
    ("crash_file", "resumed_step"),
    [("latest.ckpt", 5), ("step=6.ckpt", 6)],
    ids=["overwrite", "new-name"],
)
def test_crash_before_the_lightning_file_keeps_the_previous_checkpoint(
    full_run_1: Path, tmp_path: Path, crash_file: str, resumed_step: int
) -> None:
    """At step 6 one save fails between its swarm files and its Lightning file.

    ``latest.ckpt`` must still resume exactly (from step 5 when its own overwrite failed), and
    the failed save removes its own swarm files at once (issue 22): no extra save under
    ``latest.ckpt.swarm``, no ``step=6.ckpt.swarm`` that no file names. What a killed process
    leaves (it cannot clean up) is removed by the next save: ``remove_orphan_saves`` and
    ``prune_saves``, tested in test_resume_units.py.
    """
    ckpts = tmp_path / "ckpts"
    with pytest.raises(Exception, match=f"simulated crash before {crash_file}"):
        fit(
            tmp_path / "crashed",
            devices=2,
            island_size=1,
            max_steps=MAX_STEPS,
            ckpt_dir=ckpts,
            callbacks=[_SaveLatest(ckpts)],
            checkpoint_io=_CrashingIO(crash_file, call=6 if crash_file == "latest.ckpt" else 1),
        )
    latest = ckpts / "latest.ckpt"
    record = torch.load(latest, weights_only=True)["swarm"]
    assert record["inner_steps"] == [resumed_step]
    assert _save_ids(swarm_root(latest)) == [record["save_id"]]  # only the named save
    if crash_file != "latest.ckpt":
        assert not (ckpts / crash_file).exists() and not swarm_root(ckpts / crash_file).exists()
    fit(
        tmp_path / "resumed",
        devices=2,
        island_size=1,
        max_steps=MAX_STEPS,
        ckpt_path=latest,
        callbacks=[_SaveLatest(ckpts)],
    )
    full, resumed = load_ranks(full_run_1 / "out", 2), load_ranks(tmp_path / "resumed", 2)
    for rank in range(2):
        assert_bitwise_equal(full[rank], resumed[rank], f"resume after the crash, rank {rank}")
    assert f"at inner step(s) [{resumed_step}]" in resumed[0]["summary"]
    for root in ckpts.glob("*.swarm"):
        ckpt = root.with_name(root.name.removesuffix(".swarm"))
        assert ckpt.exists(), f"{root} outlived the crash: no checkpoint names it"
        save_id = torch.load(ckpt, weights_only=True)["swarm"]["save_id"]
        assert _save_ids(root) == [save_id], f"{root} keeps saves its checkpoint does not name"
