"""Lightning callbacks of lightning_swarm: thin adapters in the Lightning glue layer."""

from lightning_swarm.callbacks.census import HostMemoryCensus
from lightning_swarm.callbacks.resume import SwarmResume

__all__ = ["HostMemoryCensus", "SwarmResume"]
