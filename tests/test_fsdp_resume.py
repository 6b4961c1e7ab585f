"""Checkpoints of model-sharded islands: per-rank files that keep every island's shards.

2 islands x 2 FSDP2 ranks, a checkpoint after every step; a resume from a checkpoint taken
between two rounds (the islands differ then) must continue bit for bit, also with a round in
flight (fragments and ``sync_delay``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_swarm.resume.files import swarm_root
from tests.cli_utils import RUN_TIMEOUT_S, run_group, tree_env
from tests.fsdp_utils import TensorParallelStepModel, fit_sharded
from tests.resume_utils import load_ranks

MAX_STEPS = 8
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "fragments_delay": {"sync_every": 4, "num_fragments": 2, "sync_delay": 1},
    "tensor_parallel": {"tensor_parallel_size": 2, "model": TensorParallelStepModel},
}


def _assert_same(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), f"{where}: param {key}"
    for oa, ob in zip(a["anchors"], b["anchors"], strict=True):
        for key, value in oa.items():
            assert torch.equal(value, ob[key]), f"{where}: anchor {key}"
    assert (a["inner_steps"], a["outer_steps"]) == (b["inner_steps"], b["outer_steps"]), where
    for index, state in a["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"][index][key]), f"{where}: adam {key}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_mid_round_is_bitwise(tmp_path: Path, case: str) -> None:
    options = CASES[case]
    fit_sharded(tmp_path / "full", max_steps=MAX_STEPS, ckpt_dir=tmp_path / "ckpts", **options)
    ckpt = tmp_path / "ckpts" / "step=5.ckpt"  # between rounds: the islands differ
    fit_sharded(tmp_path / "resumed", max_steps=MAX_STEPS, ckpt_path=ckpt, **options)
    full, resumed = load_ranks(tmp_path / "full", 4), load_ranks(tmp_path / "resumed", 4)
    for rank in range(4):
        assert "from this rank's own files" in resumed[rank]["summary"]
        _assert_same(full[rank], resumed[rank], f"rank {rank}")


def test_save_keeps_every_island_shards(tmp_path: Path) -> None:
    # max_steps past step 5: at the end of fit the islands are made equal again (sync_at_end)
    fit_sharded(tmp_path / "full", max_steps=6, ckpt_dir=tmp_path / "ckpts")
    ckpt = tmp_path / "ckpts" / "step=5.ckpt"
    record = torch.load(ckpt, weights_only=True)
    assert record["state_dict"] == {}  # the weights are in the per-rank files only
    directory = swarm_root(ckpt) / record["swarm"]["save_id"]
    names = sorted(p.name for p in directory.iterdir())
    assert names == [
        "anchors-rank-00000.pt",
        "anchors-rank-00001.pt",
        "island-00000-rank-00000.pt",
        "island-00000-rank-00001.pt",
        "island-00001-rank-00000.pt",
        "island-00001-rank-00001.pt",
    ]
    assert sorted(record["swarm"]["files"]) == names
    shards = {
        (i, r): torch.load(directory / f"island-{i:05d}-rank-{r:05d}.pt", weights_only=True)
        for i in range(2)
        for r in range(2)
    }
    for position, rows in ((0, 3), (1, 2)):  # Linear(6, 5) over 2 ranks: uneven
        weights = [shards[(i, position)]["module"]["net.0.weight"] for i in range(2)]
        assert weights[0].shape == weights[1].shape == (rows, 6)
        # two steps after the round at step 3 the islands differ: both were kept
        assert not torch.equal(weights[0], weights[1]), position
    assert shards[(0, 1)]["module"]["net.2.weight"].shape == (0, 5)  # the empty shard
    anchors = [
        torch.load(directory / f"anchors-rank-{r:05d}.pt", weights_only=True) for r in (0, 1)
    ]
    assert anchors[0]["outer"][0]["anchors"]["net.0.weight"].shape == (3, 6)
    assert anchors[1]["outer"][0]["anchors"]["net.0.weight"].shape == (2, 6)


def test_plain_checkpoint_weights_are_sharded_into_fsdp_islands(tmp_path: Path) -> None:
    """A plain Lightning checkpoint (full weights, no swarm record) starts FSDP islands: each
    rank takes its slices, uneven and empty shards included."""
    import lightning.pytorch as pl

    from tests.fsdp_utils import ShardedStepModel

    pl.seed_everything(5)
    module = ShardedStepModel()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=0, logger=False)
    trainer.strategy.connect(module)
    ckpt = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(ckpt)
    fit_sharded(tmp_path / "out", max_steps=1, ckpt_path=ckpt, sync_every=1)
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    for rank in range(4):
        start = torch.load(tmp_path / "out" / f"rank{rank}.pt", weights_only=True)["start"]
        for name, value in saved.items():
            rows = {0: slice(0, 3), 1: slice(3, 5)}[rank % 2]
            if name.startswith("net.2"):
                rows = {0: slice(0, 1), 1: slice(1, 1)}[rank % 2]
            assert torch.equal(start[name], value[rows]), (rank, name)


def test_each_rank_reads_only_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restore I/O per rank is its own island file and its own anchor shard, nothing else."""
    import torch.distributed as dist

    import lightning_swarm.resume.restore as restore

    fit_sharded(tmp_path / "full", max_steps=4, ckpt_dir=tmp_path / "ckpts")
    log = tmp_path / "reads"
    log.mkdir()
    real_load, real_check = restore.load_swarm_file, restore.check_file

    def record(kind: str, path: Path) -> None:
        with open(log / f"rank{dist.get_rank()}", "a") as handle:
            handle.write(f"{kind} {path.name}\n")

    def load(path: Path, *, mmap: bool) -> Any:
        record("load", path)
        return real_load(path, mmap=mmap)

    def check(path: Path, expected: Any, *, verify: bool) -> None:
        record("check", path)
        real_check(path, expected, verify=verify)

    # Patched before the fork launcher starts the ranks, so every rank runs the recorders.
    monkeypatch.setattr(restore, "load_swarm_file", load)
    monkeypatch.setattr(restore, "check_file", check)
    fit_sharded(tmp_path / "resumed", max_steps=5, ckpt_path=tmp_path / "ckpts" / "step=4.ckpt")
    for rank in range(4):
        island, position = divmod(rank, 2)
        own = [f"island-{island:05d}-rank-{position:05d}.pt", f"anchors-rank-{position:05d}.pt"]
        reads = (log / f"rank{rank}").read_text().split()
        assert reads == ["check", own[0], "load", own[0], "check", own[1], "load", own[1]], rank


