"""All-reduce transport: the mean across islands through torch.distributed collectives.

Tensors are packed into buckets of at most ``bucket_numel`` float32 elements by the one packer
(``transport.buckets.mean_in_buckets``); each bucket is all-reduced (sum) over the peer group,
divided by the number of islands and unpacked back into the caller's tensors. A tensor larger
than a bucket is split across several buckets and a partly filled bucket is reduced only over its
filled prefix, so the extra memory is one bucket, whatever the model size.

The bucket lives on the device the backend needs: CUDA for NCCL (anchors and pseudo-gradients
stay on the CPU; only one bucket at a time visits the GPU), CPU for gloo.

Byte accounting follows the ring all-reduce that NCCL and gloo use for large payloads: each rank
sends and receives ``2 (n - 1) / n`` times the payload for ``n`` islands. These are the bytes
the algorithm moves, not a measurement of the NIC.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.transport.base import RoundStats
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

    def agree_finite(self, local_finite: bool) -> None:
        """Raise ``NonFinitePseudoGradientError`` on every rank unless every island is finite.

        The first half of a streamed round (``lightning_swarm.outer.bucketed``), before any
        bucket moves; collective over the peer group.
        """
        agree_finite_flag(
            local_finite, self.group, self.num_islands, self.device, self.island_group
        )

    def mean_(self, flat: Tensor) -> int:
        """Overwrite the flat float32 bucket ``flat`` with its mean across islands, in place.

        Collective. ``flat`` may live on any device the backend reduces (CUDA for NCCL).
        Returns the bytes this rank sent (and received) for it.
        """
        return self.start_mean(flat)()

    def start_mean(self, flat: Tensor) -> Callable[[], int]:
        """``mean_`` in two halves: start the all-reduce now, and return the call that waits
        for it, divides and returns the bytes sent. Until that call returns, ``flat`` belongs to
        the collective. Buckets must be started in the same order on every rank."""
        if self.num_islands <= 1:
            return lambda: 0
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        def finish() -> int:
            assert work is not None
            work.wait()
            flat.div_(self.num_islands)
            return ring_allreduce_bytes(flat.numel() * flat.element_size(), self.num_islands)

        return finish

    def close(self) -> None:
        """Nothing to release: the bucket lives only inside ``average``."""
