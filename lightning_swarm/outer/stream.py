"""A bucketed outer round that streams through the parameters' device, one bucket at a time.

``StreamRound.run`` does a whole plain outer round (no codec, no delay) for one fragment in a
single pass over the parameters: per bucket of the transport's size it forms the pseudo-
gradient ``anchor - local`` (float32) straight into a reused flat buffer, has the transport
average that buffer in place (``BucketMean.start_mean``), steps the outer optimizer on that bucket
with the functional SGD/Adam steps (``lightning_swarm.algorithm.outer_fast``), writes the new
anchors and optimizer state back and merges them into the parameters in place. No full-size
temporary exists; the sum of squares of the averaged pseudo-gradient is accumulated per bucket
in float32 for the report. Buckets are packed as the all-reduce packs them
(``lightning_swarm.outer.buckets``), so the result is bitwise that of ``OuterSync``'s two-phase
round (tests/test_outer_stream.py). Profiler labels: each bucket's phases run under
"swarm/pseudo_gradient", "swarm/exchange", "swarm/outer_step" and "swarm/merge", inside the
caller's "swarm/streamed_round".

Finiteness. A mean would carry one island's NaN into every island's anchors, and a bucket that
turns out non-finite after earlier buckets were stepped would leave a half-applied round. So
before any bucket moves, every island agrees whether its *locals* are finite
(``BucketMean.agree_finite``; a max-abs reduction, no copies). The anchors are finite by
construction, so the pseudo-gradients are too, barring an overflow of ``anchor - local`` beyond
3.4e38, which the averaged bucket's norm still reports (``pseudo_grad_norm`` becomes inf).

Devices. With parameters and anchors on the same device (``cpu``; this module) the anchors and
the state are stepped in place through views, and bucket k's all-reduce runs while bucket k - 1
is stepped and bucket k + 1 formed: two reused float32 buckets are the only extra memory. With
parameters on CUDA and anchors on the CPU, the buckets are staged through the GPU by
``lightning_swarm.outer.staging`` (pinned host memory, side-stream copies, two device slots).

Ownership: ``StreamRound`` owns its buffers for its whole life (the pseudo-gradient buckets and
the CUDA staging, allocated on the first round, reused by every later round, released by
``close``); the caller owns the parameters, anchors and optimizer, which ``run`` mutates in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_swarm.algorithm.fused import max_abs, sum_of_squares
from lightning_swarm.algorithm.outer_fast import FastKind, ensure_state, groups_by_param
from lightning_swarm.outer.buckets import (
    BucketJob,
    BucketMean,
    Segment,
    StreamResult,
    bucket_fill,
    plan_buckets,
)
from lightning_swarm.outer.staging import CudaStaging, state_allocator


class StreamRound:
    """Runs bucketed outer rounds; owns the reused buffers (see the module docstring)."""

    def __init__(self, bucket_numel: int, *, in_flight: int = 1) -> None:
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.bucket_numel = bucket_numel
        # CPU path: bucket all-reduces started and not yet waited for (gloo runs them on its
        # worker threads while this thread forms and steps the neighbouring buckets).
        self.in_flight = in_flight
        self._delta: Tensor | None = None
        self._staging = CudaStaging()

    def close(self) -> None:
        """Release the buffers (the next round allocates them again)."""
        self._delta, self._staging = None, CudaStaging()

    def buffer_bytes(self) -> int:
        """Bytes of the reused buffers currently held (pseudo-gradient bucket and slots)."""
        total = 0 if self._delta is None else self._delta.numel() * 4
        return total + self._staging.buffer_bytes()

    @torch.no_grad()
    def run(
        self,
        *,
        params: Sequence[Tensor],
        anchors: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        kind: FastKind,
        reducer: BucketMean,
        merge_alpha: float,
        seed: int,
    ) -> StreamResult:
        """One outer round over ``params`` (in place) and their ``anchors`` (see module doc)."""
        if len(params) != len(anchors):
            raise ValueError(f"{len(params)} parameters but {len(anchors)} anchors")
        device = params[0].device
        reducer.agree_finite(bool(torch.isfinite(max_abs(list(params))).item()))
        groups = groups_by_param(optimizer)
        on_cuda = device.type == "cuda" and anchors[0].device.type == "cpu"
        fresh = [
            ensure_state(optimizer, a, kind, groups[id(a)], state_allocator(on_cuda))
            for a in anchors
        ]
        if kind == "adam":
            for anchor in anchors:
                optimizer.state[anchor]["step"] += 1
        job = BucketJob(params, anchors, optimizer, kind, groups, fresh, merge_alpha, seed)
        plan = plan_buckets([p.numel() for p in params], self.bucket_numel)
        if on_cuda:
            return self._staging.run(
                job, plan, reducer, bucket_numel=self.bucket_numel, delta_buffer=self._delta_buffer
            )
        return self._run_local(job, plan, reducer)

    def _delta_buffer(self, numel: int, device: torch.device) -> Tensor:
        if self._delta is None or self._delta.device != device or self._delta.numel() < numel:
            self._delta = torch.empty(numel, dtype=torch.float32, device=device)
        return self._delta

    def _run_local(
        self, job: BucketJob, plan: list[list[Segment]], reducer: BucketMean
    ) -> StreamResult:
        """Anchors on the parameters' device: step anchor and state views in place.

        ``in_flight + 1`` pseudo-gradient buckets (2 by default): while bucket k is being
        averaged (asynchronously), bucket k - 1 is stepped and merged, and bucket k + 1 is
        formed. Buckets touch disjoint elements, so the order of these writes does not matter.
        (Two or three in flight measured no better on 2 cores: ``in_flight`` stays 1.)
        """
        numel = min(self.bucket_numel, job.total_numel)
        num_buffers = min(self.in_flight + 1, len(plan))
        deltas = self._delta_buffer(numel * num_buffers, job.device)
        sumsq = torch.zeros((), dtype=torch.float32, device=job.device)
        sent = 0
        pending: list[tuple[list[Segment], Tensor, Callable[[], int]]] = []
        for k, bucket in enumerate(plan):
            start = (k % num_buffers) * numel
            delta = deltas[start : start + bucket_fill(bucket)]
            job.form(bucket, delta, job.anchor_slice)
            pending.append((bucket, delta, job.start_reduce(reducer, delta)))
            if len(pending) > self.in_flight:
                sent += self._step_local(job, *pending.pop(0), sumsq)
        for item in pending:
            sent += self._step_local(job, *item, sumsq)
        return StreamResult(float(sumsq.sqrt().item()), sent, job.reduce_s)

    @staticmethod
    def _step_local(
        job: BucketJob,
        bucket: list[Segment],
        delta: Tensor,
        finish: Callable[[], int],
        sumsq: Tensor,
    ) -> int:
        """Wait for ``delta``'s mean, then step and merge its segments in place."""
        sent = job.finish_reduce(finish)
        sumsq += sum_of_squares(delta)
        job.step_and_merge(
            bucket,
            delta,
            job.anchor_slice,
            lambda seg: [s.view(-1)[seg.start : seg.stop] for s in job.state(seg)],
        )
        return sent
