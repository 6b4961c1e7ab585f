"""The per-rank hand-over of a sharded elastic island (``SyncState.peer_offer`` and
``SyncState.install_heal``) and the island's agreement on how a round ends
(``membership/fanout.py``), without torchft."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.membership.errors import DuplicateIslandError
from lightning_swarm.membership.fanout import IslandFanout
from lightning_swarm.outer import OuterSync
from lightning_swarm.outer.shard import IslandShard, partition_by_bytes
from lightning_swarm.transport.base import RoundStats
from tests.dist_utils import run_ranks
from tests.transport_rounds import NamedRound

SHAPES = {"a.weight": (4, 3), "a.bias": (4,), "b.weight": (2, 4), "b.bias": (2,)}


class _NoExchange(NamedRound):
    """A transport that leaves the pseudo-gradients as they are."""


def _sync(seed: int, position: int | None, size: int = 2) -> OuterSync:
    """One rank's OuterSync: position ``position`` of an island of ``size`` (None: whole)."""
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}
    shard = None
    if position is not None:
        sizes = {n: p.numel() * 4 for n, p in params.items()}
        owner = partition_by_bytes([list(params)], sizes, size)
        # The hand-over itself is local; only a gather would use the group.
        shard = IslandShard(None, position, size, owner, 1 << 20)  # type: ignore[arg-type]
    sgd = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    return OuterSync(
        params, outer_optimizer=sgd, transport=_NoExchange(), sync_every=2, shard=shard
    )


def _advance(outer: OuterSync, seed: int) -> None:
    """Move the live share on, as rounds would: anchors stepped (momentum built), counters up."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for name in outer.owned:
            outer.anchors[name].grad = torch.randn(outer.anchors[name].shape, generator=gen)
        outer.outer_optimizer.step()
    outer.inner_steps, outer.outer_steps = 6, 3


def _heal(outer: OuterSync, state: dict[str, Any]) -> None:
    """A heal as the round engine installs it, on the training thread, at the round's apply."""
    outer.install_heal(RoundStats(heal=state))


def test_each_rank_installs_its_own_share_and_keeps_its_progress() -> None:
    """Rank r of a joiner gets rank r's share of a live island: that share's anchors, outer
    optimizer state and counters, and the catch-up local <- new + (local - old) on its own
    names only; the names another rank owns are left to the island's gather."""
    for position in (0, 1):
        live = _sync(1, position)
        _advance(live, 2)
        joiner = _sync(7, position)
        with torch.no_grad():
            for p in joiner.params.values():
                p.add_(0.25)  # its progress since its own anchors
        before = {n: p.detach().clone() for n, p in joiner.params.items()}
        old = {n: a.clone() for n, a in joiner.anchors.items()}
        state = live.peer_offer()
        assert state["share"] == [position, 2]
        assert set(state["anchors"]) == set(live.owned)  # only its share moves
        _heal(joiner, state)
        assert joiner.owned == live.owned and len(joiner.owned) < len(SHAPES)
        assert (joiner.outer_steps, joiner.inner_steps) == (live.outer_steps, live.inner_steps)
        for name in joiner.owned:
            assert joiner.anchors[name].equal(live.anchors[name])
            momentum = joiner.outer_optimizer.state[joiner.anchors[name]]["momentum_buffer"]
            assert momentum.equal(live.outer_optimizer.state[live.anchors[name]]["momentum_buffer"])
            expected = live.anchors[name] + (before[name] - old[name])
            assert joiner.params[name].detach().equal(expected), name
        for name in set(SHAPES) - set(joiner.owned):
            assert joiner.params[name].detach().equal(before[name]), name


@pytest.mark.parametrize(
    ("giver", "taker", "named"),
    [
        (
            0,
            1,
            "sent the share 'position 0 of 2' with 2 tensor(s), but this rank holds the "
            "share 'position 1 of 2'",
        ),
        (
            None,
            0,
            "sent the share 'whole outer state' with 4 tensor(s), but this rank holds "
            "the share 'position 0 of 2'",
        ),
        (
            0,
            None,
            "sent the share 'position 0 of 2' with 2 tensor(s), but this rank holds the "
            "share 'whole outer state'",
        ),
    ],
)
def test_a_share_that_is_not_this_ranks_is_refused(
    giver: int | None, taker: int | None, named: str
) -> None:
    live, joiner = _sync(1, giver), _sync(7, taker)
    anchors = {n: a.clone() for n, a in joiner.anchors.items()}
    with pytest.raises(
        ValueError, match="islands of a swarm must split the outer state alike"
    ) as err:
        _heal(joiner, live.peer_offer())
    assert named in str(err.value)
    assert all(joiner.anchors[n].equal(a) for n, a in anchors.items())  # nothing installed


