"""Lightning callbacks of lightning_swarm: thin adapters in the Lightning glue layer.

``HostMemoryCensus`` reads the swarm's figures through ``memory.report.SwarmMemoryReport``, never
through the strategy.
"""

from lightning_swarm.callbacks.census import HostMemoryCensus
from lightning_swarm.callbacks.resume import SwarmResume

__all__ = ["HostMemoryCensus", "SwarmResume"]
