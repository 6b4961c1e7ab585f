"""lightning_swarm: DiLoCo-style training across islands as a PyTorch Lightning strategy.

``import lightning_swarm`` registers ``Trainer(strategy="swarm")`` (and ``"swarm_spawn"``); a
second import, or a registry that already holds the name, is left alone.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.config import SwarmConfig
from lightning_swarm.strategy import SwarmStrategy

SwarmStrategy.register_strategies(StrategyRegistry)

__all__ = ["SwarmConfig", "SwarmStrategy"]
__version__ = "0.1.0"