def _fit_one_rank(
    ckpt_dir: Path, *, max_steps: int, strategy: dict[str, Any], ckpt_path: Path | None = None
) -> None:
    """One rank in this process (so pytest sees its warnings): one FSDP island of one rank."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_swarm import SwarmStrategy
    from tests.fsdp_utils import ShardedStepModel

    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SwarmStrategy(
            island_parallel="fsdp", sync_every=2, start_method="popen", **strategy
        ),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
    )
    try:
        trainer.fit(ShardedStepModel(), ckpt_path=ckpt_path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fits_with_changed_options(root: str) -> None:
    """Two one-rank fits, the second resuming with merge_alpha changed; prints each warning."""
    import warnings

    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_one_rank(Path(root) / "ckpts", max_steps=3, strategy={})
        ckpt = Path(root) / "ckpts" / "step=3.ckpt"
        _fit_one_rank(
            Path(root) / "ckpts2", max_steps=4, strategy={"merge_alpha": 0.5}, ckpt_path=ckpt
        )
    for warning in caught:
        print(f"WARNING: {warning.message}")


def test_changed_options_warn_on_a_per_rank_resume(tmp_path: Path) -> None:
    # In a process of its own: an in-process fit leaves this process in a state where a later
    # test's forked ranks hung at exit (seen with tests/test_swarm_factory.py after this one).
    code = (
        f"from tests.test_fsdp_resume import _fits_with_changed_options as f; f({str(tmp_path)!r})"
    )
    done = run_group(
        [sys.executable, "-c", code], env=tree_env(OMP_NUM_THREADS="1"), timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"WARNING: .*merge_alpha 0\.0 -> 0\.5", done.stdout), done.stdout[-3000:]
