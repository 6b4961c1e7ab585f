"""An ``OuterSync``'s state as a record: what a save holds, what a healing peer receives, and
what installing a record puts in place.

``SyncCheckpoint`` only reads the ``SyncState``: the round engine (``outer/round.py``) is its one
writer and assigns what ``installable`` builds. ``record`` is the global state (an
``OuterRecord``: anchors, outer state, counters and, for a save, the round in flight the engine
exported; for a healing peer, its share and no round). It aliases the live anchors: write it
out before the next round. ``check_state_dict`` is the one check of a saved state (anchor
shapes; a round in flight must be the one the schedule expects), run on every rank before
anything is installed; an install adopts anchors already on the right device and dtype (mapped
ones stay file-backed) and keeps only owned names when sharded. ``island_residuals`` and
``residuals_of`` are the island's own state (error-feedback residuals).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.diloco import keep_state_float32
from lightning_swarm.algorithm.outer_optimizer import select_by_name
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.outer.sync_state import Exchanged, RoundInFlight, SyncState
from lightning_swarm.resume.outer_record import OuterCounters, OuterRecord, PendingRound
from lightning_swarm.transport.base import RoundStats


@dataclass
class Installable:
    """What installing a checked record puts in place (the engine assigns it)."""

    anchors: dict[str, Tensor]
    outer_optimizer: torch.optim.Optimizer
    counters: OuterCounters  # fragment_rounds and synced_at filled in
    in_flight: RoundInFlight | None


class SyncCheckpoint:
    """Reads one ``OuterSync``'s state for saves and heals; builds what an install puts in place.

    Args:
        state: the sync's shared state (``SyncState``), written by its round engine only.
    """

    def __init__(self, state: SyncState) -> None:
        self.state = state

    def record(self, *, pending: PendingRound | None = None, for_peer: bool = False) -> OuterRecord:
        """The global state: the one place it is read (tensors are not copied).

        For a checkpoint (default), ``pending`` is the round in flight the engine exported
        (its averaged result, identical on every island), so a resumed run applies it at the
        same step as an uninterrupted one. For a healing peer (``for_peer``): no round in
        flight, the counters of the round's send, and the share when sharded. Anchors and outer
        state do not move until that round's apply.
        """
        s = self.state
        rnd = s.in_flight
        inner = rnd.send_step if for_peer and rnd is not None else s.inner_steps
        sharded = s.shard is not None
        return OuterRecord(
            anchors=dict(s.anchors),
            outer_optimizer=s.outer_optimizer.state_dict(),
            counters=OuterCounters(
                inner_steps=inner,
                outer_steps=s.outer_steps,
                fragment_rounds=list(s.fragment_rounds),
                synced_at=list(s.synced_at),
                ended_at=s.ended_at,
            ),
            pending=None if for_peer else pending,
            # The outer optimizer's state is positional: a re-shard needs the names.
            param_names=list(s.owned) if sharded else None,
            share=(s.shard.position, s.shard.size) if for_peer and s.shard is not None else None,
        )

    def peer_offer(self) -> dict[str, Any]:
        """What a healing peer receives: ``record(for_peer=True)`` as a dict (tensors are not
        copied; they do not move until the round in flight's apply, which waits for it).
        Built by the engine on its own thread when it opens the round."""
        return self.record(for_peer=True).to_dict()

    def check_share(self, saved: OuterRecord) -> None:
        """Refuse a healing state that is not this rank's share (another position, island
        size or set of names): the shares of every island of a swarm must be the same.

        Raises:
            ValueError: naming both shares.
        """
        shard = self.state.shard
        mine = None if shard is None else (shard.position, shard.size)
        theirs, names = saved.share, saved.names
        if theirs != mine or (shard is not None and list(names) != self.state.owned):
            raise ValueError(
                f"a healing peer sent the share {_share_text(theirs)} with {len(names)} "
                f"tensor(s), but this rank holds the share {_share_text(mine)} with "
                f"{len(self.state.owned)}: islands of a swarm must split the outer state alike "
                "(the same number of ranks per island and shard_outer on every island)."
            )

    def island_residuals(self) -> dict[str, Tensor]:
        """This island's own state: the error-feedback residuals (the engine drained any round
        in flight first).

        Sharded with error feedback, each rank holds the residuals of its share: this is then
        collective over the island, and the island's first rank (which writes the island's
        file) gets every share's residuals.
        """
        residuals = dict(self.state.residuals)
        if self.state.shard is not None and self.state.streaming.error_feedback:
            residuals = self.state.shard.collect(residuals)
        return residuals

    def residuals_of(self, state: Mapping[str, Any]) -> dict[str, Tensor]:
        """The owned residuals of an ``island_state_dict`` (converted to the anchor device).

        Raises:
            ValueError: a residual does not fit this model.
        """
        residuals: Mapping[str, Tensor] = state.get("residuals", {})
        for name, residual in residuals.items():
            if name not in self.state.params or residual.shape != self.state.params[name].shape:
                raise SwarmCheckpointError(
                    f"saved error-feedback residual {name!r} does not fit this model; resume "
                    "with the model and fragments the checkpoint was written by."
                )
        owned = set(self.state.owned)
        return {
            name: r.to(device=self.state.anchor_device, dtype=torch.float32)
            for name, r in residuals.items()
            if name in owned
        }

    def check_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Refuse a saved state that cannot be installed as saved.

        Raises:
            SwarmCheckpointError: a parameter has no anchor, or an anchor of another shape; or
                the saved round in flight is not the one this run's schedule expects.
        """
        record = OuterRecord.of(state)
        # A healing peer's share (``peer_offer``) holds the anchors of this rank's names only.
        whole = record.share is None
        self.check_anchors(record.anchors, names=self.state.params if whole else None)
        self._check_round(record)

    def check_anchors(
        self, anchors: Mapping[str, Tensor], names: Iterable[str] | None = None
    ) -> None:
        """Refuse saved anchors unless each of ``names`` (default: the owned ones) has one of
        its parameter's shape."""
        for name in self.state.owned if names is None else names:
            p = self.state.params[name]
            anchor = anchors.get(name)
            if anchor is None or tuple(anchor.shape) != tuple(p.shape):
                found = "no anchor" if anchor is None else f"shape {tuple(anchor.shape)}"
                raise SwarmCheckpointError(
                    f"parameter {name!r} (shape {tuple(p.shape)}) has {found}; the saved "
                    "anchors are damaged or from another model. Resume with the model the "
                    "checkpoint was written by, or from another checkpoint."
                )

    def _check_round(self, record: OuterRecord) -> None:
        step, ended = record.counters.inner_steps, record.counters.ended_at
        expected = None
        if step:
            # Rounds sent by the end-of-fit round's step were applied by it.
            expected = self.state.schedule.in_flight(step, sent_after=int(ended or 0))
        found = None if record.pending is None else record.pending.fragment
        if found != expected:
            raise SwarmCheckpointError(
                f"the checkpoint has fragment {found} in flight at inner step {step} "
                f"but this run's schedule expects {expected}; resume with the sync_every, "
                "num_fragments and sync_delay the checkpoint was written with."
            )

    def installable(self, state: Mapping[str, Any] | OuterRecord) -> Installable:
        """What installing ``state`` (checked by ``check_state_dict``) puts in place.

        The given anchor tensors are adopted, not copied, when they already have the anchor
        device and dtype: memory-mapped anchors stay file-backed until a round writes them.
        Otherwise they are converted (e.g. a float32 file resumed with bfloat16 anchors). A new
        outer optimizer over the new anchors holds the saved state.
        """
        record = OuterRecord.of(state)
        s = self.state
        anchors = {
            name: record.anchors[name].to(device=s.anchor_device, dtype=s.anchor_dtype)
            for name in s.owned
        }
        optimizer = s.outer_optimizer_factory(list(anchors.values()))
        optimizer_state = select_by_name(record.outer_optimizer, record.names, s.owned)
        optimizer.load_state_dict(optimizer_state)
        keep_state_float32(optimizer, optimizer_state)
        c = record.counters
        # Saves older than the end-of-fit round lack these: in sync unknown, fit never ended.
        counters = replace(
            c,
            fragment_rounds=[0] * len(s.fragments)
            if c.fragment_rounds is None
            else list(c.fragment_rounds),
            synced_at=[None] * len(s.fragments) if c.synced_at is None else list(c.synced_at),
        )
        return Installable(anchors, optimizer, counters, self._restore_round(record.pending))

    def _restore_round(self, pending: PendingRound | None) -> RoundInFlight | None:
        if pending is None:
            return None
        stats = RoundStats(
            bytes_sent=pending.bytes_sent,
            bytes_received=pending.bytes_received,
            wall_s=pending.transport_s,
            applied=pending.applied,
        )
        owned = set(self.state.owned)
        deltas = {name: t.to(torch.float32) for name, t in pending.deltas.items() if name in owned}
        return RoundInFlight(
            pending.fragment,
            pending.send_step,
            deltas,
            result=Exchanged(stats, pending.norm, combined=not pending.share_norm),
        )


def _share_text(share: tuple[int, int] | None) -> str:
    return "'whole outer state'" if share is None else f"'position {share[0]} of {share[1]}'"


def pending_of(rnd: RoundInFlight, result: Exchanged, sharded: bool) -> PendingRound:
    """A round in flight whose exchange finished, as a save holds it (its deltas by name)."""
    return PendingRound(
        fragment=rnd.fragment,
        send_step=rnd.send_step,
        deltas=dict(rnd.deltas),
        # An adopted round replaced the own one, which is not applied (the adopted round
        # itself is not saved: a resumed island takes the swarm's next round).
        applied=result.stats.applied and result.adopted is None,
        norm=result.norm,
        bytes_sent=result.stats.bytes_sent,
        bytes_received=result.stats.bytes_received,
        transport_s=result.stats.wall_s,
        # Merged shards combine it.
        share_norm=not result.combined if sharded else None,
    )
