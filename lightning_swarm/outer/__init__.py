"""The outer loop of DiLoCo: anchors, outer optimizers, rounds, the worker that overlaps them.

Below the Lightning glue, above the transports and the algorithm; never imports lightning.
``OuterLoop`` (one per fit) owns one ``OuterSync`` per optimizer, the ``SyncWorker`` and the
totals; ``OuterSync`` runs one optimizer's rounds against a ``Transport``.
"""

from lightning_swarm.outer.loop import (
    OuterLoop,
    SwarmTotals,
    as_outer_optimizer,
    default_outer_optimizer,
)
from lightning_swarm.outer.reports import OuterOptimizerFactory, StreamingOptions, SyncReport
from lightning_swarm.outer.sync import OuterSync
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
