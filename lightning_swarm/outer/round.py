"""The round engine of one ``OuterSync``: ``send`` forms ``anchor - local`` in float32, opens the
round and per planned bucket applies error feedback and starts the transport; ``apply`` waits,
agrees whether the round applies, steps the outer optimizer and merges (installing a heal or
an adopted round first). ``sync_delay`` only decides when ``apply`` runs. ``streams``: one pass
forms, exchanges, steps and merges bucket by bucket (CUDA parameters with host anchors through
``CudaStaging``). New residuals replace the old only once the round applied. The engine owns its
reused buffers and staging for life.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm import global_norm, merge_into_local, outer_step
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.diloco import max_abs, sum_of_squares
from lightning_swarm.algorithm.model_layout import fingerprint
from lightning_swarm.algorithm.outer_optimizer import FastKind, fast_outer_kind
from lightning_swarm.outer.bucket_step import (
    BucketJob,
    Feedback,
    feed_back_pieces,
    form_fragment,
    start_job,
    state_beside,
)
from lightning_swarm.outer.staging import CudaStaging, pin_round_memory
from lightning_swarm.outer.sync_state import Exchanged, RoundInFlight, SyncReport, SyncState
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
    """The round engine over one ``SyncState`` (owned by the ``OuterSync``)."""

    def __init__(self, state: SyncState) -> None:
        self.state = state
        self.transport = state.transport
        self.staging = CudaStaging()
        # Streamed CPU path: bucket means in flight while this thread forms and steps the
        # neighbouring buckets.
        self.in_flight = 1
        self._delta: Tensor | None = None
        # The last held round's buffer, reused by the next held round of the same size.
        self._hold: Tensor | None = None
        self._reduce_s = 0.0
        # This round's weight (``_open``): 1.0 unless a time budget weighs the islands.
        self._scale = 1.0
        # The placement fingerprint of each set of names a round has sent (``_open``).
        self._layout_prints: dict[tuple[str, ...], int] = {}

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
        streaming = self.state.streaming
        return streaming.codec if streaming.error_feedback else None

    def buffer_bytes(self) -> int:
        """Bytes of the reused buffers held (pipeline buckets and staging slots)."""
        own = sum(0 if t is None else t.numel() * 4 for t in (self._delta, self._hold))
        return own + self.staging.buffer_bytes()

    def _open(self, request: RoundRequest) -> Opening:
        """``Transport.open``; under a time budget with this island's work, keeping the
        weight's scale for this round and the swarm's most inner steps on the budget."""
        s, budget = self.state, self.state.budget
        names = tuple(request.names)
        if names not in self._layout_prints:  # a fragment's names are the same every round
            own = {n: s.layout[n] for n in names}
            self._layout_prints[names] = fingerprint(own, placement=True)
        request = replace(request, layout=self._layout_prints[names])
        if budget is None:
            self._scale = 1.0
            return self.transport.open(request)
        work = Work(budget.work(s.inner_steps), s.inner_steps)
        opening = self.transport.open(replace(request, work=work))
        self._scale = opening.scale
        budget.swarm_steps = opening.swarm_steps
        return opening

    def worker_idle(self) -> None:
        """Before a collective on the training thread: the background exchanges of every
        optimizer have ended (``SyncWorker.wait_idle``); no wait without ``sync_delay``."""
        worker = self.state.streaming.worker
        if worker is not None:
            worker.wait_idle()

    @torch.no_grad()
    def round(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """One whole round of ``fragment`` now; ``merge_alpha`` overrides the schedule's."""
        self.worker_idle()
        if not self.streams:
            self.send(fragment, inline=True)
            return self.apply(fragment, merge_alpha=merge_alpha)
        s = self.state
        assert s.held is None
        alpha = s.schedule.merge_alpha if merge_alpha is None else merge_alpha
        start = time.perf_counter()
        result = Exchanged(RoundStats(), 0.0)  # a share with no tensors in this fragment
        error: BaseException | None = None
        try:
            if s.owned_fragments[fragment]:
                with record_function(labels.BUCKETED_ROUND):
                    result = self._stream(fragment, alpha)
        except Exception as err:
            if s.shard is None:
                raise
            error = err  # the island agrees on it first, then every rank raises
        norm = result.norm
        if s.shard is not None:
            _, norm = s.shard.agree(True, result.norm, error)
            s.shard.gather(s.fragments[fragment], s.params)
        s.count_applied(fragment, alpha)
        return self._report(fragment, result.stats, norm, True, time.perf_counter() - start)

    def _report(
        self, fragment: int, stats: RoundStats, norm: float, applied: bool, wall_s: float
    ) -> SyncReport:
        return SyncReport(
            outer_steps=self.state.outer_steps,
            pseudo_grad_norm=norm,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            wall_s=wall_s,
            applied=applied,
            fragment=fragment,
            fragment_rounds=self.state.fragment_rounds[fragment],
            transport_s=stats.wall_s,
            non_finite_islands=stats.non_finite_islands,
            rejected_own=stats.rejected_own,
            outer_momentum=self.state.momentum_used.get(fragment),
        )

    # -- the streamed form: one pass ----------------------------------------------------
    def _stream(self, fragment: int, alpha: float) -> Exchanged:
        """Open, then per bucket: form, start, wait, step, merge (this rank's share of
        ``fragment``)."""
        s, t = self.state, self.transport
        names = s.owned_fragments[fragment]
        params = [s.params[n] for n in names]
        on_cuda = params[0].device.type == "cuda" and s.anchor_device.type == "cpu"
        if on_cuda:
            pin_round_memory(s.outer_optimizer, s.anchors)
        finite = bool(torch.isfinite(max_abs(list(params))).item())
        self._open(RoundRequest(s.outer_steps, finite, {n: s.params[n].shape for n in names}))
        allocate = self.staging.allocate_state if on_cuda else state_beside
        kind = self.kind()
        assert kind is not None
        s.schedule_momentum(fragment)  # after _open: a heal there rebuilt the optimizer
        job = start_job(s.outer_optimizer, self._pairs(names), kind, alpha, allocate, s.outer_steps)
        numels = [p.numel() for p in params]
        self._reduce_s = 0.0
        feedback = self._feedback({n: s.params[n].shape for n in names})
        if on_cuda:
            staged = max(t.block_size, self.staging.bucket_numel_for(job, t.bucket_numel))
            plan = plan_buckets(numels, staged, t.block_size)
            delta = self._buffer(numel_of(plan[0]), job.device)
            result = self.staging.run(job, plan, self._exchange_bucket, delta)
        else:
            plan = plan_buckets(numels, t.bucket_numel, t.block_size)
            result = self._pipelined(job, plan, feedback)
        if feedback is not None:  # the round happened: its residuals replace the old
            s.residuals.update(feedback[1])
        return replace(result, stats=replace(result.stats, wall_s=self._reduce_s))

    def _feedback(self, shapes: Mapping[str, torch.Size]) -> Feedback | None:
        """Error feedback for a round of these names: their new residuals go to scratch, which
        replaces the old ones only once the round applied (a failed round happened nowhere)."""
        codec, device = self._codec(), self.state.anchor_device
        if codec is None:
            return None
        return (
            list(shapes),
            {n: torch.empty(shape, device=device) for n, shape in shapes.items()},
            codec,
        )

    def _pipelined(
        self, job: BucketJob, plan: list[list[Piece]], feedback: Feedback | None = None
    ) -> Exchanged:
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
            if feedback is not None:
                feed_back_pieces(self.state.residuals, *feedback, bucket, delta)
            pending.append((bucket, delta, self._start(delta, bucket)))
            if len(pending) > self.in_flight:
                sent += self._finish(job, *pending.pop(0), sumsq)
        for item in pending:
            sent += self._finish(job, *item, sumsq)
        return Exchanged.streamed(sumsq, sent)

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
        return [self.state.params[n] for n in names], [self.state.anchors[n] for n in names]

    # -- the held form -----------------------------------------------------------------------
    @torch.no_grad()
    def send(self, fragment: int, *, inline: bool) -> None:
        """Form fragment ``fragment``'s pseudo-gradients and start their exchange."""
        s = self.state
        assert s.held is None, "the schedule allows one round in flight at a time"
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
        s.held = rnd
        # A transport that heals peers sends them this (references; nothing moves until apply).
        offer = s.peer_offer() if self.transport.heals else None
        exchange = functools.partial(self._exchange, flat, deltas, s.outer_steps, place, offer)
        if inline:
            self.worker_idle()
            try:
                rnd.result = exchange()
            except Exception as err:
                if s.shard is None:
                    s.held = None
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
        """``open``, every bucket with its error feedback, ``agree`` (on the worker when
        delayed). Overwrites ``flat`` with the average or, when the island adopts the swarm's
        round, a zero buffer of that fragment's own. Only an applied own round replaces the
        residuals: else its whole pseudo-gradient re-enters the next round."""
        s, t = self.state, self.transport
        # This rank's share of the fragment is empty: nothing to exchange, unless the
        # transport's round needs every rank of the island (elastic islands, one Manager a rank).
        if not deltas and not s.transport.every_rank_in_round:
            return Exchanged(RoundStats(applied=True), 0.0)
        start, sent = time.perf_counter(), 0
        with record_function(labels.EXCHANGE):
            # Residuals are finite (a refused round keeps the old), so the flag is the
            # pseudo-gradient's; it is opened before feedback so a weight scales first.
            finite = flat.numel() == 0 or bool(torch.isfinite(max_abs([flat])).item())
            shapes = {n: d.shape for n, d in deltas.items()}
            opening = self._open(RoundRequest(round_index, finite, shapes, place, offer))
            feedback = None
            if opening.adopt is not None:  # the swarm's fragment, contributing zeros
                names = s.owned_fragments[opening.adopt.fragment]
                sizes = [s.params[n].numel() for n in names]
                flat = torch.zeros(sum(sizes), device=flat.device)
                views = zip(names, flat.split(sizes), strict=True)
                deltas = {n: v.view(s.params[n].shape) for n, v in views}
            else:
                if self._scale != 1.0:
                    flat.mul_(self._scale)
                feedback = self._feedback(shapes)
            if not opening.abandon:
                sent = self._buckets(flat, [d.numel() for d in deltas.values()], feedback)
            stats = t.agree()
            if s.budget is not None and not stats.applied:
                # The stopping rule counts applied rounds only (the same on every island):
                # a fit ends holding the global model, never at an abandoned round.
                s.budget.swarm_steps = None
            elif s.budget is not None and stats.swarm_steps is not None:
                s.budget.swarm_steps = stats.swarm_steps
        if feedback is not None and stats.applied and not opening.abandon:
            s.residuals.update(feedback[1])
        stats = replace(
            stats,
            bytes_sent=stats.bytes_sent + sent,
            bytes_received=stats.bytes_received + sent,
            wall_s=time.perf_counter() - start,
        )
        norm = global_norm(list(deltas.values())) if stats.applied else 0.0
        if opening.adopt is None:
            return Exchanged(stats, norm)
        return Exchanged(
            stats, norm, adopted=opening.adopt, adopted_flat=flat, adopted_deltas=deltas
        )

    def _buckets(self, flat: Tensor, numels: list[int], feedback: Feedback | None) -> int:
        """Start every bucket of ``flat`` (tensors of ``numels`` back to back) after its error
        feedback and wait for them: a pipelined transport keeps ``in_flight`` in flight;
        returns the bytes sent."""
        t, sent = self.transport, 0
        plan = plan_buckets(numels, t.bucket_numel, t.block_size)
        handles: list[Handle] = []
        at = 0
        for bucket in plan:
            delta = flat[at : at + numel_of(bucket)]
            if feedback is not None:
                feed_back_pieces(self.state.residuals, *feedback, bucket, delta)
            handles.append(t.start(Bucket(delta, _runs(bucket))))
            at += numel_of(bucket)
            if t.pipelined and len(handles) > self.in_flight:
                sent += handles.pop(0).wait()
        return sent + sum(handle.wait() for handle in handles)

    @torch.no_grad()
    def apply(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """Wait for fragment ``fragment``'s average, step its anchors, merge into the locals.

        ``merge_alpha`` overrides the schedule's. A heal the round delivered is installed
        first; an adopted round takes the swarm's clock and applies the swarm's fragment.
        A skipped round keeps anchors and locals: the island's progress enters the next round.
        """
        s = self.state
        rnd = s.held
        assert rnd is not None and rnd.fragment == fragment, "apply without a matching send"
        self.worker_idle()
        start = time.perf_counter()
        result, applied, norm = self._island_result(rnd)
        s.held = None
        healed = s.install_heal(result.stats)
        flat, deltas = rnd.flat, rnd.deltas
        if result.adopted is not None:
            s.inner_steps = result.adopted.apply_step  # the swarm's clock
            fragment, flat = result.adopted.fragment, result.adopted_flat
            deltas = result.adopted_deltas
        alpha = s.schedule.merge_alpha if merge_alpha is None else merge_alpha
        if applied:
            self._step_and_merge(fragment, flat, deltas, alpha)
        if rnd.flat is not None and not rnd.exported:
            self._hold = rnd.flat
        del rnd.deltas, rnd.flat
        wall_s = rnd.send_blocked_s + time.perf_counter() - start
        report = self._report(fragment, result.stats, norm, applied, wall_s)
        return replace(report, healed=healed)

    def _step_and_merge(
        self, fragment: int, flat: Tensor | None, deltas: Mapping[str, Tensor], alpha: float
    ) -> None:
        """The outer step on the fragment's anchors, the merge, the gather, the counters.
        ``deltas`` are the averaged pseudo-gradients (views of ``flat`` if given)."""
        s = self.state
        names = s.owned_fragments[fragment]
        s.schedule_momentum(fragment)
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
        s.count_applied(fragment, alpha)

    def _island_result(self, rnd: RoundInFlight) -> tuple[Exchanged, bool, float]:
        """The exchange's result, whether the round applies, and its norm, island-wide.
        Sharded, every share agrees (``IslandShard.agree``) before any rank steps."""
        s = self.state
        if s.shard is None:
            result = rnd.wait()
            return result, result.stats.applied, result.norm
        error: Exception | None = rnd.error
        result = Exchanged(RoundStats(applied=False), 0.0)
        if error is None:
            try:
                result = rnd.wait()
            except Exception as err:
                error = err
        own_norm = 0.0 if result.combined else result.norm
        applied, norm = s.shard.agree(result.stats.applied, own_norm, error)
        return result, applied, result.norm if result.combined else norm


def _runs(bucket: Sequence[Piece]) -> tuple[int, ...]:
    return tuple(p.length for p in bucket)
