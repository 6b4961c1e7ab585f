"""A bucketed outer round that streams through the parameters' device, one bucket at a time.

``BucketedRound.run`` does a whole plain outer round (no codec, no delay) for one fragment in a
single pass over the parameters: per bucket of the transport's size it forms the pseudo-
gradient ``anchor - local`` (float32) straight into a reused flat buffer, has the transport
average that buffer in place (``BucketMean.start_mean``), steps the outer optimizer on that bucket
with the functional SGD/Adam steps (``lightning_swarm.algorithm.outer_fast``), writes the new
anchors and optimizer state back and merges them into the parameters in place. No full-size
temporary exists; the sum of squares of the averaged pseudo-gradient is accumulated per bucket
in float32 for the report.

Buckets are packed by the one packer the transports use (``transport.buckets.plan_buckets``:
tensors in order, split across bucket boundaries), so the all-reduce sums the same elements in
the same order and the result is bitwise that of ``OuterSync``'s two-phase round
(tests/test_outer_stream.py). ``BucketJob`` holds the per-piece work both device paths share;
each bucket's phases run under the two-phase round's profiler labels ("swarm/pseudo_gradient",
"swarm/exchange", "swarm/outer_step", "swarm/merge"), inside the caller's
"swarm/streamed_round". Buckets touch disjoint elements, so the order in which a bucket's
pieces are stepped or merged does not change a bit.

Finiteness. A mean would carry one island's NaN into every island's anchors, and a bucket that
turns out non-finite after earlier buckets were stepped would leave a half-applied round. So
before any bucket moves, every island agrees whether its *locals* are finite
(``BucketMean.agree_finite``; a max-abs reduction, no copies). The anchors are finite by
construction, so the pseudo-gradients are too, barring an overflow of ``anchor - local`` beyond
3.4e38, which the averaged bucket's norm still reports (``pseudo_grad_norm`` becomes inf).

Devices. With parameters and anchors on the same device (``cpu``; this module) the anchors and
the state are stepped in place through views, and bucket k's all-reduce runs while bucket k - 1
is stepped and bucket k + 1 formed: two reused float32 buckets are the only extra memory. With
parameters on CUDA and anchors on the CPU, the buckets are staged through the GPU by the
``Staging`` the caller hands in (``lightning_swarm.outer.staging.CudaStaging``: pinned host
memory, side-stream copies, two device slots), which imports this module, not the reverse. That
path stages buckets smaller than the transport's so that its GPU working set stays within three
transport buckets (``Staging.bucket_numel_for``).

Ownership: ``BucketedRound`` owns its buffers for its whole life (the pseudo-gradient buckets and
its staging's slots, allocated on the first round, reused by every later round, released by
``close``); the caller owns the parameters, anchors and optimizer, which ``run`` mutates in place.
A ``BucketJob`` lives for one ``run``: it writes the caller's tensors in place and owns only its
bf16 rounding generator and its timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.fused import (
    max_abs,
    pseudo_gradient_into,
    sum_of_squares,
)
from lightning_swarm.algorithm.outer_fast import (
    FastKind,
    adam_step_,
    ensure_state,
    groups_by_param,
    sgd_step_,
)
from lightning_swarm.algorithm.precision import stochastic_round_to_bf16
from lightning_swarm.transport.buckets import Piece, numel_of, placed, plan_buckets


@runtime_checkable
class BucketMean(Protocol):
    """What the stream needs from a transport: a finiteness vote and an in-place bucket mean.

    ``bucket_numel`` is the transport's bucket size: the stream packs its buckets the same way.
    """

    bucket_numel: int

    def agree_finite(self, local_finite: bool) -> None:
        """Raise ``NonFinitePseudoGradientError`` on every rank if any island is not finite."""
        ...

    def start_mean(self, flat: Tensor) -> Callable[[], int]:
        """Start averaging the flat float32 ``flat`` across islands in place; the returned
        call waits for it, completes the mean and returns the bytes sent."""
        ...


@dataclass(frozen=True)
class BucketedResult:
    """A streamed round: the averaged pseudo-gradient's norm, bytes sent (= received) and the
    host time spent starting and waiting for the bucket means (on the CPU path they overlap
    the neighbouring buckets' work, so this is the time the round was blocked on them)."""

    norm: float
    bytes_sent: int
    reduce_s: float = 0.0


STATE_KEYS: dict[FastKind, tuple[str, ...]] = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
}


def state_tensors(optimizer: torch.optim.Optimizer, anchor: Tensor, kind: FastKind) -> list[Tensor]:
    """The anchor's state tensors the functional step reads and writes, in ``STATE_KEYS`` order."""
    state = optimizer.state.get(anchor, {})
    return [state[key] for key in STATE_KEYS[kind] if state.get(key) is not None]


# A piece's slice of a bucket-sized buffer, from its offset in the bucket and the piece.
PieceView = Callable[[int, Piece], Tensor]
StateView = Callable[[int, Piece], list[Tensor]]


