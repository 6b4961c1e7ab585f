"""Build the transport a run's options name: the one place that knows every transport class.

``build_transport`` turns the plain options into an all-reduce, a reduce-scatter (any codec) or
an aggregator transport (``swarm.aggregator``) over a peer group the caller built;
``peer_backend`` says which backend that group needs (the aggregators work on the CPU, so a gloo
group beside NCCL). The caller owns the groups and must ``close`` the transport before them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.allreduce import AllReduceTransport
from lightning_swarm.transport.base import Transport
from lightning_swarm.transport.config import SwarmTransportConfig, check_transport
from lightning_swarm.transport.link import LinkTimeouts
from lightning_swarm.transport.reduce_scatter import ReduceScatterTransport

CPU_BACKEND = "gloo"


def peer_backend(transport: str, backend: str) -> str | None:
    """The backend the peer group of ``transport`` needs in a world whose default is
    ``backend``; ``None`` means the default backend serves.

    NCCL moves device tensors only; the swarm transport's traffic is CPU tensors, so with NCCL
    it needs a gloo peer group. The all-reduce transports stage buckets on the device instead.
    """
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
    """The transport named ``transport`` over the peer group ``group``.

    Args:
        transport: one of ``options.TRANSPORTS``.
        group: the peer group (one rank per island, ordered by island); for ``"swarm"`` in an
            NCCL world, a group with ``peer_backend``'s backend.
        num_islands: size of the peer group.
        island_index: this rank's island.
        device: where the all-reduce transports stage buckets (the accelerator with NCCL, the
            CPU with gloo); the swarm transport always works on the CPU.
        codec: the pseudo-gradient codec; ``None`` (``codecs.codec_for("none")``) sends
            float32 as is.
        bucket_numel: float32 elements per all-reduce bucket.
        swarm: the swarm transport's options (used only by ``"swarm"``).
        island_group: a model-sharded island's group, over which the all-reduce transports
            agree on one finite verdict per island before the peer groups compare theirs, and
            the swarm transport's aggregators on one verdict (and norm) per island. For
            ``"swarm"`` in an NCCL world it must have ``peer_backend``'s backend.
        timeouts: where the all-reduce transports' peer-group timeout comes from
            (``transport.link``); ``None`` keeps the group's own.

    Raises:
        ValueError: an unknown transport, or options out of range for this topology.
        SpoolError: the swarm transport's spool root cannot be created.
    """
    check_transport(transport)
    if transport == "swarm":
        return SwarmAggregator(
            group,
            num_islands=num_islands,
            island_index=island_index,
            owners=swarm.aggregator,
            codec=codec,
            island_group=island_group,
            **swarm.transport_kwargs(),
        )
    if codec is not None:
        return ReduceScatterTransport(
            group,
            num_islands=num_islands,
            island_index=island_index,
            codec=codec,
            bucket_numel=bucket_numel,
            device=device,
            island_group=island_group,
            timeouts=timeouts,
        )
    return AllReduceTransport(
        group,
        num_islands=num_islands,
        bucket_numel=bucket_numel,
        device=device,
        island_group=island_group,
        timeouts=timeouts,
    )
