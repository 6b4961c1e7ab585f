"""All-reduce transport: the mean across islands through torch.distributed collectives.

Tensors are packed into float32 buckets by the one packer (``transport.buckets.mean_in_buckets``),
each all-reduced (sum) over the peer group and divided by the number of islands; the extra memory
is one bucket whatever the model size. The bucket lives where the backend needs it: CUDA for NCCL
(anchors and pseudo-gradients stay on the CPU; one bucket at a time visits the GPU), CPU for gloo.
Bytes are a ring all-reduce's, ``2 (n - 1) / n`` of the payload per rank: what the algorithm
moves, not a measurement of the NIC.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.transport.base import Bucket, Done, Handle, Opening, RoundPlace, RoundStats
from lightning_swarm.transport.buckets import check_bucket, mean_in_buckets
from lightning_swarm.transport.checks import agree_finite, agree_finite_flag


def ring_allreduce_bytes(payload_bytes: int, num_participants: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``payload_bytes``."""
    if num_participants <= 1:
        return 0
    return (2 * (num_participants - 1) * payload_bytes) // num_participants


class AllReduceTransport:
    """Bucketed mean over a peer process group.

    Args:
        group: the peer group (one rank per island); ``None`` means the default group.
        num_islands: size of the peer group. With one island ``average`` is the identity and
            moves nothing.
        bucket_numel: float32 elements per bucket; bounds the extra memory.
        device: where the bucket lives (``cuda`` for NCCL, ``cpu`` for gloo).
        island_group: a model-sharded island's group: its ranks agree on one finite verdict
            first (``checks.agree_finite``); ``None`` otherwise.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_islands: int,
        bucket_numel: int,
        device: torch.device | str = "cpu",
        island_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_bucket(bucket_numel)
        self.group = group
        self.island_group = island_group
        self.num_islands = num_islands
        self.bucket_numel = bucket_numel
        self.device = torch.device(device)

    @record_function(labels.ALLREDUCE)
    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        start = time.perf_counter()
        stats = RoundStats()
        for t in tensors.values():
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError("AllReduceTransport averages contiguous float32 tensors only")
        agree_finite(tensors.values(), self.group, self.num_islands, self.device, self.island_group)
        if self.num_islands > 1:
            # The buffer lives only inside this call: between syncs the transport holds no
            # memory at all.
            moved = mean_in_buckets(
                list(tensors.values()), self.bucket_numel, self.mean_, self.device
            )
            stats.bytes_sent += moved
            stats.bytes_received += moved
        stats.wall_s = time.perf_counter() - start
        return stats

    # The bucket-level contract (``transport.base.BucketTransport``).
    block_size = 1
    pipelined = True

    def open(
        self,
        *,
        round_index: int,
        finite: bool,
        names: Mapping[str, torch.Size],
        place: RoundPlace | None = None,
        offer: Mapping[str, Any] | None = None,
    ) -> Opening:
        """Raise ``NonFinitePseudoGradientError`` on every rank unless every island is finite,
        before any bucket moves; collective over the peer group."""
        agree_finite_flag(finite, self.group, self.num_islands, self.device, self.island_group)
        return Opening()

    def start(self, bucket: Bucket) -> Handle:
        """Start the all-reduce of ``bucket.flat``; its handle's ``wait`` divides by the islands
        and returns the bytes sent. A host bucket under a device backend (NCCL) is staged
        through ``device`` and copied back at the wait."""
        if self.num_islands <= 1:
            return Done()
        flat = bucket.flat
        if flat.device.type == "cpu" and self.device.type != "cpu":
            flat = flat.to(self.device)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        return _Mean(work, flat, bucket.flat, self.num_islands)

    def agree(self) -> RoundStats:
        """A round that started every bucket applies (refusals raise at ``open``)."""
        return RoundStats()

    def mean_(self, flat: Tensor) -> int:
        """Overwrite the flat float32 bucket ``flat`` with its mean across islands, in place
        (collective); returns the bytes this rank sent (and received) for it."""
        return self.start(Bucket(flat, (flat.numel(),))).wait()

    def close(self) -> None:
        """Nothing to release: the bucket lives only inside ``average``."""


@dataclass
class _Mean:
    """An all-reduce in flight: until ``wait`` returns, ``flat`` belongs to the collective."""

    work: dist.Work
    flat: Tensor
    out: Tensor  # the caller's bucket (``flat`` itself unless staged)
    num_islands: int

    def wait(self) -> int:
        self.work.wait()
        self.flat.div_(self.num_islands)
        if self.out is not self.flat:
            self.out.copy_(self.flat)
        return ring_allreduce_bytes(self.flat.numel() * self.flat.element_size(), self.num_islands)
