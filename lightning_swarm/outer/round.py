"""The outer round of one ``OuterSync``: every round, for every transport and membership.

A round of fragment f plans its buckets once (``transport.buckets.plan_buckets``), forms
``anchor - local`` in float32, opens the round (``Transport.open``) and starts the
transport per bucket; ``apply`` waits, agrees whether the round applies, steps the outer optimizer
(SGD and Adam(W) per bucket through ``algorithm.outer_optimizer``, any other over the fragment) and
merges. ``sync_delay`` only decides when ``apply`` runs; under a time budget
(``SyncState.budget``) the island's clock decides when a round runs, and ``open`` answers with
the factor that weighs this island's pseudo-gradient (applied before feedback and encoding).
Two forms:
- streamed (``OuterRound.streams``: a pipelined transport, no delay, a per-bucket outer step):
  form, error feedback, exchange, step and merge run bucket by bucket, bucket k's mean in flight
  while k - 1 steps and k + 1 forms; CUDA parameters with host anchors go through
  ``CudaStaging`` (without feedback).
- held: the fragment is formed into one float32 buffer on the training thread and its buckets go
  through the transport inline or on the ``SyncWorker``; the ``RoundInFlight`` lives until
  ``apply``.
New residuals replace the old only when the exchange succeeded: a failed round happened nowhere.
Elastic membership is a branch of the held form: ``open`` gets the round's place and an offer (the
outer state a healing peer may be sent, built on this thread) and may answer that the island
adopts the swarm's round; ``apply`` installs a heal the verdict carries, takes the swarm's clock
and applies the adopted fragment, all on the training thread.
The engine is the one writer of its ``SyncState`` (counters, anchors and outer optimizer installs,
residuals, the round in flight); ``SyncCheckpoint`` only reads it and builds what an install puts
in place. The engine owns its reused buffers and staging for its whole life.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm import global_norm, merge_into_local, outer_step
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.diloco import max_abs, sum_of_squares
from lightning_swarm.algorithm.outer_optimizer import (
    FastKind,
    fast_outer_kind,
)
from lightning_swarm.outer.bucket_step import (
    BucketJob,
    Feedback,
    StreamedResult,
    feed_back_pieces,
    feed_back_tensors,
    form_fragment,
    restore_residuals,
    start_job,
    state_beside,
)
from lightning_swarm.outer.checkpoint_state import SyncCheckpoint, pending_of
from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.staging import CudaStaging, pin_round_memory
from lightning_swarm.outer.sync_state import Exchanged, RoundInFlight, SyncState
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.resume.outer_record import OuterRecord, PendingRound
from lightning_swarm.transport.base import (
    Bucket,
    Handle,
    Opening,
    RoundPlace,
    RoundRequest,
    RoundStats,
    Work,
)
from lightning_swarm.transport.buckets import Piece, numel_of, plan_buckets

Pending = tuple[list[Piece], Tensor, Handle]


class OuterRound:
    """The round engine (see the module docstring).

    Args:
        state: the sync's shared state (``SyncState``), owned by the ``OuterSync``.
        checkpoint: reads the state for a healing peer's offer and installs a heal.
    """

    def __init__(self, state: SyncState, checkpoint: SyncCheckpoint) -> None:
        self.state = state
        self.checkpoint = checkpoint
        self.transport = state.transport
        self.staging = CudaStaging()
        # Streamed CPU path: bucket means in flight while this thread forms and steps the
        # neighbouring buckets (two or three measured no better on 2 cores).
        self.in_flight = 1
        self._delta: Tensor | None = None
        # The last held round's buffer, reused by the next held round of the same size.
        self._hold: Tensor | None = None
        self._reduce_s = 0.0
        # This round's weight (``_open``): 1.0 unless a time budget weighs the islands.
        self._scale = 1.0
        # A streamed round's error feedback: its names and the new residuals (scratch).
        self._feedback: Feedback | None = None

    def kind(self) -> FastKind | None:
        """The per-bucket outer step, or None: one ``optimizer.step()`` over the fragment."""
        s = self.state
        if any(not t.is_contiguous() for t in [*s.anchors.values(), *s.params.values()]):
            return None
        return fast_outer_kind(s.outer_optimizer)

    @property
    def streams(self) -> bool:
        """Whether rounds run as one streamed pass (see the module docstring)."""
        s = self.state
        staged = any(p.device.type == "cuda" for p in s.params.values()) and (
            s.anchor_device.type == "cpu"
        )
        return (
            self.transport.pipelined
            and s.schedule.sync_delay == 0
            and not s.placeholders
            and not (staged and self._codec() is not None)
            and self.kind() is not None
        )

    def _codec(self) -> Codec | None:
        """The codec error feedback uses, or None without feedback."""
        streaming = self.state.streaming
        return streaming.codec if streaming.error_feedback else None

    def buffer_bytes(self) -> int:
        """Bytes of the reused buffers held (pipeline buckets and staging slots)."""
        own = sum(0 if t is None else t.numel() * 4 for t in (self._delta, self._hold))
        return own + self.staging.buffer_bytes()

    # -- the state's writes: this engine is the one writer of its SyncState ----------------

    def finish(self) -> list[SyncReport]:
        """The end-of-fit round (``OuterSync.finish``): the round in flight, then every fragment
        out of sync merged with alpha 0; ``ended_at`` keeps a round from applying twice."""
        s = self.state
        reports = []
        pending = self.apply_in_flight()
        if pending is not None:
            reports.append(pending)
        for fragment in range(len(s.fragments)):
            if self._out_of_sync(fragment):
                reports.append(self.round(fragment, merge_alpha=0.0))
        s.ended_at = s.inner_steps
        return reports

    def _out_of_sync(self, fragment: int) -> bool:
        """Whether ``finish`` runs a round of ``fragment``. Under a time budget islands count
        different steps, so only what every island shares decides: a budgeted fit ends right
        after a round (the stopping rule, or SIGTERM), where the islands differ from the
        anchors only when that round merged with ``merge_alpha > 0``."""
        s = self.state
        if s.budget is not None:
            return s.schedule.merge_alpha != 0
        return s.synced_at[fragment] != s.inner_steps

    @torch.no_grad()
    def reset_to_anchors(self) -> None:
        """Every parameter becomes its anchor again; error-feedback residuals are dropped
        (sharded: collective over the island, which gathers the names other ranks own)."""
        s = self.state
        for name in s.owned:
            merge_into_local(s.params[name].data, s.anchors[name], 0.0)
        s.residuals = {}
        if s.shard is not None:
            s.shard.gather(list(s.params), s.params)

    def export_in_flight(self) -> PendingRound | None:
        """The round in flight after its exchange, as a save holds it (None when none is);
        its buffer is never reused, since a state dict now holds its deltas."""
        rnd = self.state.in_flight
        if rnd is None:
            return None
        result = _wait_exchange(rnd)
        rnd.exported = True
        return pending_of(rnd, result, self.state.shard is not None)

    def install(self, record: OuterRecord) -> None:
        """Install a record that passed ``SyncCheckpoint.check_state_dict``: anchors, outer
        optimizer, counters and a round in flight (``SyncCheckpoint.installable``)."""
        new, s = self.checkpoint.installable(record), self.state
        s.anchors, s.outer_optimizer, s.placeholders = new.anchors, new.outer_optimizer, False
        c = new.counters
        s.inner_steps, s.outer_steps, s.ended_at = c.inner_steps, c.outer_steps, c.ended_at
        s.fragment_rounds, s.synced_at = list(c.fragment_rounds or []), list(c.synced_at or [])
        s.in_flight = new.in_flight

    def install_residuals(self, state: Mapping[str, Any]) -> None:
        """Install the residuals of an ``island_state_dict`` (``SyncCheckpoint.residuals_of``)."""
        self.state.residuals = self.checkpoint.residuals_of(state)

    def install_heal(self, stats: RoundStats) -> bool:
        """Install the heal a round delivered, keeping this rank's progress since its anchors;
        after a heal anywhere in the island, gather its parameters and counters (collective
        over the island when sharded). Returns whether the island was healed."""
        s = self.state
        if stats.heal is not None:
            self._install_peer(OuterRecord.of(stats.heal))
        if stats.island_healed and s.shard is not None:
            s.shard.gather(list(s.params), s.params)
            self.agree_counters()
        return stats.heal is not None or stats.island_healed

    @torch.no_grad()
    def _install_peer(self, saved: OuterRecord) -> None:
        """Install a live island's ``peer_offer``, keeping this rank's own progress since its
        anchors: ``local <- anchor_new + (local - anchor_old)`` on the owned names.

        A heal in the middle of a run (the island missed a commit) whose round is then
        abandoned would otherwise leave stale weights under the new anchors, and the island's
        next pseudo-gradient would carry the swarm's whole advance since. No round is in flight
        at an install (an apply runs it).

        Raises:
            ValueError: the offer is another share of the outer state than this rank's.
        """
        s = self.state
        self.checkpoint.check_share(saved)
        own = {n: s.params[n].float() - s.anchors[n].float() for n in s.owned}
        # The clock is set below; none is in flight at an install.
        record = replace(saved, counters=replace(saved.counters, inner_steps=0), pending=None)
        self.checkpoint.check_state_dict(record)
        self.install(record)
        s.inner_steps = saved.counters.inner_steps
        for name in s.owned:
            s.params[name].copy_(s.anchors[name].float() + own[name])

    def agree_counters(self) -> None:
        """Position 0's inner-step counters on every rank of the island (collective).

        torchft may heal each rank from another live island, and islands at the same committed
        round can differ in inner steps (one abandoned a round another never took part in): the
        shares of one island must count alike, as their checkpoint files are merged by them.
        """
        s = self.state
        assert s.shard is not None, "only a sharded island's ranks count apart"
        ended = -1 if s.ended_at is None else s.ended_at
        values = [s.inner_steps, *(-1 if v is None else v for v in s.synced_at), ended]
        counters = torch.tensor(values, dtype=torch.int64, device=s.shard.device)
        dist.broadcast(counters, group=s.shard.group, group_src=0)
        inner, *synced, ended = (int(v) for v in counters.tolist())
        s.inner_steps, s.ended_at = inner, None if ended < 0 else ended
        s.synced_at = [None if v < 0 else v for v in synced]

    def _count_applied(self, fragment: int, alpha: float) -> None:
        """An applied round of ``fragment`` merged with ``alpha``: advance the counters."""
        s = self.state
        s.outer_steps += 1
        s.fragment_rounds[fragment] += 1
        if alpha == 0.0:
            s.synced_at[fragment] = s.inner_steps

    # -- the schedule ------------------------------------------------------------------------
    def on_inner_step(self) -> SyncReport | None:
        """Count one inner step; then send (or run) the fragment the schedule names and apply
        the one due."""
        s = self.state
        s.inner_steps += 1
        step = s.inner_steps
        if s.budget is not None:  # one fragment, no delay (``config.check_budget_options``)
            return self._budgeted_round() if s.budget.spent() else None
        sending = s.schedule.sends_at(step)
        if sending is not None and self.streams:
            return self.round(sending)
        if sending is not None:
            self.send(sending, inline=s.schedule.sync_delay == 0)
        applying = s.schedule.applies_at(step)
        # A round sent by the end-of-fit round's step was applied by it.
        if applying is None or (
            s.ended_at is not None and step - s.schedule.sync_delay <= s.ended_at
        ):
            return None
        return self.apply(applying)

    def _budgeted_round(self) -> SyncReport:
        """The island's time budget is spent: its round now; the next budget starts when the
        island leaves it, whether the round applied or failed."""
        budget = self.state.budget
        assert budget is not None
        try:
            return self.round(0)
        finally:
            budget.restart(self.state.inner_steps)

    def _open(self, request: RoundRequest) -> Opening:
        """``Transport.open``, with this island's work under a time budget: the transport
        answers with the weight's scale (kept for this round's buckets) and the swarm's most
        inner steps (kept on the budget, for the stopping rule)."""
        s, budget = self.state, self.state.budget
        if budget is None:
            self._scale = 1.0
            return self.transport.open(request)
        work = Work(budget.work(s.inner_steps), s.inner_steps)
        opening = self.transport.open(replace(request, work=work))
        self._scale = opening.scale
        budget.swarm_steps = opening.swarm_steps
        return opening

    @torch.no_grad()
    def round(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """One whole round of ``fragment`` now; ``merge_alpha`` overrides the schedule's."""
        if not self.streams:
            self.send(fragment, inline=True)
            return self.apply(fragment, merge_alpha=merge_alpha)
        s = self.state
        assert s.in_flight is None
        alpha = s.schedule.merge_alpha if merge_alpha is None else merge_alpha
        start = time.perf_counter()
        result = StreamedResult(0.0, 0)  # a share with no tensors in this fragment
        error: BaseException | None = None
        try:
            if s.owned_fragments[fragment]:
                with record_function(labels.BUCKETED_ROUND):
                    result = self._stream(s.owned_fragments[fragment], alpha)
        except Exception as err:
            if s.shard is None:
                raise
            error = err  # the island agrees on it first, then every rank raises
        norm = result.norm
        if s.shard is not None:
            _, norm = s.shard.agree(True, result.norm, error)
            s.shard.gather(s.fragments[fragment], s.params)
        self._count_applied(fragment, alpha)
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

    def apply_in_flight(self) -> SyncReport | None:
        """Apply the round in flight now, if any (the end of fit)."""
        rnd = self.state.in_flight
        return None if rnd is None else self.apply(rnd.fragment)

    def drain(self) -> None:
        """Wait for a round in flight without applying it (before a save or at teardown)."""
        if self.state.in_flight is not None:
            _wait_exchange(self.state.in_flight)

    # -- the streamed form: one pass ----------------------------------------------------
    def _stream(self, names: list[str], alpha: float) -> StreamedResult:
        """Open, then per bucket: form, start, wait, step, merge (this rank's ``names``)."""
        s, t = self.state, self.transport
        params = [s.params[n] for n in names]
        on_cuda = params[0].device.type == "cuda" and s.anchor_device.type == "cpu"
        if on_cuda:
            pin_round_memory(s.outer_optimizer, s.anchors)
        finite = bool(torch.isfinite(max_abs(list(params))).item())
        self._open(RoundRequest(s.outer_steps, finite, {n: s.params[n].shape for n in names}))
        allocate = self.staging.allocate_state if on_cuda else state_beside
        kind = self.kind()
        assert kind is not None
        job = start_job(s.outer_optimizer, self._pairs(names), kind, alpha, allocate, s.outer_steps)
        numels = [p.numel() for p in params]
        self._reduce_s = 0.0
        codec, self._feedback = self._codec(), None
        if codec is not None:
            scratch = {n: torch.empty(s.params[n].shape, device=s.anchor_device) for n in names}
            self._feedback = (names, scratch, codec)
        if on_cuda:
            staged = max(t.block_size, self.staging.bucket_numel_for(job, t.bucket_numel))
            plan = plan_buckets(numels, staged, t.block_size)
            delta = self._buffer(numel_of(plan[0]), job.device)
            result = self.staging.run(job, plan, self._exchange_bucket, delta)
        else:
            result = self._pipelined(job, plan_buckets(numels, t.bucket_numel, t.block_size))
        if self._feedback is not None:  # the round happened: its residuals replace the old
            s.residuals.update(self._feedback[1])
            self._feedback = None
        return replace(result, reduce_s=self._reduce_s)

    def _pipelined(self, job: BucketJob, plan: list[list[Piece]]) -> StreamedResult:
        """Anchors on the parameters' device: ``in_flight + 1`` reused buckets, stepped in place
        through views (buckets touch disjoint elements: the order of writes does not matter)."""
        numel = max(numel_of(bucket) for bucket in plan)
        num_buffers = min(self.in_flight + 1, len(plan))
        deltas = self._buffer(numel * num_buffers, job.device)
        sumsq = torch.zeros((), dtype=torch.float32, device=job.device)
        sent = 0
        pending: list[Pending] = []
        for k, bucket in enumerate(plan):
            start = (k % num_buffers) * numel
            delta = deltas[start : start + numel_of(bucket)]
            job.form(bucket, delta, job.anchor_at)
            if self._scale != 1.0:  # weighted before feedback and encoding see it
                delta.mul_(self._scale)
            if self._feedback is not None:
                feed_back_pieces(self.state.residuals, *self._feedback, bucket, delta)
            pending.append((bucket, delta, self._start(delta, bucket)))
            if len(pending) > self.in_flight:
                sent += self._finish(job, *pending.pop(0), sumsq)
        for item in pending:
            sent += self._finish(job, *item, sumsq)
        return StreamedResult(float(sumsq.sqrt().item()), sent)

    def _finish(
        self, job: BucketJob, bucket: list[Piece], delta: Tensor, handle: Handle, sumsq: Tensor
    ) -> int:
        """Wait for ``delta``'s mean, then step and merge its pieces in place."""
        sent = self._wait(handle)
        sumsq += sum_of_squares(delta)
        job.step_and_merge(bucket, delta, job.anchor_at, job.state_at)
        return sent

    def _start(self, flat: Tensor, bucket: Sequence[Piece]) -> Handle:
        start = time.perf_counter()
        with record_function(labels.EXCHANGE):
            handle = self.transport.start(Bucket(flat, _runs(bucket)))
        self._reduce_s += time.perf_counter() - start
        return handle

    def _wait(self, handle: Handle) -> int:
        start = time.perf_counter()
        with record_function(labels.EXCHANGE):
            sent = handle.wait()
        self._reduce_s += time.perf_counter() - start
        return sent

    def _exchange_bucket(self, flat: Tensor, bucket: list[Piece]) -> int:
        """One bucket's mean, in place, now (the staged path's ``Exchange``; no feedback)."""
        if self._scale != 1.0:
            flat.mul_(self._scale)
        return self._wait(self._start(flat, bucket))

    def _buffer(self, numel: int, device: torch.device) -> Tensor:
        if self._delta is None or self._delta.device != device or self._delta.numel() < numel:
            self._delta = torch.empty(numel, dtype=torch.float32, device=device)
        return self._delta

    def _pairs(self, names: list[str]) -> tuple[list[Tensor], list[Tensor]]:
        """The parameters and anchors of ``names``, in order."""
        return [self.state.params[n] for n in names], [self.state.anchors[n] for n in names]

    # -- the held form -----------------------------------------------------------------------
    @torch.no_grad()
    def send(self, fragment: int, *, inline: bool) -> None:
        """Form fragment ``fragment``'s pseudo-gradients and start their exchange."""
        s = self.state
        assert s.in_flight is None, "the schedule allows one round in flight at a time"
        if s.placeholders:
            raise RuntimeError(
                "an outer round started while the anchors are still placeholders awaiting a "
                "resume (defer_anchors=True and load_state_dict was never called); install the "
                "saved anchors with load_state_dict before the first inner step."
            )
        start = time.perf_counter()
        with record_function(labels.PSEUDO_GRADIENT):
            hold, self._hold = self._hold, None
            flat, deltas = form_fragment(s.params, s.anchors, s.owned_fragments[fragment], hold)
        rnd = RoundInFlight(fragment, s.inner_steps, deltas, flat=flat)
        delay = 0 if inline else s.schedule.sync_delay
        place = RoundPlace(fragment, s.inner_steps, s.inner_steps + delay)
        s.in_flight = rnd
        # A transport that heals peers sends them this (references; nothing moves until apply).
        offer = self.checkpoint.peer_offer() if self.transport.heals else None
        exchange = functools.partial(self._exchange, flat, deltas, s.outer_steps, place, offer)
        if inline:
            try:
                rnd.result = exchange()
            except Exception as err:
                if s.shard is None:
                    s.in_flight = None
                    raise
                rnd.error = err  # the island agrees on it at the apply, then raises
        else:
            worker = s.streaming.worker
            assert worker is not None
            rnd.future = worker.submit(exchange)
        rnd.send_blocked_s = time.perf_counter() - start

    @torch.no_grad()
    def _exchange(
        self,
        flat: Tensor,
        deltas: dict[str, Tensor],
        round_index: int,
        place: RoundPlace,
        offer: Mapping[str, object] | None,
    ) -> Exchanged:
        """Error feedback, ``open``, every bucket (a pipelined transport keeps two in flight),
        ``agree`` (on the worker when delayed). Overwrites ``flat`` with the average, or, when
        the island adopts the swarm's round, a zero buffer of that fragment's own. The residuals
        of a skipped, failed or dropped round are restored: its whole pseudo-gradient re-enters
        the next round anyway (anchors and locals stay)."""
        s, t = self.state, self.transport
        # This rank's share of the fragment is empty: nothing to exchange, unless the
        # transport's round needs every rank of the island (elastic islands, one Manager a rank).
        if not deltas and not s.transport.every_rank_in_round:
            return Exchanged(RoundStats(applied=True), 0.0)
        codec, start, sent = self._codec(), time.perf_counter(), 0
        previous: dict[str, Tensor | None] = {}
        opening = Opening()
        try:
            with record_function(labels.EXCHANGE):
                # Residuals are finite (a refused round restores them), so the flag is the
                # pseudo-gradient's; it is opened before feedback so a weight scales first.
                finite = flat.numel() == 0 or bool(torch.isfinite(max_abs([flat])).item())
                shapes = {n: d.shape for n, d in deltas.items()}
                opening = self._open(RoundRequest(round_index, finite, shapes, place, offer))
                if opening.adopt is not None:  # the swarm's fragment, contributing zeros
                    names = s.owned_fragments[opening.adopt.fragment]
                    flat, deltas = _zeros(s.params, names, flat.device)
                elif self._scale != 1.0:
                    flat.mul_(self._scale)
                if codec is not None and opening.adopt is None:
                    previous = feed_back_tensors(s.residuals, deltas, codec)
                if not opening.abandon:
                    sent = self._buckets(flat, [d.numel() for d in deltas.values()])
                stats = t.agree()
                if s.budget is not None and not stats.applied:
                    # The stopping rule counts applied rounds only (the same on every island):
                    # a fit ends holding the global model, never at an abandoned round.
                    s.budget.swarm_steps = None
                elif s.budget is not None and stats.swarm_steps is not None:
                    s.budget.swarm_steps = stats.swarm_steps
        except BaseException:
            # The round did not happen anywhere (anchors unchanged): neither did its feedback.
            restore_residuals(s.residuals, previous)
            raise
        stats = replace(
            stats,
            bytes_sent=stats.bytes_sent + sent,
            bytes_received=stats.bytes_received + sent,
            wall_s=time.perf_counter() - start,
        )
        if opening.adopt is not None or not stats.applied:  # the own round is not applied
            restore_residuals(s.residuals, previous)
        norm = global_norm(list(deltas.values())) if stats.applied else 0.0
        if opening.adopt is None:
            return Exchanged(stats, norm)
        return Exchanged(
            stats, norm, adopted=opening.adopt, adopted_flat=flat, adopted_deltas=deltas
        )

    def _buckets(self, flat: Tensor, numels: list[int]) -> int:
        """Start every bucket of ``flat`` (tensors of ``numels`` back to back) and wait for
        them: a pipelined transport keeps ``in_flight`` in flight; returns the bytes sent."""
        t, sent = self.transport, 0
        plan = plan_buckets(numels, t.bucket_numel, t.block_size)
        handles: list[Handle] = []
        at = 0
        for bucket in plan:
            handles.append(t.start(Bucket(flat[at : at + numel_of(bucket)], _runs(bucket))))
            at += numel_of(bucket)
            if t.pipelined and len(handles) > self.in_flight:
                sent += handles.pop(0).wait()
        return sent + sum(handle.wait() for handle in handles)

    @torch.no_grad()
    def apply(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """Wait for fragment ``fragment``'s average, step its anchors, merge into the locals.

        ``merge_alpha`` overrides the schedule's (``finish`` merges with 0). A heal the round
        delivered is installed first; an adopted round takes the swarm's clock and applies
        the swarm's fragment instead (elastic membership).
        """
        s = self.state
        rnd = s.in_flight
        assert rnd is not None and rnd.fragment == fragment, "apply without a matching send"
        start = time.perf_counter()
        result, applied, norm = self._island_result(rnd)
        s.in_flight = None
        healed = self.install_heal(result.stats)
        flat, deltas = rnd.flat, rnd.deltas
        if result.adopted is not None:
            s.inner_steps = result.adopted.apply_step  # the swarm's clock
            fragment, flat = result.adopted.fragment, result.adopted_flat
            deltas = result.adopted_deltas
        alpha = s.schedule.merge_alpha if merge_alpha is None else merge_alpha
        if applied:
            self._step_and_merge(fragment, flat, deltas, alpha)
        # A skipped round keeps both anchors and locals: the island's progress is not thrown
        # away, it simply enters the next round's pseudo-gradient.
        if rnd.flat is not None and not rnd.exported:
            self._hold = rnd.flat
        del rnd.deltas, rnd.flat
        return SyncReport(
            outer_steps=s.outer_steps,
            pseudo_grad_norm=norm,
            bytes_sent=result.stats.bytes_sent,
            bytes_received=result.stats.bytes_received,
            wall_s=rnd.send_blocked_s + time.perf_counter() - start,
            applied=applied,
            fragment=fragment,
            fragment_rounds=s.fragment_rounds[fragment],
            transport_s=result.stats.wall_s,
            non_finite_islands=result.stats.non_finite_islands,
            rejected_own=result.stats.rejected_own,
            healed=healed,
        )

    def _step_and_merge(
        self, fragment: int, flat: Tensor | None, deltas: Mapping[str, Tensor], alpha: float
    ) -> None:
        """An applied round: the outer step on the fragment's anchors, the merge, the gather.
        ``deltas`` are the fragment's averaged pseudo-gradients (views of ``flat`` if given)."""
        s = self.state
        names = s.owned_fragments[fragment]
        kind = self.kind()
        if names and kind is not None:
            if flat is None:  # a round restored from a checkpoint: its deltas by name
                flat = torch.cat([deltas[n].reshape(-1) for n in names])
            job = start_job(
                s.outer_optimizer, self._pairs(names), kind, alpha, state_beside, s.outer_steps
            )
            numels = [s.params[n].numel() for n in names]
            offset = 0
            for bucket in plan_buckets(numels, self.transport.bucket_numel):
                numel = numel_of(bucket)
                delta = flat[offset : offset + numel]
                job.step_and_merge(bucket, delta, job.anchor_at, job.state_at)
                offset += numel
        elif names:
            with record_function(labels.OUTER_STEP):
                anchors = [s.anchors[n] for n in names]
                outer_step(
                    s.outer_optimizer, anchors, [deltas[n] for n in names], seed=s.outer_steps
                )
            with record_function(labels.MERGE):
                for name in names:
                    merge_into_local(s.params[name].data, s.anchors[name], alpha)
        if s.shard is not None:
            s.shard.gather(s.fragments[fragment], s.params)
        self._count_applied(fragment, alpha)

    def _island_result(self, rnd: RoundInFlight) -> tuple[Exchanged, bool, float]:
        """The exchange's result, whether the round applies, and its norm, island-wide.

        Unsharded that is the transport's own verdict. Sharded, every share must agree
        (``IslandShard.agree``) before any rank steps: a failed share raises on every rank.
        """
        s = self.state
        if s.shard is None:
            result = _wait_exchange(rnd)
            return result, result.stats.applied, result.norm
        error: Exception | None = rnd.error
        result = Exchanged(RoundStats(applied=False), 0.0)
        if error is None:
            try:
                result = _wait_exchange(rnd)
            except Exception as err:
                error = err
        own_norm = 0.0 if result.combined else result.norm
        applied, norm = s.shard.agree(result.stats.applied, own_norm, error)
        return result, applied, result.norm if result.combined else norm


def _runs(bucket: Sequence[Piece]) -> tuple[int, ...]:
    return tuple(p.length for p in bucket)


def _zeros(
    params: Mapping[str, Tensor], names: Sequence[str], device: torch.device
) -> tuple[Tensor, dict[str, Tensor]]:
    """A float32 zero buffer for ``names`` back to back, and a view of it per name."""
    flat = torch.zeros(sum(params[n].numel() for n in names), device=device)
    views, offset = {}, 0
    for name in names:
        numel = params[name].numel()
        views[name] = flat[offset : offset + numel].view(params[name].shape)
        offset += numel
    return flat, views


def _wait_exchange(rnd: RoundInFlight) -> Exchanged:
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