def _agree(rank: int, world: int, out: Path) -> None:
    fanout = IslandFanout(dist.group.WORLD)
    # Every rank committed and none healed; then rank 1 alone healed and rank 0's vote failed.
    assert fanout.agree_round(None, committed=True, healed=False) == (True, False)
    assert fanout.agree_round(None, committed=rank == 1, healed=rank == 1) == (False, True)
    assert fanout.all_true(rank == 0) is False and fanout.all_true(True) is True
    assert fanout.on_leader(lambda: f"from {rank}", "") == "from 0"
    # Only rank 1 was refused: every rank raises its error, with its message.
    error = DuplicateIslandError("island_id 'c' is already taken") if rank == 1 else None
    with pytest.raises(DuplicateIslandError, match="island_id 'c' is already taken"):
        fanout.agree_round(error, committed=False, healed=False)
    (out / f"rank{rank}").write_text("ok")


def test_the_ranks_of_an_island_end_a_round_alike(tmp_path: Path) -> None:
    run_ranks(_agree, 2, tmp_path, timeout_s=30)
    assert {p.name for p in tmp_path.iterdir()} == {"rank0", "rank1"}


def test_an_island_that_splits_the_outer_state_otherwise_is_told_how_to_fix_it() -> None:
    from lightning_swarm.membership.errors import SettingsMismatchError
    from lightning_swarm.membership.round_header import HeaderRow, refusal

    swarm, mine = HeaderRow(1, 7, 0, 1, 1, 1, 5, 10), HeaderRow(2, 7, 0, 2, 2, 1, 6, 10)
    error = refusal([swarm, mine], mine, "y", {"outer_shares": 2}, {"outer_shares": 1})
    assert isinstance(error, SettingsMismatchError)
    assert "outer_shares is 2 here but 1 in the swarm" in str(error)
    assert "give every island the same number of ranks, or set shard_outer=False" in str(error)
    other = refusal([swarm, mine], mine, "y", {"sync_every": 2}, {"sync_every": 4})
    assert "shard_outer" not in str(other)  # the hint only where the shares differ


class _Recording(_NoExchange):
    """Records what each round handed it; ``every_rank_in_round`` as an elastic island's."""

    def __init__(self, every_rank: bool) -> None:
        self.every_rank_in_round = every_rank
        self.calls: list[list[str]] = []

    def average_named(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        self.calls.append(sorted(tensors))
        return super().average_named(tensors, round_index=round_index)


def _empty_share(rank: int, world: int, out: Path) -> None:
    """Two fragments of one tensor each over two ranks: each rank's share of the other's
    fragment is empty. A transport whose round needs every rank (one torchft Manager per rank
    waits for all of them) still gets that rank's round, with nothing in it."""
    from lightning_swarm.outer.sync_state import StreamingOptions

    for every_rank in (True, False):
        params = {n: torch.nn.Parameter(torch.ones(3)) for n in ("w", "v")}
        shard = IslandShard(dist.group.WORLD, rank, 2, {"w": 0, "v": 1}, 1 << 20)
        transport = _Recording(every_rank)
        outer = OuterSync(
            params,
            outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7),
            transport=transport,
            sync_every=2,
            shard=shard,
            streaming=StreamingOptions(fragments=[["w"], ["v"]]),
        )
        outer.engine.round(0)
        expected = [["w"]] if rank == 0 else ([[]] if every_rank else [])
        assert transport.calls == expected, (rank, every_rank, transport.calls)
    (out / f"rank{rank}").write_text("ok")


def test_a_rank_with_an_empty_share_still_takes_part_in_an_elastic_round(tmp_path: Path) -> None:
    run_ranks(_empty_share, 2, tmp_path, timeout_s=30)
    assert {p.name for p in tmp_path.iterdir()} == {"rank0", "rank1"}


def _counters(rank: int, world: int, out: Path) -> None:
    """torchft may heal rank 0 and rank 1 of one island from two live islands whose inner-step
    counts differ: after the heal both ranks count like position 0 and hold every parameter."""
    params = {n: torch.nn.Parameter(torch.full((2,), float(rank))) for n in ("w", "v")}
    shard = IslandShard(dist.group.WORLD, rank, 2, {"w": 0, "v": 1}, 1 << 20)
    outer = OuterSync(
        params,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7),
        transport=_NoExchange(),
        sync_every=2,
        shard=shard,
    )
    outer.inner_steps = 40 if rank == 0 else 44  # from two different sources
    outer.synced_at = [40 if rank == 0 else 44]
    outer.install_heal(RoundStats(island_healed=True))
    assert (outer.inner_steps, outer.synced_at) == (40, [40])
    assert params["w"].detach().equal(torch.zeros(2)) and params["v"].detach().equal(torch.ones(2))
    (out / f"rank{rank}").write_text("ok")


def test_after_a_heal_the_shares_of_an_island_count_alike(tmp_path: Path) -> None:
    run_ranks(_counters, 2, tmp_path, timeout_s=30)
    assert {p.name for p in tmp_path.iterdir()} == {"rank0", "rank1"}
