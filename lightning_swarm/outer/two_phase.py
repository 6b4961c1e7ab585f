"""The two-phase outer round: send a fragment's pseudo-gradients, apply their average later.

``_send`` (after the inner step where the schedule names fragment ``f``) forms the
pseudo-gradients ``anchor - local`` of the names this rank owns, applies error feedback and
starts ``transport.average``: inline when ``sync_delay == 0``, else as a job on the
``SyncWorker`` while training continues. ``_apply`` (``sync_delay`` steps later) waits for the
average, steps the outer optimizer on that fragment's anchors, merges them into the locals and,
sharded, gathers the new parameters to the whole island. ``OuterSync`` runs this round whenever
the streamed round (``lightning_swarm.outer.bucketed``) cannot: a sync delay, a codec, a
transport without a bucket mean, an outer optimizer without a functional step, or ``stream=False``.

Ownership and lifetime:
- A ``RoundInFlight`` lives from its send to its apply; at most one exists per ``OuterSync``
  (the schedule applies fragment f before fragment f + 1 sends). Its ``deltas`` are full-size
  float32 pseudo-gradients that the exchange overwrites in place with the average; they are
  dropped at the apply.
- Until the worker's future resolves, the round's ``deltas`` and the fragment's error-feedback
  ``residuals`` belong to the worker thread; the training thread touches them only after
  ``_result`` returned.
- A failed or skipped exchange restores the residuals it replaced: the round happened nowhere,
  so its feedback did not either.
- ``Exchanged`` holds no tensors: only the transport's stats and the averaged norm.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm import global_norm, merge_into_local, outer_step, pseudo_gradient
from lightning_swarm.algorithm.codecs import with_error_feedback
from lightning_swarm.algorithm.fragments import FragmentSchedule
from lightning_swarm.outer.reports import StreamingOptions, SyncReport
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.transport.base import RoundStats, Transport


@dataclass
class Exchanged:
    """What an exchange reported: the transport's round stats and the averaged
    pseudo-gradient's norm (both identical on all ranks). The averaged tensors themselves are
    written into the round's ``deltas`` in place."""

    stats: RoundStats
    norm: float
    # True when ``norm`` is already the whole island's (a round restored from a checkpoint).
    combined: bool = False


@dataclass
class RoundInFlight:
    """A fragment's round between its send and its apply."""

    fragment: int
    send_step: int
    deltas: dict[str, Tensor]
    send_blocked_s: float = 0.0
    future: Future[Exchanged] | None = None
    result: Exchanged | None = None
    error: Exception | None = None  # a sharded inline exchange that failed (raised at apply)


