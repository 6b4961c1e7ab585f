"""The streamed round's shared vocabulary: how tensors pack into buckets, and one round's job.

A streamed round (``lightning_swarm.outer.stream``) walks a fragment's tensors in buckets of
the transport's size. ``plan_buckets`` packs them exactly as ``AllReduceTransport`` does
(tensors in order, split across bucket boundaries), so that the all-reduce sums the same
elements in the same order as the two-phase round. ``BucketJob`` carries one round's tensors
and options with the per-segment work that both device paths share: forming a bucket's
pseudo-gradient, starting and finishing its mean, the functional outer step and the merge,
each phase under its profiler label ("swarm/pseudo_gradient", "swarm/exchange",
"swarm/outer_step", "swarm/merge", as in the two-phase round), taken once per bucket.

Ownership: a ``BucketJob`` lives for one ``StreamRound.run``; it holds references to the
caller's parameters, anchors and optimizer state and writes them in place, and owns only its
bf16 rounding generator and its timing. The flat bucket buffers it is handed belong to the
device path (``stream.py`` on the CPU, ``staging.py`` on CUDA). Buckets touch disjoint
elements, so the order in which a bucket's segments are stepped or merged does not change a bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.profiler import record_function

from lightning_swarm.algorithm.fused import pseudo_gradient_into
from lightning_swarm.algorithm.outer_fast import FastKind, adam_step_, sgd_step_
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


def bucket_fill(bucket: list[Segment]) -> int:
    """Elements used in ``bucket`` (its last segment's end)."""
    return bucket[-1].offset + bucket[-1].stop - bucket[-1].start


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


SegmentView = Callable[[Segment], Tensor]
StateView = Callable[[Segment], list[Tensor]]


class BucketJob:
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

    def form(self, bucket: list[Segment], delta: Tensor, anchor_of: SegmentView) -> None:
        """Write the bucket's pseudo-gradients ``anchor - local`` (float32) into ``delta``."""
        with record_function("swarm/pseudo_gradient"):
            for seg in bucket:
                pseudo_gradient_into(anchor_of(seg), self.param_slice(seg), self.cut(delta, seg))

    def reduce(self, reducer: BucketMean, flat: Tensor) -> int:
        return self.finish_reduce(self.start_reduce(reducer, flat))

    def start_reduce(self, reducer: BucketMean, flat: Tensor) -> Callable[[], int]:
        start = time.perf_counter()
        with record_function("swarm/exchange"):
            finish = reducer.start_mean(flat)
        self.reduce_s += time.perf_counter() - start
        return finish

    def finish_reduce(self, finish: Callable[[], int]) -> int:
        start = time.perf_counter()
        with record_function("swarm/exchange"):
            sent = finish()
        self.reduce_s += time.perf_counter() - start
        return sent

    def step_and_merge(
        self, bucket: list[Segment], delta: Tensor, anchor_of: SegmentView, state_of: StateView
    ) -> None:
        """Step the bucket's anchor segments with its averaged ``delta`` (which the step uses
        as scratch), then merge the new anchors into the parameters."""
        with record_function("swarm/outer_step"):
            for seg in bucket:
                self.step(anchor_of(seg), self.cut(delta, seg), state_of(seg), seg)
        with record_function("swarm/merge"):
            for seg in bucket:
                self.merge(self.param_slice(seg), anchor_of(seg))

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
