"""What save and restore need from the training side: a small protocol, no Lightning. Each
collective must be called on every rank in the same order."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_swarm.algorithm.model_layout import Layout
from lightning_swarm.config import AnchorConfig, SwarmConfig
from lightning_swarm.resume.outer_record import OuterRecord
from lightning_swarm.resume.records import OptionsRecord, Totals, plain_values
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.agree import objects_over


class OuterState(Protocol):
    """The parts of ``OuterSync`` a checkpoint reads and writes."""

    @property
    def params(self) -> Mapping[str, torch.nn.Parameter]: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def owned(self) -> Sequence[str]: ...
    @property
    def anchor_dtype(self) -> torch.dtype: ...
    @property
    def anchor_bytes(self) -> int: ...
    @property
    def outer_optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def base_momentum(self) -> Sequence[float | None]: ...
    @property
    def fragments(self) -> Sequence[Sequence[str]]: ...
    @property
    def inner_steps(self) -> int: ...
    @property
    def outer_steps(self) -> int: ...
    def record(self) -> OuterRecord: ...
    def check_state_dict(self, state: OuterRecord) -> None: ...
    def check_anchors(self, anchors: Mapping[str, Tensor]) -> None: ...
    def load_checked_state_dict(self, state: OuterRecord) -> None: ...
    def island_state_dict(self) -> dict[str, Any]: ...
    def load_island_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class Collectives:
    """This rank's view of the world: its rank and the collectives a checkpoint uses."""

    rank: int
    broadcast: Callable[[Any], Any]  # rank 0's object, on every rank
    barrier: Callable[[str], None]
    # Every rank's object, in rank order; by default over the world.
    all_gather_object: Callable[[Any], Sequence[Any]] = field(default_factory=objects_over)


@dataclass(frozen=True)
class ModelShards:
    """A model-sharded island (``island_parallel="fsdp"``): its mesh's shape
    (``{"data_parallel": dp, "tensor_parallel": tp}``); each parameter's global shape and
    slice are in its outer state's ``layout``."""

    mesh: Mapping[str, int]


@dataclass(frozen=True)
class TrainingView:
    """The training state a save reads and a restore writes, on one rank. With ``model_shards``
    every rank has its own files; with ``loops_per_island`` each island its own loop state."""

    topology: IslandTopology
    outer_syncs: Sequence[OuterState]
    module: torch.nn.Module  # the LightningModule
    optimizers: Sequence[torch.optim.Optimizer]
    device: torch.device
    totals: Totals
    options: OptionsRecord
    anchors: AnchorConfig
    collectives: Collectives
    model_shards: ModelShards | None = None
    loops_per_island: bool = False


def options_of(config: SwarmConfig, outer_syncs: Sequence[OuterState]) -> OptionsRecord:
    return OptionsRecord(
        values=config.resume_options(),
        outer_optimizer=[type(o.outer_optimizer).__name__ for o in outer_syncs],
        outer_hyperparameters=[_built_hyperparameters(o) for o in outer_syncs],
    )


def optimizer_param_names(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> list[str]:
    """The module's name of each of ``optimizer``'s parameters, in the order its state dict
    numbers them (``"?"`` for a tensor the module does not hold)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]]


def _built_hyperparameters(outer: OuterState) -> dict[str, Any]:
    """The first param group's options as the factory built them: the momentum schedule
    rewrites ``momentum`` before every round, so the record keeps the value it scales."""
    values = plain_values(outer.outer_optimizer.param_groups[0])
    base = outer.base_momentum[0] if outer.base_momentum else None
    if base is not None and "momentum" in values:
        values["momentum"] = base
    return values


def local_tensors(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (a view; saving copies it)."""
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, Mapping):
        return {k: local_tensors(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_tensors(v) for v in state)
    return state