class TwoPhaseRound:
    """The two-phase round's methods; ``OuterSync`` owns (and documents) the fields below."""

    params: dict[str, torch.nn.Parameter]
    shard: IslandShard | None
    transport: Transport
    anchors: dict[str, Tensor]
    outer_optimizer: torch.optim.Optimizer
    streaming: StreamingOptions
    fragments: list[list[str]]
    schedule: FragmentSchedule
    inner_steps: int
    outer_steps: int
    fragment_rounds: list[int]
    synced_at: list[int | None]
    residuals: dict[str, Tensor]
    _owned_fragments: list[list[str]]
    _placeholders: bool
    _in_flight: RoundInFlight | None

    @torch.no_grad()
    def _send(self, fragment: int, *, inline: bool) -> None:
        """Compute fragment ``fragment``'s pseudo-gradients and start their exchange."""
        assert self._in_flight is None, "the schedule allows one round in flight at a time"
        if self._placeholders:
            raise RuntimeError(
                "an outer round started while the anchors are still placeholders awaiting a "
                "resume (defer_anchors=True and load_state_dict was never called); install the "
                "saved anchors with load_state_dict before the first inner step."
            )
        start = time.perf_counter()
        names = self._owned_fragments[fragment]
        with record_function(labels.PSEUDO_GRADIENT):
            deltas = {
                name: pseudo_gradient(self.anchors[name], self.params[name]) for name in names
            }
        rnd = RoundInFlight(fragment, self.inner_steps, deltas)
        round_index = self.outer_steps
        if inline:
            try:
                rnd.result = self._exchange(deltas, round_index)
            except Exception as err:
                if self.shard is None:
                    raise
                rnd.error = err  # the island agrees on it at the apply, then raises
        else:
            assert self.streaming.worker is not None
            rnd.future = self.streaming.worker.submit(lambda: self._exchange(deltas, round_index))
        rnd.send_blocked_s = time.perf_counter() - start
        self._in_flight = rnd

    @torch.no_grad()
    def _exchange(self, deltas: dict[str, Tensor], round_index: int) -> Exchanged:
        """Error feedback, then the transport's average (runs in the worker when delayed).

        Overwrites ``deltas`` with the average. The residuals of a skipped round are restored:
        its whole pseudo-gradient re-enters the next round anyway (anchors and locals stay).
        """
        if not deltas:  # this rank's share of the fragment is empty: nothing to exchange
            return Exchanged(RoundStats(applied=True), 0.0)
        previous = self._feed_back_errors(deltas)
        try:
            with record_function(labels.EXCHANGE):
                stats = self.transport.average(deltas, round_index=round_index)
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
        codec = self.streaming.codec
        if not self.streaming.error_feedback or codec is None:
            return {}
        previous = {name: self.residuals.get(name) for name in deltas}
        for name, delta in deltas.items():
            to_send, new_residual = with_error_feedback(delta, previous[name], codec)
            delta.copy_(to_send)
            self.residuals[name] = new_residual
        return previous

    def _restore_residuals(self, previous: Mapping[str, Tensor | None]) -> None:
        for name, old in previous.items():
            if old is None:
                self.residuals.pop(name, None)
            else:
                self.residuals[name] = old

    @torch.no_grad()
    def _apply(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """Wait for fragment ``fragment``'s average, step its anchors, merge into the locals.

        ``merge_alpha`` overrides the schedule's (``finish`` merges with 0).
        """
        rnd = self._in_flight
        assert rnd is not None and rnd.fragment == fragment, "apply without a matching send"
        start = time.perf_counter()
        result, applied, norm = self._island_result(rnd)
        self._in_flight = None
        alpha = self.schedule.merge_alpha if merge_alpha is None else merge_alpha
        if applied:
            self._step_and_merge(fragment, rnd.deltas, alpha)
        # A skipped round keeps both anchors and locals: the island's progress is not thrown
        # away, it simply enters the next round's pseudo-gradient.
        del rnd.deltas
        return SyncReport(
            outer_steps=self.outer_steps,
            pseudo_grad_norm=norm,
            bytes_sent=result.stats.bytes_sent,
            bytes_received=result.stats.bytes_received,
            wall_s=rnd.send_blocked_s + time.perf_counter() - start,
            applied=applied,
            fragment=fragment,
            fragment_rounds=self.fragment_rounds[fragment],
            transport_s=result.stats.wall_s,
            non_finite_islands=result.stats.non_finite_islands,
            rejected_own=result.stats.rejected_own,
        )

    def _step_and_merge(self, fragment: int, deltas: Mapping[str, Tensor], alpha: float) -> None:
        """An applied round: the outer step on the fragment's anchors, the merge, the gather."""
        names: Sequence[str] = self._owned_fragments[fragment]
        if names:
            with record_function(labels.OUTER_STEP):
                # The outer-step count is the same on every island: bf16 noise agrees.
                outer_step(
                    self.outer_optimizer,
                    [self.anchors[name] for name in names],
                    [deltas[name] for name in names],
                    seed=self.outer_steps,
                )
        self.outer_steps += 1
        self.fragment_rounds[fragment] += 1
        with record_function(labels.MERGE):
            for name in names:
                merge_into_local(self.params[name].data, self.anchors[name], alpha)
        if self.shard is not None:
            self.shard.gather(self.fragments[fragment], self.params)
        if alpha == 0.0:
            self.synced_at[fragment] = self.inner_steps

    def _island_result(self, rnd: RoundInFlight) -> tuple[Exchanged, bool, float]:
        """The exchange's result, whether the round applies, and its norm, island-wide.

        Unsharded that is the transport's own verdict. Sharded, every share must agree
        (``IslandShard.agree``) before any rank steps: a failed share raises on every rank.
        """
        if self.shard is None:
            result = self._result(rnd)
            return result, result.stats.applied, result.norm
        error: Exception | None = rnd.error
        result = Exchanged(RoundStats(applied=False), 0.0)
        if error is None:
            try:
                result = self._result(rnd)
            except Exception as err:
                error = err
        own_norm = 0.0 if result.combined else result.norm
        applied, norm = self.shard.agree(result.stats.applied, own_norm, error)
        return result, applied, result.norm if result.combined else norm

    def _result(self, rnd: RoundInFlight) -> Exchanged:
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
        if self._in_flight is not None:
            self._result(self._in_flight)
