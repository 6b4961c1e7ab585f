"""Lightning callbacks of lightning_swarm: thin adapters in the Lightning glue layer.

The glue layer is ``strategy.py``, ``island_ddp.py``, ``elastic.py``, ``fit_end.py``, ``cli/``,
``demo/`` and this package; nothing below it
(``outer/``, ``resume/``, ``config``, ``membership/``, ``transport/``, ``algorithm/``,
``memory/``) imports lightning. ``HostMemoryCensus`` reads the swarm's figures through the
``SwarmMemoryReport`` protocol (``lightning_swarm.memory.report``), never through the strategy.
"""

from lightning_swarm.callbacks.census import HostMemoryCensus
from lightning_swarm.callbacks.resume import SwarmResume

__all__ = ["HostMemoryCensus", "SwarmResume"]
