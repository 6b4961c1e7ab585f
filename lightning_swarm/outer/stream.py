"""A bucketed outer round that streams through the parameters' device, one bucket at a time.

``StreamRound.run`` does a whole plain outer round (no codec, no delay) for one fragment in a
single pass over the parameters: per bucket of the transport's size it forms the pseudo-
gradient ``anchor - local`` (float32) straight into a reused flat buffer, has the transport
average that buffer in place (``BucketMean.start_mean``), steps the outer optimizer on that bucket
with the functional SGD/Adam steps (``lightning_swarm.algorithm.outer_fast``), writes the new
anchors and optimizer state back and merges them into the parameters in place. No full-size
temporary exists; the sum of squares of the averaged pseudo-gradient is accumulated per bucket
in float32 for the report.

Buckets are packed exactly as ``AllReduceTransport`` packs them (tensors in order, split across
bucket boundaries), so the all-reduce sums the same elements in the same order and the result is
bitwise that of ``OuterSync``'s two-phase round (tests/test_outer_stream.py).

Finiteness. A mean would carry one island's NaN into every island's anchors, and a bucket that
turns out non-finite after earlier buckets were stepped would leave a half-applied round. So
before any bucket moves, every island agrees whether its *locals* are finite
(``BucketMean.agree_finite``; a max-abs reduction, no copies). The anchors are finite by
construction, so the pseudo-gradients are too, barring an overflow of ``anchor - local`` beyond
3.4e38, which the averaged bucket's norm still reports (``pseudo_grad_norm`` becomes inf).

Devices. With parameters and anchors on the same device (``cpu``) the anchors and the state are
stepped in place through views, and bucket k's all-reduce runs while bucket k - 1 is stepped
and bucket k + 1 formed: two reused float32 buckets are the only extra memory. With
parameters on CUDA and anchors on the CPU, the anchors and the outer state are moved once into
pinned host memory (``pin_round_memory``, the first time such a round runs; mapped anchors
therefore stay file-backed until then) and each bucket's anchors and state are copied in on one
side stream, computed on the current stream (where NCCL reduces), and copied out on another side
stream, with two sets of device buffers so that the copies of the neighbouring buckets overlap
the compute. Extra GPU memory: two slots of (anchor, state, pseudo-gradient) buckets plus the
step's bucket-sized temporaries, whatever the model size.

Ownership: ``StreamRound`` owns its buffers for its whole life (allocated on the first round,
reused by every later round, released by ``close``); the caller owns the parameters, anchors and
optimizer, which ``run`` mutates in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_swarm.algorithm.fused import max_abs, pseudo_gradient_into, sum_of_squares
from lightning_swarm.algorithm.outer_fast import (
    FastKind,
    adam_step_,
    ensure_state,
    groups_by_param,
    sgd_step_,
)
from lightning_swarm.algorithm.precision import stochastic_round_to_bf16


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
class Segment:
    """Elements ``[start, stop)`` of tensor ``index`` at ``offset`` in its bucket."""

    index: int
    start: int
    stop: int
    offset: int


def plan_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[Segment]]:
    """Pack tensors of ``numels`` into buckets of ``bucket_numel`` in order, splitting them."""
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    buckets: list[list[Segment]] = [[]]
    fill = 0
    for index, numel in enumerate(numels):
        pos = 0
        while pos < numel:
            if fill == bucket_numel:
                buckets.append([])
                fill = 0
            n = min(numel - pos, bucket_numel - fill)
            buckets[-1].append(Segment(index, pos, pos + n, fill))
            pos += n
            fill += n
    return [b for b in buckets if b]


@dataclass(frozen=True)
class StreamResult:
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


def pin_round_memory(optimizer: torch.optim.Optimizer, anchors: dict[str, Tensor]) -> None:
    """Move ``anchors`` (in place in the dict) and their float state into pinned host memory.

    The optimizer keeps working on the same values: its parameter references and state keys are
    switched to the pinned anchors. Idempotent; a no-op where CUDA is unavailable.
    """
    if not torch.cuda.is_available():
        return
    swapped: dict[int, Tensor] = {}
    for name, anchor in anchors.items():
        if anchor.device.type == "cpu" and not anchor.is_pinned():
            pinned = anchor.pin_memory()
            swapped[id(anchor)] = pinned
            if anchor in optimizer.state:
                optimizer.state[pinned] = optimizer.state.pop(anchor)
            anchors[name] = pinned
    for group in optimizer.param_groups:
        group["params"] = [swapped.get(id(p), p) for p in group["params"]]
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" or not isinstance(value, Tensor):
                continue
            if value.device.type == "cpu" and not value.is_pinned():
                state[key] = value.pin_memory()


class _Slot:
    """One set of device buffers for a bucket in flight (CUDA path), with its stream events."""

    def __init__(self, numel: int, anchor_dtype: torch.dtype, num_state: int, device: Any) -> None:
        self.anchor = torch.empty(numel, dtype=anchor_dtype, device=device)
        self.state = [torch.empty(numel, device=device) for _ in range(num_state)]
        self.loaded = torch.cuda.Event()
        self.computed = torch.cuda.Event()
        self.free = torch.cuda.Event()
        self.free.record()


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
        self._slots: list[_Slot] = []
        self._streams: tuple[Any, Any] | None = None

    def close(self) -> None:
        """Release the buffers (the next round allocates them again)."""
        self._delta, self._slots, self._streams = None, [], None

    def buffer_bytes(self) -> int:
        """Bytes of the reused buffers currently held (pseudo-gradient bucket and slots)."""
        total = 0 if self._delta is None else self._delta.numel() * 4
        for slot in self._slots:
            total += slot.anchor.numel() * slot.anchor.element_size() + sum(
                s.numel() * 4 for s in slot.state
            )
        return total

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
            ensure_state(optimizer, a, kind, groups[id(a)], self._allocator(on_cuda))
            for a in anchors
        ]
        if kind == "adam":
            for anchor in anchors:
                optimizer.state[anchor]["step"] += 1
        job = _Job(params, anchors, optimizer, kind, groups, fresh, merge_alpha, seed)
        plan = plan_buckets([p.numel() for p in params], self.bucket_numel)
        if on_cuda:
            return self._run_cuda(job, plan, reducer)
        return self._run_local(job, plan, reducer)

    @staticmethod
    def _allocator(pinned: bool) -> Any:
        def allocate(anchor: Tensor) -> Tensor:
            if pinned:
                return torch.empty(anchor.shape, dtype=torch.float32, pin_memory=True)
            return torch.empty(anchor.shape, dtype=torch.float32, device=anchor.device)

        return allocate

    def _delta_buffer(self, numel: int, device: torch.device) -> Tensor:
        if self._delta is None or self._delta.device != device or self._delta.numel() < numel:
            self._delta = torch.empty(numel, dtype=torch.float32, device=device)
        return self._delta

    def _run_local(self, job: _Job, plan: list[list[Segment]], reducer: BucketMean) -> StreamResult:
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
            delta = deltas[start : start + bucket[-1].offset + bucket[-1].stop - bucket[-1].start]
            for seg in bucket:
                pseudo_gradient_into(
                    job.anchor_slice(seg), job.param_slice(seg), job.cut(delta, seg)
                )
            pending.append((bucket, delta, job.start_reduce(reducer, delta)))
            if len(pending) > self.in_flight:
                sent += self._step_local(job, *pending.pop(0), sumsq)
        for item in pending:
            sent += self._step_local(job, *item, sumsq)
        return StreamResult(float(sumsq.sqrt().item()), sent, job.reduce_s)

    @staticmethod
    def _step_local(
        job: _Job,
        bucket: list[Segment],
        delta: Tensor,
        finish: Callable[[], int],
        sumsq: Tensor,
    ) -> int:
        """Wait for ``delta``'s mean, then step and merge its segments in place."""
        sent = job.finish_reduce(finish)
        sumsq += sum_of_squares(delta)
        for seg in bucket:
            anchor = job.anchor_slice(seg)
            state = [s.view(-1)[seg.start : seg.stop] for s in job.state(seg)]
            job.step(anchor, job.cut(delta, seg), state, seg)
            job.merge(job.param_slice(seg), anchor)
        return sent

    def _slots_for(self, job: _Job) -> list[_Slot]:
        numel = min(self.bucket_numel, job.total_numel)
        num_state = max(len(states) for states in job.states_per_tensor)
        anchor_dtype = job.anchors[0].dtype
        if not self._slots or self._slots[0].anchor.numel() < numel:
            self._slots = [_Slot(numel, anchor_dtype, num_state, job.device) for _ in range(2)]
        if self._streams is None:
            self._streams = (torch.cuda.Stream(job.device), torch.cuda.Stream(job.device))
        return self._slots

    def _run_cuda(self, job: _Job, plan: list[list[Segment]], reducer: BucketMean) -> StreamResult:
        """Parameters on CUDA, pinned anchors and state on the CPU: copy in, step, copy out."""
        if any(a.dtype != job.anchors[0].dtype for a in job.anchors):
            raise ValueError("a streamed round needs all anchors of one dtype")
        slots = self._slots_for(job)
        assert self._streams is not None
        copy_in, copy_out = self._streams
        compute = torch.cuda.current_stream(job.device)
        delta_all = self._delta_buffer(slots[0].anchor.numel(), job.device)
        sumsq = torch.zeros((), dtype=torch.float32, device=job.device)
        sent = 0
        self._copy_in(job, plan[0], slots[0], copy_in)
        for k, bucket in enumerate(plan):
            slot = slots[k % 2]
            if k + 1 < len(plan):  # prefetch the next bucket while this one computes
                self._copy_in(job, plan[k + 1], slots[(k + 1) % 2], copy_in)
            compute.wait_event(slot.loaded)
            fill = bucket[-1].offset + bucket[-1].stop - bucket[-1].start
            delta = delta_all[:fill]
            for seg in bucket:
                pseudo_gradient_into(
                    job.cut(slot.anchor, seg), job.param_slice(seg), job.cut(delta, seg)
                )
            sent += job.reduce(reducer, delta)
            sumsq += sum_of_squares(delta)
            for seg in bucket:
                anchor = job.cut(slot.anchor, seg)
                job.step(anchor, job.cut(delta, seg), [job.cut(s, seg) for s in slot.state], seg)
                job.merge(job.param_slice(seg), anchor)
            slot.computed.record(compute)
            with torch.cuda.stream(copy_out):
                copy_out.wait_event(slot.computed)
                for seg in bucket:
                    job.anchor_slice(seg).copy_(job.cut(slot.anchor, seg), non_blocking=True)
                    for host, dev in zip(job.state(seg), slot.state, strict=False):
                        host.view(-1)[seg.start : seg.stop].copy_(
                            job.cut(dev, seg), non_blocking=True
                        )
                slot.free.record(copy_out)
        copy_out.synchronize()  # the host anchors and state are complete when run returns
        return StreamResult(float(sumsq.sqrt().item()), sent, job.reduce_s)

    @staticmethod
    def _copy_in(job: _Job, bucket: list[Segment], slot: _Slot, stream: Any) -> None:
        with torch.cuda.stream(stream):
            stream.wait_event(slot.free)  # the slot's previous bucket has been copied out
            for seg in bucket:
                job.cut(slot.anchor, seg).copy_(job.anchor_slice(seg), non_blocking=True)
                for dev, host in zip(slot.state, job.state(seg), strict=False):
                    job.cut(dev, seg).copy_(host.view(-1)[seg.start : seg.stop], non_blocking=True)
            slot.loaded.record(stream)


