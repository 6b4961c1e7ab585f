"""The streamed round's CUDA path: parameters on the GPU, anchors and outer state in host memory.

``CudaStaging.run`` copies bucket k + 1 in on a side stream while bucket k is computed and k out
on another; two slots alternate, ordered by CUDA events. It owns its slots and streams for life;
host anchors and state are complete when ``run`` returns. Extra GPU memory stays within
``BUDGET_BUCKETS`` transport buckets (``docs/performance.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.diloco import sum_of_squares
from lightning_swarm.outer.bucket_step import BucketJob, Exchange
from lightning_swarm.outer.sync_state import Exchanged
from lightning_swarm.transport.buckets import Piece, numel_of, placed

BUDGET_BUCKETS = 3  # the staged round's GPU working set, in transport buckets of float32


def device_bytes_per_element(
    anchor_dtype: torch.dtype, param_dtype: torch.dtype, num_state: int, maximize: bool
) -> int:
    """Device bytes the staged round holds per element of its bucket, at its peak: two slots
    of anchors and float32 state, the float32 pseudo-gradient, plus the larger of the step's
    temporaries and the merge's (one after the other on one stream, so their blocks are reused).
    """
    anchor = torch.empty((), dtype=anchor_dtype).element_size()
    step = 0
    if anchor_dtype != torch.float32:
        step += 4
        if anchor_dtype == torch.bfloat16:
            step += 4 + 2
    if maximize:
        step += 4
    merge = torch.empty((), dtype=param_dtype).element_size() if param_dtype != anchor_dtype else 0
    return 2 * (anchor + 4 * num_state) + 4 + max(step, merge)


def staged_bucket_numel(bucket_numel: int, bytes_per_element: int) -> int:
    """The largest staged bucket whose working set fits ``BUDGET_BUCKETS`` float32 buckets."""
    if bucket_numel < 1 or bytes_per_element < 1:
        raise ValueError(
            f"bucket_numel and bytes_per_element must be >= 1, got {bucket_numel}, "
            f"{bytes_per_element}"
        )
    return max(1, min(bucket_numel, BUDGET_BUCKETS * 4 * bucket_numel // bytes_per_element))


def pin_round_memory(optimizer: torch.optim.Optimizer, anchors: dict[str, Tensor]) -> None:
    """Move ``anchors`` (in place in the dict) and their float state into pinned host memory,
    switching the optimizer's references to them. Idempotent; a no-op without CUDA."""
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


class Slot:
    def __init__(self, numel: int, anchor_dtype: torch.dtype, num_state: int, device: Any) -> None:
        self.anchor = torch.empty(numel, dtype=anchor_dtype, device=device)
        self.state = [torch.empty(numel, device=device) for _ in range(num_state)]
        self.loaded = torch.cuda.Event()
        self.computed = torch.cuda.Event()
        self.free = torch.cuda.Event()
        self.free.record()

    def nbytes(self) -> int:
        return self.anchor.numel() * self.anchor.element_size() + sum(
            s.numel() * 4 for s in self.state
        )


class CudaStaging:
    """Two device slots and two side streams, reused by every round (see the module doc)."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self.streams: tuple[Any, Any] | None = None

    def buffer_bytes(self) -> int:
        return sum(slot.nbytes() for slot in self.slots)

    @staticmethod
    def allocate_state(anchor: Tensor) -> Tensor:
        return torch.empty(anchor.shape, dtype=torch.float32, pin_memory=True)

    @staticmethod
    def bucket_numel_for(job: BucketJob, bucket_numel: int) -> int:
        num_state = max(len(states) for states in job.states_per_tensor)
        widest = max(job.params, key=lambda p: p.element_size())
        maximize = any(group.get("maximize", False) for group in job.groups.values())
        per_element = device_bytes_per_element(
            job.anchors[0].dtype, widest.dtype, num_state, maximize
        )
        return staged_bucket_numel(bucket_numel, per_element)

    def run(
        self, job: BucketJob, plan: list[list[Piece]], exchange: Exchange, delta: Tensor
    ) -> Exchanged:
        if any(a.dtype != job.anchors[0].dtype for a in job.anchors):
            raise ValueError("a streamed round needs all anchors of one dtype")
        numel = numel_of(plan[0])  # a full bucket, or all elements
        if not self.slots or self.slots[0].anchor.numel() < numel:
            num_state = max(len(states) for states in job.states_per_tensor)
            self.slots = [
                Slot(numel, job.anchors[0].dtype, num_state, job.device) for _ in range(2)
            ]
        if self.streams is None:
            self.streams = (torch.cuda.Stream(job.device), torch.cuda.Stream(job.device))
        slots = self.slots
        copy_in, copy_out = self.streams
        compute = torch.cuda.current_stream(job.device)
        sumsq = torch.zeros((), dtype=torch.float32, device=job.device)
        sent = 0
        self._copy_in(job, plan[0], slots[0], copy_in)
        for k, bucket in enumerate(plan):
            slot = slots[k % 2]
            if k + 1 < len(plan):  # prefetch the next bucket while this one computes
                self._copy_in(job, plan[k + 1], slots[(k + 1) % 2], copy_in)
            compute.wait_event(slot.loaded)
            bucket_delta = delta[: numel_of(bucket)]
            sent += self._compute(job, bucket, slot, bucket_delta, exchange, sumsq)
            slot.computed.record(compute)
            self._copy_out(job, bucket, slot, copy_out)
        copy_out.synchronize()  # the host anchors and state are complete when run returns
        return Exchanged.streamed(sumsq, sent)

    @staticmethod
    def _compute(
        job: BucketJob,
        bucket: list[Piece],
        slot: Slot,
        delta: Tensor,
        exchange: Exchange,
        sumsq: Tensor,
    ) -> int:
        def anchor_of(at: int, p: Piece) -> Tensor:
            return job.cut(slot.anchor, at, p)

        def state_of(at: int, p: Piece) -> list[Tensor]:
            return [job.cut(t, at, p) for t in slot.state]

        job.form(bucket, delta, anchor_of)
        sent = exchange(delta, bucket)
        sumsq += sum_of_squares(delta)
        job.step_and_merge(bucket, delta, anchor_of, state_of)
        return sent

    @staticmethod
    def _copy_in(job: BucketJob, bucket: list[Piece], slot: Slot, stream: Any) -> None:
        with torch.cuda.stream(stream):
            stream.wait_event(slot.free)  # the slot's previous bucket has been copied out
            for at, p in placed(bucket):
                job.cut(slot.anchor, at, p).copy_(job.anchor_at(at, p), non_blocking=True)
                for dev, host in zip(slot.state, job.state(p), strict=False):
                    job.cut(dev, at, p).copy_(host.view(-1)[p.start : p.stop], non_blocking=True)
            slot.loaded.record(stream)

    @staticmethod
    def _copy_out(job: BucketJob, bucket: list[Piece], slot: Slot, stream: Any) -> None:
        with torch.cuda.stream(stream):
            stream.wait_event(slot.computed)
            for at, p in placed(bucket):
                job.anchor_at(at, p).copy_(job.cut(slot.anchor, at, p), non_blocking=True)
                for host, dev in zip(job.state(p), slot.state, strict=False):
                    host.view(-1)[p.start : p.stop].copy_(job.cut(dev, at, p), non_blocking=True)
            slot.free.record(stream)
