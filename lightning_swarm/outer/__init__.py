"""The outer loop of DiLoCo: anchors, outer optimizers, rounds, the worker that overlaps them.

Layer: below the Lightning glue, above the transports and the algorithm; never imports
lightning. ``OuterLoop`` (one per fit) owns one ``OuterSync`` per optimizer, the ``SyncWorker``
and the totals; ``OuterSync`` runs one optimizer's rounds against a ``Transport``.

Modules: ``loop`` (the per-fit owner), ``sync`` (``OuterSync``: holds its state, its round
engine and its checkpoint state as members), ``sync_state`` (``SyncState``: the fields they
share), ``bucketed_engine`` (whole rounds in one bucketed pass, the default) over ``bucketed``
(the bucket pass itself) and ``staging`` (its CUDA path), ``two_phase`` (the send/apply round
engine), ``checkpoint_state`` (``SyncCheckpoint``), ``reports`` (``SyncReport``,
``StreamingOptions``), ``shard`` (a sharded island), ``worker`` (the background thread),
``build`` (the transport the options name), ``join`` (an elastic joiner's state).
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
