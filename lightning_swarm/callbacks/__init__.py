"""Lightning callbacks of lightning_swarm (glue: the only layer besides strategy.py that imports
lightning)."""

from lightning_swarm.callbacks.census import HostMemoryCensus
from lightning_swarm.callbacks.resume import SwarmResume

__all__ = ["HostMemoryCensus", "SwarmResume"]
