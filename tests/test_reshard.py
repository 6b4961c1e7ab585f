"""Resume onto another layout (``resume.reshard``): another dp or tp size, DDP to FSDP islands
and back, another island count; each ends equal to an independent reference.

``MovableModel`` trains an island alike under every layout (``tests/reshard_utils.py``), so a
run that moves mid-way must end where an uninterrupted run on either layout ends, and where
``simulate`` (DiLoCo in plain torch) ends, within float rounding.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reshard_utils import fit_movable, load_dumps, simulate
from tests.resume_utils import swarm_dir

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


LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {  # devices for 2 islands, strategy options
    "ddp 2x1": (2, {}),
    "ddp 2x2": (4, {"island_size": 2}),  # the outer state sharded between the 2 ranks
    "fsdp 2x2": (4, {"island_size": 2, "island_parallel": "fsdp"}),
    "fsdp 2x4": (8, {"island_size": 4, "island_parallel": "fsdp"}),
    "tp 2x2": (4, {"island_size": 2, "island_parallel": "fsdp", "tensor_parallel_size": 2}),
}
# The default run keeps three moves (sharded to whole, whole to tensor parallel, dp 2 to 4);
# the rest run with -m slow, to keep the default suite inside its time budget.
SLOW = pytest.mark.slow
MOVES = [
    pytest.param("fsdp 2x2", "ddp 2x1", id="fsdp 2x2 to ddp 2x1"),
    pytest.param("ddp 2x1", "tp 2x2", id="ddp 2x1 to tp 2x2"),
    pytest.param("ddp 2x2", "fsdp 2x2", id="ddp 2x2 to fsdp 2x2", marks=SLOW),
    pytest.param("fsdp 2x2", "ddp 2x2", id="fsdp 2x2 to ddp 2x2", marks=SLOW),
    pytest.param("fsdp 2x2", "fsdp 2x4", id="fsdp 2x2 to fsdp 2x4"),
    pytest.param("tp 2x2", "fsdp 2x2", id="tp 2x2 to fsdp 2x2", marks=SLOW),
]


@pytest.mark.parametrize(("source", "target"), MOVES)
def test_a_mid_round_checkpoint_moves_to_another_layout(
    tmp_path: Path, source: str, target: str
) -> None:
    """Saved at step 5, between the rounds of steps 3 and 6 (the islands differ), resumed on
    another layout: both runs end where DiLoCo in plain torch ends."""
    devices, options = LAYOUTS[source]
    fit_movable(
        tmp_path / "a", devices=devices, max_steps=STEPS, ckpt_dir=tmp_path / "ck", **options
    )
    devices, options = LAYOUTS[target]
    ckpt = tmp_path / "ck" / "step=5.ckpt"
    fit_movable(tmp_path / "b", devices=devices, max_steps=STEPS, ckpt_path=ckpt, **options)
    moved = load_dumps(tmp_path / "b", devices)
    assert all("moved from 2" in dump["summary"] for dump in moved)
    islands, _ = simulate({0: 2}, STEPS)
    _close_to(load_dumps(tmp_path / "a", LAYOUTS[source][0]), islands, f"{source} uninterrupted")
    _close_to(moved, islands, f"{source} resumed as {target}")


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


@pytest.mark.parametrize("damage", ["missing", pytest.param("truncated", marks=SLOW)])
def test_a_missing_or_truncated_rank_file_under_a_reshard_is_named(
    tmp_path: Path, damage: str
) -> None:
    fit_movable(tmp_path / "fsdp", devices=4, max_steps=4, ckpt_dir=tmp_path / "ck", **FSDP)
    ckpt = tmp_path / "ck" / "step=4.ckpt"
    directory = swarm_dir(ckpt)
    victim = directory / (
        "island-00001-rank-00001.pt" if damage == "missing" else "anchors-rank-00001.pt"
    )
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(Exception, match=re.escape(victim.name)) as err:
        fit_movable(tmp_path / "moved", devices=2, max_steps=STEPS, ckpt_path=ckpt)
    assert "SwarmCheckpointError" in str(err.value)


def test_anchors_outer_state_and_island_weights_move_bit_for_bit(tmp_path: Path) -> None:
    """FSDP 2x2 saved mid-round, resumed as DDP 2x1 for no step: every tensor is the saved
    shards joined, bit for bit."""
    fit_movable(tmp_path / "fsdp", devices=4, max_steps=5, ckpt_dir=tmp_path / "ck", **FSDP)
    ckpt = tmp_path / "ck" / "step=5.ckpt"
    fit_movable(tmp_path / "ddp", devices=2, max_steps=5, ckpt_path=ckpt, sync_at_end=False)
    directory = swarm_dir(ckpt)

    def load(name: str) -> dict:
        return torch.load(directory / name, weights_only=True)

    def joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    outer = [load(f"anchors-rank-{r:05d}.pt")["outer"][0] for r in range(2)]
    saved_anchors = joined([o["anchors"] for o in outer])
    momentum = joined(
        [
            {
                name: o["outer_optimizer"]["state"][i]["momentum_buffer"]
                for i, name in enumerate(o.get("param_names") or list(o["anchors"]))
            }
            for o in outer
        ]
    )
    for dump in load_dumps(tmp_path / "ddp", 2):
        island = dump["island"]
        module = joined([load(f"island-{island:05d}-rank-{r:05d}.pt")["module"] for r in range(2)])
        for name, value in dump["params"].items():
            assert torch.equal(value, module[name]), f"island {island}: {name}"
        for name, value in dump["anchors"].items():
            assert torch.equal(value, saved_anchors[name]), f"anchor {name}"
            assert torch.equal(dump["momentum"][name], momentum[name]), f"momentum {name}"
        assert len(dump["momentum"]) == len(saved_anchors) == 4
