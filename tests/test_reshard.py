"""Resume onto another layout (``resume.reshard``): another dp or tp size, DDP to FSDP islands
and back, another island count; each ends equal to an independent reference.

``MovableModel`` trains an island alike under every layout (``tests/reshard_utils.py``), so a
run that moves mid-way must end where an uninterrupted run on either layout ends, and where
``simulate`` (DiLoCo in plain torch) ends, within float rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_swarm.errors import SwarmCheckpointError
from tests.reshard_utils import fit_movable, load_dumps, simulate

STEPS = 9
TOL = dict(rtol=0, atol=1e-5)
FSDP = {"island_size": 2, "island_parallel": "fsdp"}
TP = {"island_size": 2, "island_parallel": "fsdp", "tensor_parallel_size": 2}


def _close_to(dumps: list[dict], islands: list[dict[str, torch.Tensor]], where: str) -> None:
    for dump in dumps:
        expected = islands[dump["island"]]
        for name, value in dump["params"].items():
            torch.testing.assert_close(value, expected[name], **TOL, msg=f"{where}: {name}")


def test_plain_torch_reference_matches_ddp_islands(tmp_path: Path) -> None:
    fit_movable(tmp_path / "ddp", devices=2, max_steps=STEPS)
    islands, _ = simulate({0: 2}, STEPS)
    _close_to(load_dumps(tmp_path / "ddp", 2), islands, "DDP 2x1 against plain torch")


def test_fsdp_islands_mid_round_resume_as_ddp_islands(tmp_path: Path) -> None:
    fit_movable(tmp_path / "fsdp", devices=4, max_steps=STEPS, ckpt_dir=tmp_path / "ck", **FSDP)
    ckpt = tmp_path / "ck" / "step=5.ckpt"  # between rounds (3 and 6): the islands differ
    fit_movable(tmp_path / "moved", devices=2, max_steps=STEPS, ckpt_path=ckpt)
    moved = load_dumps(tmp_path / "moved", 2)
    assert "moved from 2 FSDP island(s) of data_parallel=2" in moved[0]["summary"]
    islands, _ = simulate({0: 2}, STEPS)
    _close_to(load_dumps(tmp_path / "fsdp", 4), islands, "FSDP 2x2 uninterrupted")
    _close_to(moved, islands, "FSDP 2x2 resumed as DDP 2x1")


def test_ddp_islands_mid_round_resume_as_tensor_parallel_islands(tmp_path: Path) -> None:
    fit_movable(tmp_path / "ddp", devices=2, max_steps=STEPS, ckpt_dir=tmp_path / "ck")
    fit_movable(
        tmp_path / "moved",
        devices=4,
        max_steps=STEPS,
        ckpt_path=tmp_path / "ck" / "step=4.ckpt",
        **TP,
    )
    islands, _ = simulate({0: 2}, STEPS)
    _close_to(load_dumps(tmp_path / "moved", 4), islands, "DDP 2x1 resumed as TP 2x2")


def test_two_islands_at_a_round_boundary_resume_as_three(tmp_path: Path) -> None:
    fit_movable(tmp_path / "two", devices=2, max_steps=6, ckpt_dir=tmp_path / "ck")
    fit_movable(
        tmp_path / "three",
        devices=3,
        max_steps=STEPS,
        ckpt_path=tmp_path / "ck" / "step=6.ckpt",
    )
    islands, anchors = simulate({0: 2, 6: 3}, STEPS)
    three = load_dumps(tmp_path / "three", 3)
    assert any("new island(s) [2] start from the anchors" in w for w in three[0]["warnings"])
    _close_to(three, islands, "2 islands resumed as 3 at step 6")
    for name, value in three[2]["anchors"].items():
        torch.testing.assert_close(value, anchors[name], **TOL)


def test_three_islands_mid_round_resume_as_two_drops_the_third(tmp_path: Path) -> None:
    fit_movable(tmp_path / "three", devices=3, max_steps=5, ckpt_dir=tmp_path / "ck")
    fit_movable(
        tmp_path / "two", devices=2, max_steps=STEPS, ckpt_path=tmp_path / "ck" / "step=4.ckpt"
    )
    islands, _ = simulate({0: 3, 4: 2}, STEPS)
    two = load_dumps(tmp_path / "two", 2)
    assert any("island(s) [2] are dropped with their progress" in w for w in two[0]["warnings"])
    _close_to(two, islands, "3 islands resumed as 2 at step 4")


def test_a_round_in_flight_is_refused_by_name(tmp_path: Path) -> None:
    options = {"num_fragments": 1, "sync_delay": 1}
    fit_movable(tmp_path / "a", devices=2, max_steps=5, ckpt_dir=tmp_path / "ck", **options)
    with pytest.raises(Exception, match="was in flight at this checkpoint"):
        fit_movable(
            tmp_path / "b",
            devices=3,
            max_steps=STEPS,
            ckpt_path=tmp_path / "ck" / "step=3.ckpt",
            **options,
        )
