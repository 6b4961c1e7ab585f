"""The Hydra schema of ``SwarmStrategy``, registered in Hydra's ConfigStore.

``register_configs()`` stores ``SwarmStrategyConf`` (``SwarmConfig``'s fields plus the outer
optimizer and launch options) under group ``strategy`` as ``swarm_schema``, so a YAML file that
lists it in its defaults gets type checks and unknown-key errors, and a user's own Hydra app can
reuse it. The fields are declared once, on ``SwarmConfig``; this class only adds what is not data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from lightning_swarm.config import SwarmConfig


def _default_outer_optimizer() -> dict[str, Any]:
    return {
        "_target_": "torch.optim.SGD",
        "_partial_": True,
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
    }


@dataclass(kw_only=True)
class SwarmStrategyConf(SwarmConfig):
    """Hydra schema of ``SwarmStrategy``: ``SwarmConfig``'s fields plus non-data options."""

    _target_: str = "lightning_swarm.SwarmStrategy"
    outer_optimizer: Any = field(default_factory=_default_outer_optimizer)
    start_method: str = "popen"
    process_group_backend: str | None = None

    def __post_init__(self) -> None:
        # Validation happens when SwarmStrategy is built from this node, not at schema time.
        pass


def register_configs() -> None:
    """Store the structured configs in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(group="strategy", name="swarm_schema", node=SwarmStrategyConf)
