"""Transports: how pseudo-gradients are averaged across islands (torch and torch.distributed,
never lightning)."""

from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.allreduce import AllReduceTransport, ring_allreduce_bytes
from lightning_swarm.transport.base import RoundStats, Transport
from lightning_swarm.transport.config import TRANSPORTS, SwarmTransportConfig
from lightning_swarm.transport.factory import build_transport, peer_backend
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