class BucketJob:
    """One round's tensors and options, with the per-piece helpers of both device paths."""

    def __init__(
        self,
        params: Sequence[Tensor],
        anchors: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        kind: FastKind,
        groups: dict[int, dict[str, Any]],
        fresh: list[bool],
        merge_alpha: float,
        seed: int,
    ) -> None:
        if not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge alpha must lie in [0, 1], got {merge_alpha}")
        self.params, self.anchors, self.optimizer = params, anchors, optimizer
        self.kind, self.groups, self.fresh = kind, groups, fresh
        self.merge_alpha = merge_alpha
        self.device = params[0].device
        self.total_numel = sum(p.numel() for p in params)
        self.states_per_tensor = [state_tensors(optimizer, a, kind) for a in anchors]
        # Stochastic rounding of bf16 anchors draws its noise per piece, in order, from one
        # generator seeded like OuterSync's: on the CPU that is the same stream of numbers as
        # drawing per whole tensor, so the result is bitwise the slow path's.
        self._seed = seed
        self._generator: torch.Generator | None = None
        self.reduce_s = 0.0

    def form(self, bucket: list[Piece], delta: Tensor, anchor_of: PieceView) -> None:
        """Write the bucket's pseudo-gradients ``anchor - local`` (float32) into ``delta``."""
        with record_function(labels.PSEUDO_GRADIENT):
            for at, p in placed(bucket):
                pseudo_gradient_into(anchor_of(at, p), self.param_slice(p), self.cut(delta, at, p))

    def reduce(self, reducer: BucketMean, flat: Tensor) -> int:
        return self.finish_reduce(self.start_reduce(reducer, flat))

    def start_reduce(self, reducer: BucketMean, flat: Tensor) -> Callable[[], int]:
        start = time.perf_counter()
        with record_function(labels.EXCHANGE):
            finish = reducer.start_mean(flat)
        self.reduce_s += time.perf_counter() - start
        return finish

    def finish_reduce(self, finish: Callable[[], int]) -> int:
        start = time.perf_counter()
        with record_function(labels.EXCHANGE):
            sent = finish()
        self.reduce_s += time.perf_counter() - start
        return sent

    def step_and_merge(
        self, bucket: list[Piece], delta: Tensor, anchor_of: PieceView, state_of: StateView
    ) -> None:
        """Step the bucket's anchor pieces with its averaged ``delta`` (which the step uses
        as scratch), then merge the new anchors into the parameters."""
        with record_function(labels.OUTER_STEP):
            for at, p in placed(bucket):
                self.step(anchor_of(at, p), self.cut(delta, at, p), state_of(at, p), p)
        with record_function(labels.MERGE):
            for at, p in placed(bucket):
                self.merge(self.param_slice(p), anchor_of(at, p))

    def param_slice(self, p: Piece) -> Tensor:
        return self.params[p.tensor_index].data.view(-1)[p.start : p.stop]

    def anchor_slice(self, p: Piece) -> Tensor:
        return self.anchors[p.tensor_index].view(-1)[p.start : p.stop]

    def anchor_at(self, at: int, p: Piece) -> Tensor:
        """``anchor_slice`` as a ``PieceView`` (anchors stepped in place, not staged)."""
        return self.anchor_slice(p)

    @staticmethod
    def cut(flat: Tensor, at: int, p: Piece) -> Tensor:
        """The piece's slice of the bucket-sized buffer ``flat``, at its offset ``at``."""
        return flat[at : at + p.length]

    def state(self, p: Piece) -> list[Tensor]:
        return self.states_per_tensor[p.tensor_index]

    def step(self, anchor: Tensor, grad: Tensor, state: list[Tensor], p: Piece) -> None:
        """The functional outer step on one piece (float32 work copy for low precision)."""
        work = anchor if anchor.dtype == torch.float32 else anchor.to(torch.float32)
        group = self.groups[id(self.anchors[p.tensor_index])]
        if self.kind == "sgd":
            buf = state[0] if state else None
            sgd_step_(work, grad, buf, group, fresh=self.fresh[p.tensor_index])
        else:
            step = float(self.optimizer.state[self.anchors[p.tensor_index]]["step"].item())
            adam_step_(work, grad, state[0], state[1], group, step=step)
        if work is anchor:
            return
        if anchor.dtype == torch.bfloat16:
            if self._generator is None:
                self._generator = torch.Generator(device=anchor.device).manual_seed(self._seed)
            anchor.copy_(stochastic_round_to_bf16(work, self._generator))
        else:
            anchor.copy_(work)

    def merge(self, local: Tensor, anchor: Tensor) -> None:
        incoming = anchor.to(dtype=local.dtype)
        if self.merge_alpha == 0.0:
            local.copy_(incoming)
        else:
            local.lerp_(incoming, 1.0 - self.merge_alpha)


