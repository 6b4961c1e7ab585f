"""Transports: how pseudo-gradients are averaged across islands (torch and torch.distributed,
never lightning)."""

from lightning_swarm.transport.allreduce import AllReduceTransport, ring_allreduce_bytes
from lightning_swarm.transport.base import RoundStats, Transport

__all__ = ["AllReduceTransport", "RoundStats", "Transport", "ring_allreduce_bytes"]
