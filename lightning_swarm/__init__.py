"""lightning_swarm: DiLoCo-style training across islands as a PyTorch Lightning strategy.

The public names: the strategy, its callbacks, and the errors a user catches.
``import lightning_swarm`` registers ``Trainer(strategy="swarm")`` (and ``"swarm_spawn"``); a
second import, or a registry that already holds the name, is left alone.

Import order matters for cycles: the strategy is imported before the callbacks, and the
callbacks import the strategy only inside functions, so importing ``lightning_swarm`` (or
``lightning_swarm.callbacks`` first) never meets a partially initialised module.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.checkpoint import SwarmCheckpointError
from lightning_swarm.config import SwarmConfig
from lightning_swarm.strategy import SwarmStrategy
from lightning_swarm.transport.checks import NonFinitePseudoGradientError
from lightning_swarm.transport.swarm import SwarmRoundError
from lightning_swarm.transport.worker import SyncWorkerError

from lightning_swarm.callbacks import HostMemoryCensus, SwarmResume  # isort: skip  (after strategy)

SwarmStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "HostMemoryCensus",
    "NonFinitePseudoGradientError",
    "SwarmCheckpointError",
    "SwarmConfig",
    "SwarmResume",
    "SwarmRoundError",
    "SwarmStrategy",
    "SyncWorkerError",
]
__version__ = "0.1.0"
