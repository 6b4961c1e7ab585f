"""The outer loop's side of elastic membership: what a joiner receives and how it installs it.

A live island hands a joiner its global state: per optimizer, the anchors, the outer optimizer
state and the counters (inner and outer steps), exactly what ``OuterSync.state_dict`` holds,
without a round in flight (elastic runs have none between rounds).

A heal keeps the island's own progress (``install``): ``local <- anchor_new + (local -
anchor_old)``, also for an island healed in the middle of a run.

Sharded islands (``shard_outer``, each rank owns a share: ``outer/shard.py``) hand over and
install per rank: rank r's state holds only its share's anchors and outer state, with the
share's position, island size and names, and it is installed only by rank r of an island whose
shares are the same (refused otherwise). Each rank applies the catch-up to its own names; then
the island gathers every parameter from its owner (``after_island_heal``, collective over the
island, on every rank once any rank was healed), as after every round.

A joiner's first round runs at once, outside the inner-step schedule (``join_round``): the live
islands are at their own round; the joiner is healed inside it, contributes nothing, and applies
the same averaged pseudo-gradient, so its anchors equal theirs after that round. Its parameters
then get the catch-up ``local <- global_new + (local - anchor_old)``: a new island, whose
parameters equal its own anchors, lands exactly on the global model; an island resumed from its
own older checkpoint keeps the progress it made since its anchors.

An elastic fit ends on a committed round, the same on every island, with every parameter set to
its anchor (``land_on_anchors``), so that islands end equal whatever ``merge_alpha`` is.

Ownership: ``ElasticOuter`` borrows the outer loop's ``OuterSync`` objects; installed tensors are
adopted by them. The progress kept for the catch-up lives only during ``join_round``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.sync import OuterSync


class ElasticOuter:
    """Heal hooks and the first round of an elastic island's outer syncs."""

    def __init__(self, outer_syncs: Sequence[OuterSync]) -> None:
        self.outer_syncs = list(outer_syncs)
        self.healed = False

    def state(self) -> dict[str, Any]:
        """The global state a joiner needs, one entry per optimizer (tensors are not copied);
        sharded, this rank's share of it."""
        states = []
        for outer in self.outer_syncs:
            state = outer.state_dict()
            if state.pop("pending") is not None:
                raise ValueError("an elastic island cannot hand over a round in flight")
            if outer.shard is not None:
                state["share"] = [outer.shard.position, outer.shard.size]
            states.append(state)
        return {"outer": states}

    @torch.no_grad()
    def install(self, state: dict[str, Any]) -> None:
        """Adopt a live island's global state (anchors, outer state, counters), keeping this
        island's own progress since its anchors: ``local <- anchor_new + (local - anchor_old)``.

        A heal in the middle of a run (the island missed a commit) whose round is then abandoned
        would otherwise leave stale weights under the new anchors, and the island's next
        pseudo-gradient would carry the swarm's whole advance since.
        """
        states = state["outer"]
        if len(states) != len(self.outer_syncs):
            raise ValueError(
                f"the swarm trains {len(states)} optimizer(s), this island "
                f"{len(self.outer_syncs)}; start it with the swarm's model and optimizers"
            )
        for outer, saved in zip(self.outer_syncs, states, strict=True):
            check_share(outer, saved)
            own = _progress(outer)
            outer.load_state_dict({**saved, "pending": None})
            for name in outer.owned:
                outer.params[name].copy_(outer.anchors[name].float() + own[name])
        self.healed = True

    def after_island_heal(self) -> None:
        """Some rank of this island was healed this round: every rank gathers the parameters
        from their owners (collective over the island; nothing to do unsharded)."""
        for outer in self.outer_syncs:
            if outer.shard is not None:
                outer.shard.gather(list(outer.params), outer.params)
                _agree_counters(outer, outer.shard)
        self.healed = True

    @torch.no_grad()
    def join_round(self) -> list[SyncReport]:
        """Each optimizer's first elastic round, now (see the module docstring)."""
        progress = [_progress(outer) for outer in self.outer_syncs]
        self.healed = False
        reports = [outer.round_now() for outer in self.outer_syncs]
        if self.healed:
            for outer, own in zip(self.outer_syncs, progress, strict=True):
                for name in outer.owned:
                    outer.params[name].copy_(outer.anchors[name].float() + own[name])
            self.after_island_heal()
        return reports

    @torch.no_grad()
    def land_on_anchors(self) -> None:
        """Every parameter <- its anchor: how an elastic fit ends, on every island alike.

        The last committed round merged with ``merge_alpha``; its anchors are the same on every
        island, its mixed parameters are not. Copying the anchors is what merging that round
        with alpha 0 gives (the outer step does not depend on alpha), as the static ``finish``
        does.
        """
        for outer in self.outer_syncs:
            for name in outer.owned:
                outer.params[name].copy_(outer.anchors[name])
            if outer.shard is not None:
                outer.shard.gather(list(outer.params), outer.params)


def _agree_counters(outer: OuterSync, shard: IslandShard) -> None:
    """Position 0's inner-step counters on every rank of the island (collective).

    torchft may heal each rank from another live island, and islands at the same committed
    round can differ in inner steps (one abandoned a round another never took part in): the
    shares of one island must count alike, as their checkpoint files are merged by them.
    """
    s = outer.state
    ended = -1 if s.ended_at is None else s.ended_at
    values = [s.inner_steps, *(-1 if v is None else v for v in s.synced_at), ended]
    counters = torch.tensor(values, dtype=torch.int64, device=shard.device)
    dist.broadcast(counters, group=shard.group, group_src=0)
    inner, *synced, ended = (int(v) for v in counters.tolist())
    s.inner_steps, s.ended_at = inner, None if ended < 0 else ended
    s.synced_at = [None if v < 0 else v for v in synced]


def _progress(outer: OuterSync) -> dict[str, torch.Tensor]:
    """``local - anchor`` of each name this rank owns (float32 copies)."""
    return {name: outer.params[name].float() - outer.anchors[name].float() for name in outer.owned}


def check_share(outer: OuterSync, saved: Mapping[str, Any]) -> None:
    """Refuse a healing state that is not this rank's share (another position, island size or
    set of names): the shares of every island of a swarm must be the same.

    Raises:
        ValueError: naming both shares.
    """
    shard = outer.shard
    mine = None if shard is None else [shard.position, shard.size]
    theirs = saved.get("share")
    theirs = None if theirs is None else [int(v) for v in theirs]
    names = saved.get("param_names", list(saved["anchors"]))
    if theirs != mine or (shard is not None and list(names) != outer.owned):
        raise ValueError(
            f"a healing peer sent the share {_share_text(theirs)} with {len(names)} "
            f"tensor(s), but this rank holds the share {_share_text(mine)} with "
            f"{len(outer.owned)}: islands of a swarm must split the outer state alike (the same "
            "number of ranks per island and shard_outer on every island)."
        )


def _share_text(share: list[int] | None) -> str:
    return "'whole outer state'" if share is None else f"'position {share[0]} of {share[1]}'"
