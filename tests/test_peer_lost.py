"""A peer that goes away says so (issue 27, item 5): a static rank whose peer island was killed
stops with ``PeerLostError`` naming the island, its rank and the round, and what to do; under
``transport="swarm"`` too (issue 39, item 4).

Each rank is its own process (``tests/peer_lost_rank.py``), so the killed one dies alone and the
survivor's error is its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_swarm import PeerLostError, SwarmError
from lightning_swarm.island_ddp import timeouts_explained
from tests.cli_utils import run_rank_processes
from tests.peer_lost_rank import WORLD


@pytest.mark.parametrize(
    ("when", "transport"),
    [("between", "allreduce"), ("mid", "allreduce"), ("mid", "swarm")],
)
def test_a_killed_peer_island_is_named_with_the_round_and_what_to_do(
    tmp_path: Path, when: str, transport: str
) -> None:
    # The bound is the test's own, far above the 2-3 s the survivor takes (not a timing test).
    procs, outputs = run_rank_processes(
        "tests.peer_lost_rank", [str(tmp_path), when, transport], WORLD, 90, wait_for=1
    )
    survivor, err = procs[0], outputs[0][1]
    assert survivor.returncode != 0, err[-3000:]
    assert procs[1].returncode == -9, "rank 1 was to kill itself"
    result = torch.load(tmp_path / "rank0.pt")
    assert result["exception"] == "PeerLostError", result
    message = result["message"]
    # Rank 1 dies after round 0 (step 4): round 1 (step 8) finds it gone.
    assert message.startswith("rank 0, island 0, round 1: island 1 (global rank 1) went away"), (
        message
    )
    assert "Connection reset by peer" in message or "Connection closed by peer" in message
    assert "Restart the fit from the last checkpoint (ckpt_path=last)" in message
    assert "use elastic islands (membership='torchft'" in message


def test_a_peer_lost_outside_the_round_names_this_rank() -> None:
    with pytest.raises(PeerLostError) as caught, timeouts_explained(60, rank=3):
        raise RuntimeError(
            "[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:4"
        )
    message = str(caught.value)
    assert message.startswith("rank 3: a rank of this run (the one whose address torch names)")
    assert "Connection closed by peer [10.0.0.2]:4" in message
    assert isinstance(caught.value, SwarmError) and isinstance(caught.value, RuntimeError)


def test_the_rank_that_died_first_is_named_by_the_ranks_it_took_down(tmp_path: Path) -> None:
    """FSDP islands of two ranks: rank 1 dies; rank 0 stops in an island collective, and the
    other island finds rank 0 (gone as a consequence) and rank 1 missing at the next round.
    Rank 2, whose connection to rank 0 closed, names rank 1 as the rank that died first; no
    survivor's error puts rank 0 among the suspects."""
    from tests.fsdp_kill_rank import WORLD as FSDP_WORLD

    procs, outputs = run_rank_processes(
        "tests.fsdp_kill_rank", [str(tmp_path)], FSDP_WORLD, 120, wait_for=1
    )
    assert procs[1].returncode == -9, "rank 1 was to kill itself"
    messages = {}
    for rank in (0, 2, 3):
        assert procs[rank].returncode != 0, outputs[rank][1][-3000:]
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["exception"] == "PeerLostError", result
        messages[rank] = result["message"]
    assert "island 0 (global rank 0) went away" in messages[2], messages[2]
    assert "Global rank 1 died first: every other rank ([0, 2, 3])" in messages[2], messages[2]
    for rank in (0, 3):  # they may stop before rank 2 reports: rank 1 among the suspects
        message = messages[rank]
        assert "Global rank 1 died first" in message or (
            "so none of them died first; the rank that did is among [1" in message
        ), message
