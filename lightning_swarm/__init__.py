"""lightning_swarm: DiLoCo-style training across islands as a PyTorch Lightning strategy.

The public names: the strategy, its callbacks, and the errors a user catches.
``import lightning_swarm`` registers ``Trainer(strategy="swarm")`` (and ``"swarm_spawn"``,
``"swarm_fsdp"``); a
second import, or a registry that already holds the name, is left alone.

No module below this one imports the package root or the strategy from a lower layer
(``tests/test_layering.py``), so the import order here is free.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.callbacks import HostMemoryCensus, SwarmResume
from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmCheckpointError, SwarmError
from lightning_swarm.outer import SyncWorkerError
from lightning_swarm.strategy import SwarmStrategy
from lightning_swarm.transport.aggregator.rotating import SwarmRoundError
from lightning_swarm.transport.checks import NonFinitePseudoGradientError

SwarmStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "HostMemoryCensus",
    "NonFinitePseudoGradientError",
    "SwarmCheckpointError",
    "SwarmConfig",
    "SwarmError",
    "SwarmResume",
    "SwarmRoundError",
    "SwarmStrategy",
    "SyncWorkerError",
]
__version__ = "0.1.0"
