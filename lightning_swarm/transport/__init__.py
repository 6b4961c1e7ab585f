"""Transports: how pseudo-gradients are averaged across islands (torch and torch.distributed,
never lightning)."""

from lightning_swarm.transport.allreduce import AllReduceTransport, ring_allreduce_bytes
from lightning_swarm.transport.base import RoundStats, Transport
from lightning_swarm.transport.quantized import QuantizedTransport
from lightning_swarm.transport.swarm import SwarmTransport

__all__ = [
    "AllReduceTransport",
    "QuantizedTransport",
    "RoundStats",
    "SwarmTransport",
    "Transport",
    "ring_allreduce_bytes",
]
