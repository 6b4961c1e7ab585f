"""Resuming the main job through the CLI: exact, and ``ckpt_path=last`` finds the checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_swarm.cli.preflight import resolve_ckpt_path
from tests.cli_utils import RUN_TIMEOUT_S, TINY, swarm_train

# 2 ranks (2 islands), 4 steps per epoch, a round every 3 steps: the epoch-0 checkpoint (step 4)
# falls between rounds, so the resume must restore locals that differ from the anchors.
RESUMABLE = [
    *TINY,
    "callbacks=checkpoint",
    "trainer.max_steps=8",
    "+trainer.limit_train_batches=4",
    "trainer.val_check_interval=4",
    "strategy.sync_every=3",
]


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a loaded checkpoint, keyed by its path in the nesting."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = (
        obj.items()
        if isinstance(obj, dict)
        else enumerate(obj)
        if isinstance(obj, list | tuple)
        else []
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def _final_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Island 0's weights and optimizer state from the Lightning checkpoint, plus every tensor
    of the swarm files beside it (both islands' locals, the anchors, the outer state)."""
    saved = torch.load(ckpt, weights_only=True)
    state = _tensors({"state_dict": saved["state_dict"], "optim": saved["optimizer_states"]})
    for path in sorted(Path(f"{ckpt}.swarm").glob("*/*.pt")):
        state.update(_tensors(torch.load(path, weights_only=True), path.name))
    return state


# The same job with epochs far longer than the run: both checkpoints (steps 4 and 8, written
# after each validation) fall inside epoch 0, so only the saved data position makes the resume
# train on the batches the uninterrupted run trained on.
MID_EPOCH = [
    *TINY,
    "callbacks=checkpoint",
    "trainer.max_steps=8",
    "trainer.val_check_interval=4",
    "strategy.sync_every=3",
]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)  # two CLI runs, one after the other
def test_resume_from_a_mid_epoch_checkpoint_ends_bitwise_equal(tmp_path: Path) -> None:
    full = swarm_train(tmp_path / "full", *MID_EPOCH)
    assert full.returncode == 0, full.stderr[-3000:]
    saved = tmp_path / "full" / "checkpoints"
    assert sorted(p.name for p in saved.glob("*.ckpt")) == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8.ckpt",
    ]
    loops = torch.load(saved / "epoch=0-step=4.ckpt", weights_only=True)["loops"]
    assert loops["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "batches": 4}]
    resumed = swarm_train(
        tmp_path / "resumed",
        *MID_EPOCH,
        f"ckpt_path='{saved / 'epoch=0-step=4.ckpt'}'",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = _final_state(saved / "epoch=0-step=8.ckpt")
    got = _final_state(tmp_path / "resumed" / "checkpoints" / "epoch=0-step=8.ckpt")
    assert want.keys() == got.keys() and len(want) > 10
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different[:5]}"


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)  # two CLI runs, one after the other
def test_resume_through_the_cli_ends_bitwise_equal(tmp_path: Path) -> None:
    full = swarm_train(tmp_path / "full", *RESUMABLE)
    assert full.returncode == 0, full.stderr[-3000:]
    saved = tmp_path / "full" / "checkpoints"
    assert sorted(p.name for p in saved.glob("*.ckpt")) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
    ]
    # The interrupted run: only what existed after epoch 0, in a run directory of its own.
    earlier = tmp_path / "earlier" / "checkpoints"
    earlier.mkdir(parents=True)
    shutil.copy(saved / "epoch=0-step=4.ckpt", earlier)
    shutil.copytree(saved / "epoch=0-step=4.ckpt.swarm", earlier / "epoch=0-step=4.ckpt.swarm")

    resumed = swarm_train(
        tmp_path / "resumed", *RESUMABLE, "ckpt_path=last", f"run_dir={tmp_path / 'earlier'}"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {earlier / 'epoch=0-step=4.ckpt'}" in resumed.stdout
    want = _final_state(saved / "epoch=1-step=8.ckpt")
    got = _final_state(tmp_path / "resumed" / "checkpoints" / "epoch=1-step=8.ckpt")
    assert want.keys() == got.keys() and len(want) > 10
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different[:5]}"


def _touch(path: Path, mtime: int) -> Path:
    """A small complete (plain Lightning) checkpoint with modification time ``mtime``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_last_takes_the_newest_checkpoint_under_the_run_dir(tmp_path: Path) -> None:
    _touch(tmp_path / "checkpoints" / "epoch=0-step=4.ckpt", 1_000)
    newest = _touch(tmp_path / "logs" / "version_0" / "checkpoints" / "epoch=1-step=8.ckpt", 2_000)
    _touch(tmp_path / "checkpoints" / "epoch=1-step=8.ckpt.swarm" / "x" / "anchors.pt", 3_000)
    assert resolve_ckpt_path("last", str(tmp_path), []) == str(newest.resolve())
    # any other value is a path, passed on as given (once it is known to exist)
    other = str(tmp_path / "checkpoints" / "epoch=0-step=4.ckpt")
    assert resolve_ckpt_path(other, None, []) == other
    assert resolve_ckpt_path(None, str(tmp_path), []) is None


def test_last_uses_the_checkpoint_folder_without_run_dir(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = _touch(tmp_path / "ck" / "epoch=0-step=4.ckpt", 1_000)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ck")]
    assert resolve_ckpt_path("last", None, callbacks) == str(ckpt.resolve())


@pytest.mark.parametrize(
    ("run_dir", "with_callback", "message"),
    [
        (None, False, "ckpt_path=last needs a place to look: add run_dir="),
        ("missing", False, "run_dir='.*missing' is not a folder"),
        ("empty", False, "ckpt_path=last found no \\*.ckpt file under .*empty"),
        (None, True, "ckpt_path=last found no \\*.ckpt file under .*ck"),
    ],
)
def test_last_without_a_checkpoint_names_where_it_looked(
    tmp_path: Path, run_dir: str | None, with_callback: bool, message: str
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    (tmp_path / "empty").mkdir()
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ck")] if with_callback else []
    where = None if run_dir is None else str(tmp_path / run_dir)
    with pytest.raises(ValueError, match=message):
        resolve_ckpt_path("last", where, callbacks)
