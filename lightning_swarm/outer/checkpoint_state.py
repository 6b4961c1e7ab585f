"""An ``OuterSync``'s checkpoint state: what a save holds and how a resume installs it.

``record`` builds the global state (an ``OuterRecord``: anchors, outer state, counters and a round
in flight, for a save; for a healing peer, its share and no round), and ``load_checked_state_dict``
installs one, for a resume and a heal alike. It aliases the live anchors: write it out before the
next round. ``island_state_dict`` holds the residuals (collective over the island when sharded).
``check_state_dict`` is the one check of a saved state (anchor shapes; a round in flight must be
the one the schedule expects), run on every rank before anything is installed; installing adopts
anchors already on the right device and dtype (mapped ones stay file-backed) and keeps only owned
names when sharded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.optimizer_state import select_by_name
from lightning_swarm.algorithm.precision import keep_state_float32
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.outer.sync_state import Exchanged, RoundInFlight, SyncState, wait_exchange
from lightning_swarm.resume.outer_record import OuterCounters, OuterRecord, PendingRound
from lightning_swarm.transport.base import RoundStats


class SyncCheckpoint:
    """What a save holds of one ``OuterSync`` and how a resume installs it.

    Args:
        state: the sync's shared state (``SyncState``), owned by the ``OuterSync``; this member
            reads it to save and replaces its anchors, outer optimizer and counters on resume.
    """

    def __init__(self, state: SyncState) -> None:
        self.state = state

    def _wait(self) -> Exchanged | None:
        """The round in flight's exchange result, after waiting for the worker (or None)."""
        rnd = self.state.in_flight
        return None if rnd is None else wait_exchange(rnd)

    def state_dict(self) -> dict[str, Any]:
        """Anchors, outer optimizer state, counters and a round in flight: ``record()`` as a
        dict (global state; tensors stay on the anchor device)."""
        return self.record().to_dict()

    def record(self, *, for_peer: bool = False) -> OuterRecord:
        """The global state: the one place it is read (tensors are not copied).

        For a checkpoint (default), a round in flight is waited for; its averaged result
        (identical on every island) is saved so a resumed run applies it at the same step as
        an uninterrupted one. For a healing peer (``for_peer``), called on the quorum's thread
        while this island's round is exchanged: no round in flight, the counters of the round's
        send (the training thread may be past it), and the share when sharded. Anchors and
        outer state do not move until that round's apply, which waits for it.
        """
        s = self.state
        rnd = s.in_flight
        pending = None if for_peer else self._pending()  # waits for the exchange first
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
            pending=pending,
            # The outer optimizer's state is positional: a re-shard needs the names.
            param_names=list(s.owned) if sharded else None,
            share=(s.shard.position, s.shard.size) if for_peer and s.shard is not None else None,
        )

    def _pending(self) -> PendingRound | None:
        """The round in flight, after waiting for its exchange (None when none is)."""
        result = self._wait()
        rnd = self.state.in_flight
        if rnd is None or result is None:
            return None
        rnd.exported = True  # its deltas now live in a state dict: never reused
        return PendingRound(
            fragment=rnd.fragment,
            send_step=rnd.send_step,
            deltas=dict(rnd.deltas),
            applied=result.stats.applied,
            norm=result.norm,
            bytes_sent=result.stats.bytes_sent,
            bytes_received=result.stats.bytes_received,
            transport_s=result.stats.wall_s,
            # Merged shards combine it.
            share_norm=not result.combined if self.state.shard is not None else None,
        )

    def island_state_dict(self) -> dict[str, Any]:
        """This island's own state: the error-feedback residuals (after any round in flight).

        Sharded with error feedback, each rank holds the residuals of its share: this is then
        collective over the island, and the island's first rank (which writes the island's
        file) gets every share's residuals.
        """
        self._wait()
        residuals = dict(self.state.residuals)
        if self.state.shard is not None and self.state.streaming.error_feedback:
            residuals = self.state.shard.collect(residuals)
        return {"residuals": residuals}

    def load_island_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install residuals saved by ``island_state_dict`` (converted to the anchor device)."""
        residuals: Mapping[str, Tensor] = state.get("residuals", {})
        for name, residual in residuals.items():
            if name not in self.state.params or residual.shape != self.state.params[name].shape:
                raise SwarmCheckpointError(
                    f"saved error-feedback residual {name!r} does not fit this model; resume "
                    "with the model and fragments the checkpoint was written by."
                )
        owned = set(self.state.owned)
        self.state.residuals = {
            name: r.to(device=self.state.anchor_device, dtype=torch.float32)
            for name, r in residuals.items()
            if name in owned
        }

    def check_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Refuse a saved state that ``load_checked_state_dict`` cannot install as saved.

        Raises:
            SwarmCheckpointError: a parameter has no anchor, or an anchor of another shape; or
                the saved round in flight is not the one this run's schedule expects.
        """
        record = OuterRecord.of(state)
        # A healing peer's share (outer/join.py) holds the anchors of this rank's names only.
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

    def load_checked_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Install anchors, outer optimizer state, counters and a round in flight: the one
        place the global state is installed.

        ``state`` must have passed ``check_state_dict`` (nothing is checked again). The given
        anchor tensors are adopted, not copied, when they already have this object's anchor
        device and dtype: memory-mapped anchors stay file-backed until a sync writes them.
        Otherwise they are converted (e.g. a float32 file resumed with bfloat16 anchors). The
        outer optimizer is rebuilt over the new anchors, then given the saved state.
        """
        record = OuterRecord.of(state)
        self._install_anchors(record.anchors)
        s = self.state
        s.outer_optimizer = s.outer_optimizer_factory(list(s.anchors.values()))
        optimizer_state = select_by_name(record.outer_optimizer, record.names, s.owned)
        s.outer_optimizer.load_state_dict(optimizer_state)
        keep_state_float32(s.outer_optimizer, optimizer_state)
        c = record.counters
        s.inner_steps = c.inner_steps
        s.outer_steps = c.outer_steps
        rounds = c.fragment_rounds
        s.fragment_rounds = list(rounds) if rounds is not None else [0] * len(s.fragments)
        # Saves older than the end-of-fit round lack these: in sync unknown, fit never ended.
        synced = c.synced_at
        s.synced_at = list(synced) if synced is not None else [None] * len(s.fragments)
        s.ended_at = c.ended_at
        s.in_flight = self._restore_round(record.pending)

    def _install_anchors(self, anchors: Mapping[str, Tensor]) -> None:
        """Adopt (or convert) the owned names' checked anchors."""
        self.state.anchors = {
            name: anchors[name].to(device=self.state.anchor_device, dtype=self.state.anchor_dtype)
            for name in self.state.owned
        }
        self.state.placeholders = False

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
