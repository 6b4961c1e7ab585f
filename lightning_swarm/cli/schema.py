"""The Hydra schema of ``SwarmStrategy``, registered in Hydra's ConfigStore.

``register_configs()`` stores ``SwarmStrategyConf`` under group ``strategy`` as ``swarm_schema``,
so YAML gets type checks and unknown-key errors. Its fields derive from ``SwarmConfig``; the
schema only adds the outer optimizer and launch options.
"""

from __future__ import annotations

import types
from dataclasses import MISSING, field, fields, make_dataclass
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

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


def _schema_type(annotation: Any) -> Any:
    """The type OmegaConf checks for a field annotated ``annotation`` on ``SwarmConfig``.

    OmegaConf knows neither ``Literal`` nor unions of several types: a ``Literal`` choice is
    checked as ``str`` here (its values are checked when the strategy is built), an optional
    simple type stays optional, and any other union (e.g. a layout name or lists of names)
    is ``Any``.
    """
    origin = get_origin(annotation)
    if origin is Literal:
        return str
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1 and len(members) < len(get_args(annotation)):
            inner = _schema_type(members[0])
            return Any if inner is Any else Optional[inner]  # noqa: UP045 (a runtime type)
        return Any
    return annotation


def _schema_fields() -> list[tuple[str, Any, Any]]:
    """``SwarmConfig``'s fields, with their defaults, as OmegaConf can check them."""
    hints = get_type_hints(SwarmConfig)
    out: list[tuple[str, Any, Any]] = []
    for item in fields(SwarmConfig):
        if item.default_factory is not MISSING:
            default = field(default_factory=item.default_factory)
        else:
            default = field(default=item.default)
        out.append((item.name, _schema_type(hints[item.name]), default))
    return out


# Hydra schema of ``SwarmStrategy``: every ``SwarmConfig`` field (derived, never restated) plus
# what is not plain data: the target, the outer optimizer (a ``_partial_`` node) and the
# launch options Lightning's DDPStrategy takes. Validation runs when the strategy is built from
# the composed node, so a bad value fails with ``SwarmConfig``'s message, not OmegaConf's.
SwarmStrategyConf: type = make_dataclass(
    "SwarmStrategyConf",
    [
        ("_target_", str, field(default="lightning_swarm.SwarmStrategy")),
        *_schema_fields(),
        ("outer_optimizer", Any, field(default_factory=_default_outer_optimizer)),
        ("start_method", str, field(default="popen")),
        ("process_group_backend", Optional[str], field(default=None)),  # noqa: UP045
    ],
    kw_only=True,
)
SwarmStrategyConf.__module__ = __name__


def register_configs() -> None:
    """Store the structured configs in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(group="strategy", name="swarm_schema", node=SwarmStrategyConf)