class Staging(Protocol):
    """The CUDA path of a round whose parameters are on the GPU and anchors in host memory
    (``lightning_swarm.outer.staging.CudaStaging``); it owns its device buffers."""

    def allocate_state(self, anchor: Tensor) -> Tensor:
        """A fresh float32 outer state tensor for ``anchor``, in memory the path can stage."""
        ...

    def run(
        self, job: BucketJob, plan: list[list[Piece]], reducer: BucketMean, delta: Tensor
    ) -> BucketedResult:
        """The whole round, bucket by bucket, forming each bucket's pseudo-gradient in the
        flat float32 ``delta`` (at least one bucket); the host anchors and state are complete
        when it returns."""
        ...

    def bucket_numel_for(self, job: BucketJob, bucket_numel: int) -> int:
        """The bucket this path stages for ``job`` (at most ``bucket_numel``), sized so that
        its device working set stays within its memory budget."""
        ...

    def buffer_bytes(self) -> int: ...

    def close(self) -> None: ...


def _state_beside(anchor: Tensor) -> Tensor:
    return torch.empty(anchor.shape, dtype=torch.float32, device=anchor.device)


class BucketedRound:
    """Runs bucketed outer rounds; owns the reused buffers (see the module docstring)."""

    def __init__(
        self, bucket_numel: int, *, in_flight: int = 1, staging: Staging | None = None
    ) -> None:
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.bucket_numel = bucket_numel
        # CPU path: bucket all-reduces started and not yet waited for (gloo runs them on its
        # worker threads while this thread forms and steps the neighbouring buckets).
        self.in_flight = in_flight
        self._delta: Tensor | None = None
        # The CUDA path (parameters on the GPU, anchors in host memory); None: CPU rounds only.
        self._staging = staging

    def close(self) -> None:
        """Release the buffers (the next round allocates them again)."""
        self._delta = None
        if self._staging is not None:
            self._staging.close()

    def buffer_bytes(self) -> int:
        """Bytes of the reused buffers currently held (pseudo-gradient bucket and slots)."""
        total = 0 if self._delta is None else self._delta.numel() * 4
        return total + (0 if self._staging is None else self._staging.buffer_bytes())

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
    ) -> BucketedResult:
        """One outer round over ``params`` (in place) and their ``anchors`` (see module doc)."""
        if len(params) != len(anchors):
            raise ValueError(f"{len(params)} parameters but {len(anchors)} anchors")
        device = params[0].device
        reducer.agree_finite(bool(torch.isfinite(max_abs(list(params))).item()))
        groups = groups_by_param(optimizer)
        on_cuda = device.type == "cuda" and anchors[0].device.type == "cpu"
        if on_cuda and self._staging is None:
            raise ValueError(
                "parameters on CUDA with anchors in host memory need a staging path: build "
                "BucketedRound(..., staging=CudaStaging()) (lightning_swarm.outer.staging)."
            )
        allocate = self._staging.allocate_state if on_cuda and self._staging else _state_beside
        fresh = [ensure_state(optimizer, a, kind, groups[id(a)], allocate) for a in anchors]
        if kind == "adam":
            for anchor in anchors:
                optimizer.state[anchor]["step"] += 1
        job = BucketJob(params, anchors, optimizer, kind, groups, fresh, merge_alpha, seed)
        numels = [p.numel() for p in params]
        if on_cuda:
            assert self._staging is not None
            staged = self._staging.bucket_numel_for(job, self.bucket_numel)
            plan = plan_buckets(numels, staged)
            delta = self._delta_buffer(numel_of(plan[0]), job.device)
            return self._staging.run(job, plan, reducer, delta)
        return self._run_local(job, plan_buckets(numels, self.bucket_numel), reducer)

    def _delta_buffer(self, numel: int, device: torch.device) -> Tensor:
        if self._delta is None or self._delta.device != device or self._delta.numel() < numel:
            self._delta = torch.empty(numel, dtype=torch.float32, device=device)
        return self._delta

    def _run_local(
        self, job: BucketJob, plan: list[list[Piece]], reducer: BucketMean
    ) -> BucketedResult:
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
        pending: list[tuple[list[Piece], Tensor, Callable[[], int]]] = []
        for k, bucket in enumerate(plan):
            start = (k % num_buffers) * numel
            delta = deltas[start : start + numel_of(bucket)]
            job.form(bucket, delta, job.anchor_at)
            pending.append((bucket, delta, job.start_reduce(reducer, delta)))
            if len(pending) > self.in_flight:
                sent += self._step_local(job, *pending.pop(0), sumsq)
        for item in pending:
            sent += self._step_local(job, *item, sumsq)
        return BucketedResult(float(sumsq.sqrt().item()), sent, job.reduce_s)

    @staticmethod
    def _step_local(
        job: BucketJob,
        bucket: list[Piece],
        delta: Tensor,
        finish: Callable[[], int],
        sumsq: Tensor,
    ) -> int:
        """Wait for ``delta``'s mean, then step and merge its pieces in place."""
        sent = job.finish_reduce(finish)
        sumsq += sum_of_squares(delta)
        job.step_and_merge(
            bucket,
            delta,
            job.anchor_at,
            lambda at, p: [s.view(-1)[p.start : p.stop] for s in job.state(p)],
        )
        return sent
