"""Transports: how pseudo-gradients are averaged across islands (torch and torch.distributed,
never lightning). ``build_transport`` is the one place that knows every transport class; its
caller builds the peer group (``peer_backend``'s backend) and closes the transport before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.allreduce import AllReduceTransport, ring_allreduce_bytes
from lightning_swarm.transport.base import RoundStats, Transport
from lightning_swarm.transport.config import TRANSPORTS, SwarmTransportConfig, check_transport
from lightning_swarm.transport.link import LinkTimeouts
from lightning_swarm.transport.reduce_scatter import ReduceScatterTransport

__all__ = [
    "TRANSPORTS",
    "AllReduceTransport",
    "ReduceScatterTransport",
    "RoundStats",
    "SwarmAggregator",
    "SwarmTransportConfig",
    "Transport",
    "build_transport",
    "peer_backend",
    "ring_allreduce_bytes",
]

CPU_BACKEND = "gloo"


def peer_backend(transport: str, backend: str) -> str | None:
    """The backend the peer group of ``transport`` needs in a world whose default is
    ``backend``; ``None``: the default serves. The swarm transport moves CPU tensors, which
    NCCL cannot; the all-reduce transports stage buckets on the device instead."""
    check_transport(transport)
    if transport == "swarm" and backend != CPU_BACKEND:
        return CPU_BACKEND
    return None


def build_transport(
    transport: str,
    *,
    group: dist.ProcessGroup | None,
    num_islands: int,
    island_index: int,
    device: torch.device,
    codec: Codec | None,
    bucket_numel: int,
    swarm: SwarmTransportConfig,
    island_group: dist.ProcessGroup | None = None,
    timeouts: LinkTimeouts | None = None,
) -> Transport:
    """The transport named ``transport`` (one of ``TRANSPORTS``) over the peer group ``group``
    (one rank per island, ordered by island): the swarm aggregator, else a reduce-scatter with a
    ``codec`` or a plain all-reduce (``codec=None`` sends float32 as is), staged on ``device``.
    ``swarm`` is read by ``"swarm"`` only, ``timeouts`` by the others. For ``"swarm"`` in an
    NCCL world, ``group`` and ``island_group`` need ``peer_backend``'s backend.

    Raises:
        ValueError: an unknown transport, or options out of range for this topology.
        SpoolError: the swarm transport's spool root cannot be created.
    """
    check_transport(transport)
    if transport == "swarm":
        return SwarmAggregator(
            group, num_islands=num_islands, island_index=island_index, owners=swarm.aggregator,
            codec=codec, island_group=island_group, **swarm.transport_kwargs(),
        )  # fmt: skip
    if codec is not None:
        return ReduceScatterTransport(
            group, num_islands=num_islands, island_index=island_index, codec=codec,
            bucket_numel=bucket_numel, device=device, island_group=island_group,
            timeouts=timeouts,
        )  # fmt: skip
    return AllReduceTransport(
        group, num_islands=num_islands, bucket_numel=bucket_numel, device=device,
        island_group=island_group, timeouts=timeouts,
    )  # fmt: skip
