"""The bucketed round engine of one ``OuterSync``: each due round in one pass over its buckets.

``BucketedEngine`` runs a fragment's round through ``BucketedRound`` with no full-size
temporary. ``bucketed_kind`` allows it for a bucket-mean transport, no delay, installed contiguous
anchors and an outer optimizer with a functional step; those conditions change only when a
resume installs anchors, so the choice is never re-made per round. It touches only the sync's
``SyncState``; its reused buffers live as long as the engine.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.outer_fast import FastKind, fast_outer_kind
from lightning_swarm.outer.bucketed import BucketedResult, BucketedRound, BucketMean
from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.staging import pin_round_memory
from lightning_swarm.outer.sync_state import SyncState


def bucketed_kind(state: SyncState, *, allowed: bool) -> FastKind | None:
    """The functional outer step a bucketed round would use, or None for the two-phase round.

    ``allowed`` is the caller's ``stream`` switch (``False`` forces two-phase rounds).
    """
    if not allowed or state.placeholders or state.schedule.sync_delay != 0:
        return None
    if not isinstance(state.transport, BucketMean):
        return None
    if any(not a.is_contiguous() for a in state.anchors.values()):
        return None
    if any(not p.is_contiguous() for p in state.params.values()):
        return None
    return fast_outer_kind(state.outer_optimizer)


class BucketedEngine:
    """Whole rounds in one bucketed pass (see the module docstring).

    Args:
        state: the sync's shared state (``SyncState``), owned by the ``OuterSync``.
        kind: the functional outer step (``bucketed_kind``).
        rounds: the bucket engine whose buffers this engine reuses round after round.
    """

    def __init__(self, state: SyncState, kind: FastKind, rounds: BucketedRound) -> None:
        assert isinstance(state.transport, BucketMean)
        self.state = state
        self.kind = kind
        self.rounds = rounds

    def step(self, step: int) -> SyncReport | None:
        """After inner step ``step``: the whole round of the fragment the schedule names."""
        sending = self.state.schedule.sends_at(step)
        return None if sending is None else self.round(sending)

    def apply_in_flight(self) -> SyncReport | None:
        """Nothing is ever in flight: a bucketed round ends where it starts."""
        return None

    def drain(self) -> None:
        """Nothing runs in the background."""

    @torch.no_grad()
    def round(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """Fragment ``fragment``'s whole round in one bucketed pass over its tensors.

        ``merge_alpha`` overrides the schedule's (the end of fit merges with 0).
        """
        s = self.state
        assert s.in_flight is None
        alpha = s.schedule.merge_alpha if merge_alpha is None else merge_alpha
        start = time.perf_counter()
        result = BucketedResult(0.0, 0)  # a share with no tensors in this fragment
        error: BaseException | None = None
        try:
            result = self._run(s.owned_fragments[fragment], alpha)
        except Exception as err:
            if s.shard is None:
                raise
            error = err  # the island agrees on it first, then every rank raises
        norm = result.norm
        if s.shard is not None:
            _, norm = s.shard.agree(True, result.norm, error)
            s.shard.gather(s.fragments[fragment], s.params)
        s.count_applied(fragment, alpha)
        return SyncReport(
            outer_steps=s.outer_steps,
            pseudo_grad_norm=norm,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_sent,
            wall_s=time.perf_counter() - start,
            applied=True,
            fragment=fragment,
            fragment_rounds=s.fragment_rounds[fragment],
            transport_s=result.reduce_s,
        )

    def _run(self, names: list[str], alpha: float) -> BucketedResult:
        """The pass over ``names`` (this rank's share of the fragment)."""
        s = self.state
        if not names:
            return BucketedResult(0.0, 0)
        if s.params[names[0]].device.type == "cuda" and s.anchor_device.type == "cpu":
            pin_round_memory(s.outer_optimizer, s.anchors)
        assert isinstance(s.transport, BucketMean)
        with record_function(labels.BUCKETED_ROUND):
            return self.rounds.run(
                params=[s.params[name] for name in names],
                anchors=[s.anchors[name] for name in names],
                optimizer=s.outer_optimizer,
                kind=self.kind,
                reducer=s.transport,
                merge_alpha=alpha,
                seed=s.outer_steps,  # the same on every island: bf16 noise agrees
            )
