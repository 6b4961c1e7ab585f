"""The outer loop of DiLoCo, below the Lightning glue: ``OuterLoop`` (one per fit) owns one
``OuterSync`` per optimizer, each running its rounds against a ``Transport``."""

from lightning_swarm.outer.loop import OuterLoop, SwarmTotals, as_outer_optimizer
from lightning_swarm.outer.sync import OuterSync, default_outer_optimizer
from lightning_swarm.outer.sync_state import OuterOptimizerFactory, StreamingOptions, SyncReport
from lightning_swarm.outer.worker import SyncWorker

__all__ = [
    "OuterLoop",
    "OuterOptimizerFactory",
    "OuterSync",
    "StreamingOptions",
    "SwarmTotals",
    "SyncReport",
    "SyncWorker",
    "as_outer_optimizer",
    "default_outer_optimizer",
]
