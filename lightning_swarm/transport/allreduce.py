"""All-reduce over a static peer group: each bucket summed asynchronously, divided by the islands.

Every static transport shares its round: a finite vote before any bucket moves, and link
timeouts. A host bucket is staged on the device under NCCL; a rank moves a ring all-reduce's
``2 (n - 1) / n`` of the payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.budget import scale_of
from lightning_swarm.transport.agree import agree, flags_direct, flags_over
from lightning_swarm.transport.base import (
    Bucket,
    Done,
    Handle,
    Opening,
    RoundRequest,
    RoundStats,
    checked_work,
)
from lightning_swarm.transport.buckets import check_bucket
from lightning_swarm.transport.errors import LayoutMismatchError, NonFinitePseudoGradientError
from lightning_swarm.transport.link import LinkTimeouts, LinkWatch


def ring_allreduce_bytes(payload_bytes: int, num_participants: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``payload_bytes``."""
    if num_participants <= 1:
        return 0
    return (2 * (num_participants - 1) * payload_bytes) // num_participants


class AllReduceTransport:
    """Bucketed mean over a static peer ``group`` (one rank per island, in island order;
    ``None``: the default group); one island: the identity. Buckets are exchanged on ``device``
    (``cuda`` for NCCL). A model-sharded island's ``island_group`` agrees on one finite verdict
    before the peers compare theirs. ``timeouts=None`` keeps the group's own collective
    timeout; a timeout or a lost peer raises ``RoundTimeoutError`` or ``PeerLostError``.
    """

    block_size = 1
    pipelined = True
    heals = False
    every_rank_in_round = False
    direct_vote = False  # vote in one all-to-all step instead of an all-gather ring

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
        self.group = group
        self.num_islands = num_islands
        self.bucket_numel = bucket_numel
        self.device = torch.device(device)
        self.island_group = island_group
        self.link = LinkWatch(group, num_islands=num_islands, timeouts=timeouts)

    def _position(self) -> int:  # this rank's island
        return 0 if self.num_islands <= 1 else dist.get_rank(self.group)

    def open(self, request: RoundRequest) -> Opening:
        """Raise ``NonFinitePseudoGradientError`` on every rank unless every island is finite,
        before any bucket moves (collective). With ``work`` each island's rides with its flag
        (``BadWorkError`` if malformed), and the ``Opening`` weighs this island."""
        self.link.open(request.round_index, request.names)
        with self.link.explained():
            opening = self._vote(request)
        self.link.started()
        return opening

    def _vote(self, request: RoundRequest) -> Opening:
        finite = request.finite
        if self.island_group is not None:  # every peer group of the island raises together
            size = dist.get_world_size(self.island_group)
            finite = agree(finite, gather=flags_over(self.island_group, size, self.device)).all_ok
        work = request.work
        # The layout's fingerprint in two exact halves (a float carries 53 bits), then the work.
        values: tuple[float, ...] = (
            float(request.layout >> 32),
            float(request.layout & 0xFFFFFFFF),
        )
        values += () if work is None else (float(work.steps), float(work.inner_steps))
        flags = flags_direct if self.direct_vote else flags_over
        agreed = agree(
            finite, gather=flags(self.group, self.num_islands, self.device), values=values
        )
        if odd := [i for i, v in enumerate(agreed.values) if v[:2] != agreed.values[0][:2]]:
            raise LayoutMismatchError(
                f"island(s) {odd} hold other slices of this round's parameters than island 0 "
                "at the same place in their island (another model, or another island_size, "
                "island_parallel or tensor_parallel_size), so their pseudo-gradients cannot "
                "be averaged; the round was taken nowhere. Launch every island with the same "
                "model and the same layout inside it."
            )
        if bad := list(agreed.bad):
            raise NonFinitePseudoGradientError(
                f"the pseudo-gradient of island(s) {bad} holds NaN or inf, so the outer step was "
                "not taken on any island (anchors unchanged): that island's training diverged; "
                "check its loss for NaN, lower the inner learning rate or enable gradient "
                "clipping, then resume from the last checkpoint."
            )
        if work is None:
            return Opening()
        weights, swarm_steps = checked_work([(v[2], v[3]) for v in agreed.values])
        return Opening(scale=scale_of(weights, self._position()), swarm_steps=swarm_steps)

    @record_function(labels.ALLREDUCE)
    def start(self, bucket: Bucket) -> Handle:
        """Start the all-reduce of ``bucket.flat``; a host bucket under a device backend (NCCL)
        is staged through ``device`` and copied back at the wait."""
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
