"""Issue 22, item 2: the Lightning file's own contents are checked before a resume uses them.

- the swarm record's fields are sealed by a checksum: an edited counter is refused;
- the record is cross-checked against Lightning's loop state (global step, optimizer steps);
- a truncated or unreadable ``.ckpt`` is refused with its name;
- a record of any format but 3 is refused (issue 28: one bit, format 3 -> 2, once skipped the
  record's checksum, and a flipped round count resumed).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.records import RecordError
from tests.resume_utils import edit_record, fit_here, load_ranks

_AUTO = "epoch_loop.automatic_optimization.optim_progress"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One island, checkpoints after every step; ``step=4.ckpt`` is after one round (H=3)."""
    root = tmp_path_factory.mktemp("contents")
    fit_here(root / "out", max_steps=4, ckpt_dir=root / "ckpts")
    return root / "ckpts"


def _copy(ckpts: Path, tmp_path: Path, name: str = "step=4.ckpt") -> Path:
    target = tmp_path / "ckpts"
    shutil.copytree(ckpts, target)
    return target / name


def _edit_lightning(ckpt: Path, edit: Any) -> None:
    checkpoint = torch.load(ckpt, weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, ckpt)


def test_a_flipped_outer_step_count_in_the_record_is_refused(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path)

    def flip(record: dict[str, Any]) -> None:
        record["outer_steps"] = [record["outer_steps"][0] + 1]

    edit_record(ckpt, flip, reseal_it=False)
    with pytest.raises(SwarmCheckpointError, match=r"was changed after it was written") as info:
        fit_here(tmp_path / "out", max_steps=6, ckpt_path=ckpt)
    assert str(ckpt) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_record_set_to_format_2_with_a_flipped_round_is_refused(
    saved: Path, tmp_path: Path
) -> None:
    """Format 2 had no record checksum: a record claiming it must not skip the seal."""
    ckpt = _copy(saved, tmp_path)

    def downgrade(record: dict[str, Any]) -> None:
        assert record["format"] == 3
        record["format"] = 2  # one bit: 0b11 -> 0b10
        record["outer_steps"] = [record["outer_steps"][0] + 1]  # a round that never happened

    edit_record(ckpt, downgrade, reseal_it=False)
    with pytest.raises(RecordError) as info:
        fit_here(tmp_path / "out", max_steps=6, ckpt_path=ckpt)
    message = str(info.value)
    assert f"the swarm record of {ckpt} is of format 2" in message
    assert "this lightning_swarm reads format 3 only" in message
    assert "resume with the lightning_swarm version that wrote it, or start fresh" in message
    assert not (tmp_path / "out").exists()


def test_a_flipped_optimizer_step_counter_is_refused_naming_both(
    saved: Path, tmp_path: Path
) -> None:
    ckpt = _copy(saved, tmp_path)

    def flip(checkpoint: dict[str, Any]) -> None:
        step = checkpoint["loops"]["fit_loop"][_AUTO]["optimizer"]["step"]
        step["total"]["completed"] += 1  # 4 -> 5, as one flipped bit would
        step["total"]["ready"] += 1

    _edit_lightning(ckpt, flip)
    with pytest.raises(
        SwarmCheckpointError, match=r"optimizer steps .* is 5, but its swarm record was saved at 4"
    ):
        fit_here(tmp_path / "out", max_steps=6, ckpt_path=ckpt)
    assert not (tmp_path / "out").exists()


def test_a_changed_global_step_is_refused_naming_both(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path)
    _edit_lightning(ckpt, lambda c: c.update(global_step=7))
    with pytest.raises(SwarmCheckpointError, match=r"global_step is 7, but .* saved at 4"):
        fit_here(tmp_path / "out", max_steps=6, ckpt_path=ckpt)


@pytest.mark.parametrize("keep", [0.6, 0.0])
def test_a_truncated_lightning_file_is_refused_naming_it(
    saved: Path, tmp_path: Path, keep: float
) -> None:
    ckpt = _copy(saved, tmp_path)
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(SwarmCheckpointError, match="is truncated or corrupt") as info:
        fit_here(tmp_path / "out", max_steps=6, ckpt_path=ckpt)
    assert str(ckpt) in str(info.value)


def test_an_intact_checkpoint_still_resumes(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path)
    fit_here(tmp_path / "out", max_steps=6, ckpt_path=ckpt)
    assert load_ranks(tmp_path / "out", 1)[0]["global_step"] == 6
