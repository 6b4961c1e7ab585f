"""lightning_swarm: DiLoCo-style training across islands as a PyTorch Lightning strategy.

Exports the strategy, its callbacks, ``load_global_state_dict`` and every error a user can act on.
Importing registers ``Trainer(strategy="swarm")``, ``"swarm_spawn"`` and ``"swarm_fsdp"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.callbacks import HostMemoryCensus, SwarmResume
from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import (
    CollectiveTimeoutError,
    DiskFullError,
    PeerLostError,
    RoundTimeoutError,
    SwarmCheckpointError,
    SwarmConfigError,
    SwarmConfigTypeError,
    SwarmError,
)
from lightning_swarm.membership.errors import (
    DivergedIslandError,
    DuplicateIslandError,
    LighthouseLostError,
    LighthouseUnreachableError,
    MembershipError,
    ModelMismatchError,
    QuorumTimeoutError,
    SettingsMismatchError,
    SwarmGoneError,
    TorchftVersionError,
)
from lightning_swarm.outer.errors import ShareFailedError, SyncWorkerError
from lightning_swarm.pipeline import keep_stage
from lightning_swarm.resume.global_model import load_global_state_dict
from lightning_swarm.strategy import SwarmStrategy
from lightning_swarm.transport.errors import (
    BadWorkError,
    LayoutMismatchError,
    NonFinitePseudoGradientError,
    SpoolError,
    SwarmRoundError,
)

SwarmStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "BadWorkError",
    "CollectiveTimeoutError",
    "DiskFullError",
    "DivergedIslandError",
    "DuplicateIslandError",
    "HostMemoryCensus",
    "LayoutMismatchError",
    "LighthouseLostError",
    "LighthouseUnreachableError",
    "MembershipError",
    "ModelMismatchError",
    "NonFinitePseudoGradientError",
    "PeerLostError",
    "QuorumTimeoutError",
    "RoundTimeoutError",
    "SettingsMismatchError",
    "ShareFailedError",
    "SpoolError",
    "SwarmCheckpointError",
    "SwarmConfig",
    "SwarmConfigError",
    "SwarmConfigTypeError",
    "SwarmError",
    "SwarmGoneError",
    "SwarmResume",
    "SwarmRoundError",
    "SwarmStrategy",
    "SyncWorkerError",
    "TorchftVersionError",
    "keep_stage",
    "load_global_state_dict",
]
__version__ = "0.1.0"
