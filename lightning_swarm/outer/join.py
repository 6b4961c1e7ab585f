"""The outer loop's side of elastic membership: what a joiner receives and how it installs it.

A joiner receives anchors, outer optimizer state and counters, never a round in flight nor
residuals (an island's own quantization error). A heal arrives on the exchange's thread:
``install`` keeps it until ``settle`` installs it on the training thread as
``local <- anchor_new + (local - anchor_old)``, keeping the island's progress. A joiner's first
round (``join_round``) contributes nothing and applies the swarm's mean, so its anchors equal the
others'. An elastic fit ends with every parameter on its anchor (``land_on_anchors``).
``ElasticOuter`` borrows the loop's ``OuterSync`` objects, which adopt installed tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from lightning_swarm.algorithm import global_norm
from lightning_swarm.membership.adopt import AdoptedRound, RoundAdoption, RoundPlace
from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.sync import OuterSync
from lightning_swarm.outer.sync_state import Exchanged, RoundInFlight
from lightning_swarm.resume.outer_record import OuterRecord
from lightning_swarm.transport.base import RoundStats

TakeAdopted = Callable[[], AdoptedRound | None]


class ElasticOuter:
    """Heal hooks, the first round and the adopted rounds of an elastic island's outer syncs.

    Args:
        outer_syncs: the outer loop's syncs (one: elastic islands train one optimizer).
        take_adopted: the membership's ``take_adopted`` (``None``: rounds are never adopted).
    """

    def __init__(
        self, outer_syncs: Sequence[OuterSync], take_adopted: TakeAdopted | None = None
    ) -> None:
        self.outer_syncs = list(outer_syncs)
        self.take_adopted = take_adopted
        self.healed = False
        self._kept: list[OuterRecord] | None = None
        self._island_healed = False  # a rank of the island was healed: settle gathers
        self._joining = False

    def connect(self, adoption: RoundAdoption) -> None:
        """Wire this island's membership (``TorchftMembership.adoption``) to these syncs: it
        learns each fragment's shapes and where a round sits, and hands adopted rounds here.
        ``settle`` must then run on the training thread after every round's report."""
        adoption.fragments = fragment_shapes(self.outer_syncs[0])
        adoption.place_fn = self.place
        self.take_adopted = adoption.take

    def place(self) -> RoundPlace:
        """Where the round being exchanged sits in this island's schedule (for the header).

        Read on the exchange's thread: the round in flight's fragment and send step were set
        before its exchange started and do not change until its apply.
        """
        s = self.outer_syncs[0].state
        rnd = s.in_flight
        if rnd is None:  # not inside a round of the schedule (a test calling average itself)
            return RoundPlace(0, s.inner_steps, s.inner_steps)
        delay = 0 if self._joining else s.schedule.sync_delay
        return RoundPlace(rnd.fragment, rnd.send_step, rnd.send_step + delay)

    def state(self) -> dict[str, Any]:
        """The global state a joiner needs, one ``OuterRecord`` dict per optimizer (tensors
        are not copied); sharded, this rank's share of it, with the share and its names.

        Called by torchft on the quorum's thread while this island's round is being exchanged
        (``OuterSync.record(for_peer=True)`` says what that reads).
        """
        return {"outer": [outer.record(for_peer=True).to_dict() for outer in self.outer_syncs]}

    def install(self, state: Mapping[str, Any]) -> None:
        """Keep a live island's global state for ``settle`` (see the module docstring).

        Raises:
            ValueError: the swarm trains another number of optimizers.
        """
        states = state["outer"]
        if len(states) != len(self.outer_syncs):
            raise ValueError(
                f"the swarm trains {len(states)} optimizer(s), this island "
                f"{len(self.outer_syncs)}; start it with the swarm's model and optimizers"
            )
        self._kept = [OuterRecord.from_dict(s) for s in states]

    @torch.no_grad()
    def settle(self) -> SyncReport | None:
        """On the training thread, after the island's own round was resolved: install a kept
        heal and apply the swarm's round this island adopted (if any); returns the adopted
        round's report when one was applied."""
        adopted = self.take_adopted() if self.take_adopted is not None else None
        if self._kept is not None:
            self._install_kept()
        if self._island_healed:
            self._island_healed = False
            self.after_island_heal()
        if adopted is None:
            return None
        outer = self.outer_syncs[0]
        s = outer.state
        assert s.in_flight is None, "the island's own round was resolved before"
        s.inner_steps = adopted.place.apply_step  # the swarm's clock
        if not adopted.applied:
            return None
        s.in_flight = RoundInFlight(
            adopted.place.fragment,
            adopted.place.send_step,
            adopted.deltas,
            result=Exchanged(RoundStats(applied=True), global_norm(list(adopted.deltas.values()))),
        )
        return outer.engine.apply(adopted.place.fragment)

    def _install_kept(self) -> None:
        """Adopt the kept state, keeping this island's own progress since its anchors:
        ``local <- anchor_new + (local - anchor_old)``.

        A heal in the middle of a run (the island missed a commit) whose round is then abandoned
        would otherwise leave stale weights under the new anchors, and the island's next
        pseudo-gradient would carry the swarm's whole advance since.
        """
        assert self._kept is not None
        records, self._kept = self._kept, None
        for outer, saved in zip(self.outer_syncs, records, strict=True):
            check_share(outer, saved)
            own = _progress(outer)
            # The clock is set by the adopted round; none is in flight at a settle.
            counters = replace(saved.counters, inner_steps=0)
            outer.load_state_dict(replace(saved, counters=counters, pending=None))
            outer.state.inner_steps = saved.counters.inner_steps
            for name in outer.owned:
                outer.params[name].copy_(outer.anchors[name].float() + own[name])
        self.healed = True

    def note_island_heal(self) -> None:
        """Some rank of this island was healed in the round just exchanged (called on every
        rank of the island alike, on the exchange's thread): ``settle`` gathers the healed
        shares after installing them."""
        self._island_healed = True
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
        """Each optimizer's first elastic round, now (see the module docstring).

        A round in flight restored from a checkpoint (saved with ``sync_delay > 0``) is applied
        first, as the swarm applied it when the checkpoint was written.
        """
        for outer in self.outer_syncs:
            outer.engine.apply_in_flight()
        progress = [_progress(outer) for outer in self.outer_syncs]
        self.healed = False
        self._joining = True
        try:
            reports = [outer.round_now() for outer in self.outer_syncs]
        finally:
            self._joining = False
        adopted = self.settle()
        if adopted is not None:
            reports = [adopted]
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


def fragment_shapes(outer: OuterSync) -> list[dict[str, tuple[int, ...]]]:
    """The shapes of each fragment's names this rank owns, in fragment order (what a healed
    island averages; sharded, a rank exchanges its own names only)."""
    owned = outer.state.owned_fragments
    return [{name: tuple(outer.params[name].shape) for name in names} for names in owned]


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


def check_share(outer: OuterSync, saved: OuterRecord) -> None:
    """Refuse a healing state that is not this rank's share (another position, island size or
    set of names): the shares of every island of a swarm must be the same.

    Raises:
        ValueError: naming both shares.
    """
    shard = outer.shard
    mine = None if shard is None else (shard.position, shard.size)
    theirs = saved.share
    names = saved.names
    if theirs != mine or (shard is not None and list(names) != outer.owned):
        raise ValueError(
            f"a healing peer sent the share {_share_text(theirs)} with {len(names)} "
            f"tensor(s), but this rank holds the share {_share_text(mine)} with "
            f"{len(outer.owned)}: islands of a swarm must split the outer state alike (the same "
            "number of ranks per island and shard_outer on every island)."
        )


def _share_text(share: tuple[int, int] | None) -> str:
    return "'whole outer state'" if share is None else f"'position {share[0]} of {share[1]}'"
