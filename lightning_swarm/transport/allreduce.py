"""All-reduce transport: the mean across islands through torch.distributed collectives.

Each bucket the round engine starts is all-reduced (sum) over the peer group and divided by the
number of islands, asynchronously (pipelined). The bucket moves where the backend needs it: a
host bucket visits the device under NCCL (anchors and pseudo-gradients stay on the CPU), CPU
buckets go to gloo as they are.
Bytes are a ring all-reduce's, ``2 (n - 1) / n`` of the payload per rank: what the algorithm
moves, not a measurement of the NIC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.transport.base import Bucket, Done, Handle, Opening, RoundRequest, RoundStats
from lightning_swarm.transport.buckets import check_bucket
from lightning_swarm.transport.checks import agree_finite
from lightning_swarm.transport.link import LinkTimeouts, LinkWatch


def ring_allreduce_bytes(payload_bytes: int, num_participants: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``payload_bytes``."""
    if num_participants <= 1:
        return 0
    return (2 * (num_participants - 1) * payload_bytes) // num_participants


class AllReduceTransport:
    """Bucketed mean over a peer process group.

    Args:
        group: the peer group (one rank per island); ``None`` means the default group.
        num_islands: size of the peer group. With one island a round is the identity and moves
            nothing.
        bucket_numel: float32 elements per bucket; bounds the extra memory.
        device: where the bucket lives (``cuda`` for NCCL, ``cpu`` for gloo).
        island_group: a model-sharded island's group: its ranks agree on one finite verdict
            first (``checks.agree_finite``); ``None`` otherwise.
        timeouts: where the peer group's collective timeout comes from (``transport.link``);
            ``None`` keeps the group's own. A timeout or a peer that went away raises
            ``RoundTimeoutError`` or ``PeerLostError`` either way.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_islands: int,
        bucket_numel: int,
        device: torch.device | str = "cpu",
        island_group: dist.ProcessGroup | None = None,
        timeouts: LinkTimeouts | None = None,
    ) -> None:
        check_bucket(bucket_numel)
        self.link = LinkWatch(group, num_islands=num_islands, timeouts=timeouts)
        self.group = group
        self.island_group = island_group
        self.num_islands = num_islands
        self.bucket_numel = bucket_numel
        self.device = torch.device(device)

    # The contract (``transport.base.Transport``).
    block_size = 1
    pipelined = True
    heals = False
    every_rank_in_round = False

    def open(self, request: RoundRequest) -> Opening:
        """Raise ``NonFinitePseudoGradientError`` on every rank unless every island is finite,
        before any bucket moves; collective over the peer group. With ``work`` the islands'
        weights ride with the flag (``checks.agree_finite``)."""
        self.link.open(request.round_index, request.names)
        with self.link.explained():
            position = 0 if self.num_islands <= 1 else dist.get_rank(self.group)
            opening = agree_finite(
                request.finite, self.group, self.num_islands, self.device, self.island_group,
                work=request.work, island_index=position,
            )  # fmt: skip
        self.link.started()
        return opening

    @record_function(labels.ALLREDUCE)
    def start(self, bucket: Bucket) -> Handle:
        """Start the all-reduce of ``bucket.flat``; its handle's ``wait`` divides by the islands
        and returns the bytes sent. A host bucket under a device backend (NCCL) is staged
        through ``device`` and copied back at the wait."""
        if self.num_islands <= 1:
            return Done()
        flat = bucket.flat
        if flat.device.type == "cpu" and self.device.type != "cpu":
            flat = flat.to(self.device)
        with self.link.explained():
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        return _Mean(work, flat, bucket.flat, self.num_islands, self.link)

    def agree(self) -> RoundStats:
        """A round that started every bucket applies (refusals raise at ``open``)."""
        self.link.finished()
        return RoundStats()

    def close(self) -> None:
        """Nothing to release: a bucket is the engine's."""


@dataclass
class _Mean:
    """An all-reduce in flight: until ``wait`` returns, ``flat`` belongs to the collective."""

    work: dist.Work
    flat: Tensor
    out: Tensor  # the caller's bucket (``flat`` itself unless staged)
    num_islands: int
    link: LinkWatch

    def wait(self) -> int:
        with self.link.explained():
            self.work.wait()
        self.link.arrived()
        self.flat.div_(self.num_islands)
        if self.out is not self.flat:
            self.out.copy_(self.flat)
        return ring_allreduce_bytes(self.flat.numel() * self.flat.element_size(), self.num_islands)