class _Job:
    """One round's tensors and options, with the per-segment helpers of both device paths."""

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
        # Stochastic rounding of bf16 anchors draws its noise per segment, in order, from one
        # generator seeded like OuterSync's: on the CPU that is the same stream of numbers as
        # drawing per whole tensor, so the result is bitwise the slow path's.
        self._seed = seed
        self._generator: torch.Generator | None = None
        self.reduce_s = 0.0

    def reduce(self, reducer: BucketMean, flat: Tensor) -> int:
        return self.finish_reduce(self.start_reduce(reducer, flat))

    def start_reduce(self, reducer: BucketMean, flat: Tensor) -> Callable[[], int]:
        start = time.perf_counter()
        finish = reducer.start_mean(flat)
        self.reduce_s += time.perf_counter() - start
        return finish

    def finish_reduce(self, finish: Callable[[], int]) -> int:
        start = time.perf_counter()
        sent = finish()
        self.reduce_s += time.perf_counter() - start
        return sent

    def param_slice(self, seg: Segment) -> Tensor:
        return self.params[seg.index].data.view(-1)[seg.start : seg.stop]

    def anchor_slice(self, seg: Segment) -> Tensor:
        return self.anchors[seg.index].view(-1)[seg.start : seg.stop]

    @staticmethod
    def cut(flat: Tensor, seg: Segment) -> Tensor:
        return flat[seg.offset : seg.offset + seg.stop - seg.start]

    def state(self, seg: Segment) -> list[Tensor]:
        return self.states_per_tensor[seg.index]

    def step(self, anchor: Tensor, grad: Tensor, state: list[Tensor], seg: Segment) -> None:
        """The functional outer step on one segment (float32 work copy for low precision)."""
        work = anchor if anchor.dtype == torch.float32 else anchor.to(torch.float32)
        group = self.groups[id(self.anchors[seg.index])]
        if self.kind == "sgd":
            buf = state[0] if state else None
            sgd_step_(work, grad, buf, group, fresh=self.fresh[seg.index])
        else:
            step = float(self.optimizer.state[self.anchors[seg.index]]["step"].item())
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
