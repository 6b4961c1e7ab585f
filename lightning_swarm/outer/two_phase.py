"""The two-phase outer round: send a fragment's pseudo-gradients, apply their average later.

``send`` forms ``anchor - local``, applies error feedback and starts the exchange (on the
``SyncWorker`` when ``sync_delay > 0``); ``apply`` waits, steps, merges and, sharded, gathers.
A ``RoundInFlight`` lives from send to apply, at most one per ``OuterSync``; until the worker's
future resolves its deltas and residuals belong to the worker thread. A failed or skipped
exchange restores the residuals: the round happened nowhere.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm import global_norm, merge_into_local, outer_step, pseudo_gradient
from lightning_swarm.algorithm.codecs import with_error_feedback
from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.sync_state import Exchanged, RoundInFlight, SyncState
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.transport.base import RoundStats


class TwoPhaseRound:
    """The two-phase round engine of one ``OuterSync``: it reads and writes ``state`` only.

    Args:
        state: the sync's shared state (``SyncState``), owned by the ``OuterSync``.
    """

    def __init__(self, state: SyncState) -> None:
        self.state = state

    def step(self, step: int) -> SyncReport | None:
        """After inner step ``step``: send the fragment the schedule names, apply the one due."""
        s = self.state
        sending = s.schedule.sends_at(step)
        if sending is not None:
            self.send(sending, inline=s.schedule.sync_delay == 0)
        applying = s.schedule.applies_at(step)
        if applying is None or _applied_by_finish(s, step - s.schedule.sync_delay):
            return None
        return self.apply(applying)

    def round(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """One whole round of ``fragment`` now (inline send, then apply)."""
        self.send(fragment, inline=True)
        return self.apply(fragment, merge_alpha=merge_alpha)

    def apply_in_flight(self) -> SyncReport | None:
        """Apply the round in flight now, if any (the end of fit)."""
        rnd = self.state.in_flight
        return None if rnd is None else self.apply(rnd.fragment)

    @torch.no_grad()
    def send(self, fragment: int, *, inline: bool) -> None:
        """Compute fragment ``fragment``'s pseudo-gradients and start their exchange."""
        assert self.state.in_flight is None, "the schedule allows one round in flight at a time"
        if self.state.placeholders:
            raise RuntimeError(
                "an outer round started while the anchors are still placeholders awaiting a "
                "resume (defer_anchors=True and load_state_dict was never called); install the "
                "saved anchors with load_state_dict before the first inner step."
            )
        start = time.perf_counter()
        names = self.state.owned_fragments[fragment]
        anchors, params = self.state.anchors, self.state.params
        with record_function(labels.PSEUDO_GRADIENT):
            deltas = {name: pseudo_gradient(anchors[name], params[name]) for name in names}
        rnd = RoundInFlight(fragment, self.state.inner_steps, deltas)
        round_index = self.state.outer_steps
        # In flight from here on: the transport may ask which round it is exchanging (an
        # elastic membership puts the round's place in its header; ``outer/join.py``).
        self.state.in_flight = rnd
        if inline:
            try:
                rnd.result = self._exchange(deltas, round_index)
            except Exception as err:
                if self.state.shard is None:
                    self.state.in_flight = None
                    raise
                rnd.error = err  # the island agrees on it at the apply, then raises
        else:
            worker = self.state.streaming.worker
            assert worker is not None
            rnd.future = worker.submit(lambda: self._exchange(deltas, round_index))
        rnd.send_blocked_s = time.perf_counter() - start

    @torch.no_grad()
    def _exchange(self, deltas: dict[str, Tensor], round_index: int) -> Exchanged:
        """Error feedback, then the transport's average (runs in the worker when delayed).

        Overwrites ``deltas`` with the average. The residuals of a skipped round are restored:
        its whole pseudo-gradient re-enters the next round anyway (anchors and locals stay).
        """
        # This rank's share of the fragment is empty: nothing to exchange, unless the
        # transport's round needs every rank of the island (elastic islands, one Manager a rank).
        if not deltas and not getattr(self.state.transport, "every_rank_in_round", False):
            return Exchanged(RoundStats(applied=True), 0.0)
        previous = self._feed_back_errors(deltas)
        try:
            with record_function(labels.EXCHANGE):
                stats = self.state.transport.average(deltas, round_index=round_index)
        except BaseException:
            # The round did not happen anywhere (anchors unchanged): neither did its feedback.
            self._restore_residuals(previous)
            raise
        if not stats.applied:
            self._restore_residuals(previous)
            return Exchanged(stats, 0.0)
        return Exchanged(stats, global_norm(list(deltas.values())))

    def _feed_back_errors(self, deltas: dict[str, Tensor]) -> dict[str, Tensor | None]:
        """Add each residual to its delta (in place) and keep the new quantization error.

        Returns the residuals it replaced (empty without error feedback), to restore them if
        the round does not happen.
        """
        codec = self.state.streaming.codec
        if not self.state.streaming.error_feedback or codec is None:
            return {}
        previous = {name: self.state.residuals.get(name) for name in deltas}
        for name, delta in deltas.items():
            to_send, new_residual = with_error_feedback(delta, previous[name], codec)
            delta.copy_(to_send)
            self.state.residuals[name] = new_residual
        return previous

    def _restore_residuals(self, previous: Mapping[str, Tensor | None]) -> None:
        for name, old in previous.items():
            if old is None:
                self.state.residuals.pop(name, None)
            else:
                self.state.residuals[name] = old

    @torch.no_grad()
    def apply(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """Wait for fragment ``fragment``'s average, step its anchors, merge into the locals.

        ``merge_alpha`` overrides the schedule's (``finish`` merges with 0).
        """
        rnd = self.state.in_flight
        assert rnd is not None and rnd.fragment == fragment, "apply without a matching send"
        start = time.perf_counter()
        result, applied, norm = self._island_result(rnd)
        self.state.in_flight = None
        alpha = self.state.schedule.merge_alpha if merge_alpha is None else merge_alpha
        if applied:
            self._step_and_merge(fragment, rnd.deltas, alpha)
        # A skipped round keeps both anchors and locals: the island's progress is not thrown
        # away, it simply enters the next round's pseudo-gradient.
        del rnd.deltas
        return SyncReport(
            outer_steps=self.state.outer_steps,
            pseudo_grad_norm=norm,
            bytes_sent=result.stats.bytes_sent,
            bytes_received=result.stats.bytes_received,
            wall_s=rnd.send_blocked_s + time.perf_counter() - start,
            applied=applied,
            fragment=fragment,
            fragment_rounds=self.state.fragment_rounds[fragment],
            transport_s=result.stats.wall_s,
            non_finite_islands=result.stats.non_finite_islands,
            rejected_own=result.stats.rejected_own,
        )

    def _step_and_merge(self, fragment: int, deltas: Mapping[str, Tensor], alpha: float) -> None:
        """An applied round: the outer step on the fragment's anchors, the merge, the gather."""
        names: Sequence[str] = self.state.owned_fragments[fragment]
        if names:
            with record_function(labels.OUTER_STEP):
                # The outer-step count is the same on every island: bf16 noise agrees.
                outer_step(
                    self.state.outer_optimizer,
                    [self.state.anchors[name] for name in names],
                    [deltas[name] for name in names],
                    seed=self.state.outer_steps,
                )
        with record_function(labels.MERGE):
            for name in names:
                merge_into_local(self.state.params[name].data, self.state.anchors[name], alpha)
        if self.state.shard is not None:
            self.state.shard.gather(self.state.fragments[fragment], self.state.params)
        self.state.count_applied(fragment, alpha)

    def _island_result(self, rnd: RoundInFlight) -> tuple[Exchanged, bool, float]:
        """The exchange's result, whether the round applies, and its norm, island-wide.

        Unsharded that is the transport's own verdict. Sharded, every share must agree
        (``IslandShard.agree``) before any rank steps: a failed share raises on every rank.
        """
        if self.state.shard is None:
            result = self.result(rnd)
            return result, result.stats.applied, result.norm
        error: Exception | None = rnd.error
        result = Exchanged(RoundStats(applied=False), 0.0)
        if error is None:
            try:
                result = self.result(rnd)
            except Exception as err:
                error = err
        own_norm = 0.0 if result.combined else result.norm
        applied, norm = self.state.shard.agree(result.stats.applied, own_norm, error)
        return result, applied, result.norm if result.combined else norm

    @staticmethod
    def result(rnd: RoundInFlight) -> Exchanged:
        """The round's exchange result, waiting for the worker when it is still running."""
        if rnd.result is None:
            assert rnd.future is not None
            with record_function(labels.WAIT):
                rnd.result = SyncWorker.wait(
                    rnd.future,
                    f"the outer sync of fragment {rnd.fragment} (sent after inner step "
                    f"{rnd.send_step})",
                )
            rnd.future = None
        return rnd.result

    def drain(self) -> None:
        """Wait for a round in flight without applying it (before a save or at teardown)."""
        if self.state.in_flight is not None:
            self.result(self.state.in_flight)


def _applied_by_finish(state: SyncState, send_step: int) -> bool:
    """Whether the end-of-fit round already applied a round sent after ``send_step``."""
    return state.ended_at is not None and send_step <= state.ended_at
