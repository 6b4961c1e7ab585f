"""The outer optimizer outside ``optimizer.step()``: bucket steps and state by parameter name.

torch's own functional SGD / Adam(W) steps flat slices with state in torch's format, so a slice
gets the bits of the whole tensor; the caller's anchor and state slices are written in place."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim.adam import adam
from torch.optim.sgd import sgd

FastKind = Literal["sgd", "adam"]


def fast_outer_kind(optimizer: torch.optim.Optimizer) -> FastKind | None:
    """``"sgd"`` or ``"adam"`` when every group can take the functional step, else ``None``."""
    kind: FastKind
    numbers: tuple[str, ...]
    if type(optimizer) is torch.optim.SGD:
        kind, numbers = "sgd", ("lr", "momentum", "dampening", "weight_decay")
    elif type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        kind, numbers = "adam", ("lr", "eps", "weight_decay")
    else:
        return None
    for group in optimizer.param_groups:
        if any(group.get(flag) for flag in ("fused", "differentiable", "capturable", "amsgrad")):
            return None
        values = [group[key] for key in numbers] + list(group.get("betas", ()))
        if any(isinstance(v, Tensor) for v in values):
            return None
    return kind


def groups_by_param(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Map ``id(parameter)`` to its param group (a live reference, valid until groups change)."""
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def ensure_state(
    optimizer: torch.optim.Optimizer,
    anchor: Tensor,
    kind: FastKind,
    group: dict[str, Any],
    allocate: Callable[[Tensor], Tensor],
) -> bool:
    """Create ``anchor``'s state in torch's format if it has none; True if it was created.

    ``allocate(anchor)`` returns a new float32 tensor shaped like the anchor (the caller picks
    the memory, e.g. pinned). A fresh SGD momentum buffer must be *set* to the first gradient,
    so the caller passes ``fresh`` on to ``sgd_step_``; Adam's moments start at zero.
    """
    # optimizer.state is a defaultdict: only touch it where torch would store something, so
    # that state_dict() lists the same parameters on both paths.
    if kind == "sgd":
        if group["momentum"] == 0:
            return False
        if optimizer.state.get(anchor, {}).get("momentum_buffer") is not None:
            return False
        optimizer.state[anchor]["momentum_buffer"] = allocate(anchor)
        return True
    state = optimizer.state[anchor]
    if "step" in state:
        return False
    # torch.optim keeps Adam's "step" as float32, or float64 when that is the default dtype.
    float64 = torch.get_default_dtype() == torch.float64
    state["step"] = torch.tensor(0.0, dtype=torch.float64 if float64 else torch.float32)
    state["exp_avg"] = allocate(anchor).zero_()
    state["exp_avg_sq"] = allocate(anchor).zero_()
    return True


_SGD_OPTIONS = ("weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize")
_ADAM_OPTIONS = ("lr", "weight_decay", "eps", "maximize", "decoupled_weight_decay", "amsgrad")


def sgd_step_(
    anchor: Tensor, grad: Tensor, buf: Tensor | None, group: dict[str, Any], *, fresh: bool
) -> None:
    """torch's single-tensor SGD on one flat slice (``buf`` None without momentum); ``fresh``:
    the buffer was just created and is set to the first gradient, as torch does."""
    buffers: list[Tensor | None] = [None if fresh else buf]
    sgd([anchor], [grad], buffers, foreach=False, **{k: group[k] for k in _SGD_OPTIONS})
    if fresh and buf is not None and buffers[0] is not None:
        buf.copy_(buffers[0])


def adam_step_(
    anchor: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    group: dict[str, Any],
    *,
    step: float,
) -> None:
    """torch's single-tensor Adam / AdamW on one flat slice at (1-based) ``step``: the caller
    increments ``state["step"]`` once per round and passes its value for every slice."""
    beta1, beta2 = group["betas"]
    options = {k: group[k] for k in _ADAM_OPTIONS} | {"beta1": beta1, "beta2": beta2}
    steps = [torch.tensor(step - 1.0)]  # torch counts this step itself
    adam([anchor], [grad], [exp_avg], [exp_avg_sq], [], steps, foreach=False, **options)


def _single_group(state: Mapping[str, Any], what: str) -> dict[str, Any]:
    groups = state["param_groups"]
    if len(groups) != 1:
        raise ValueError(
            f"{what} has {len(groups)} param groups; only an outer optimizer over one group of "
            "anchors can be re-sharded. Resume with the island_size and shard_outer the "
            "checkpoint was written with."
        )
    return dict(groups[0])


def merge_by_name(
    shards: Sequence[tuple[Sequence[str], Mapping[str, Any]]],
) -> tuple[list[str], dict[str, Any]]:
    """One optimizer state over the names of every shard, in shard order. Tensors are not
    copied; hyper-parameters come from the first shard."""
    names: list[str] = []
    merged: dict[Any, Any] = {}
    group: dict[str, Any] | None = None
    for shard_names, state in shards:
        head = _single_group(state, "a saved outer optimizer shard")
        group = head if group is None else group
        for position, name in enumerate(shard_names):
            if position in state["state"]:
                merged[len(names)] = state["state"][position]
            names.append(name)
    assert group is not None, "merge_by_name needs at least one shard"
    group["params"] = list(range(len(names)))
    return names, {"state": merged, "param_groups": [group]}


def select_by_name(
    state: Mapping[str, Any], names: Sequence[str], wanted: Sequence[str]
) -> dict[str, Any]:
    """The state of ``wanted`` (a subset of ``names``, the order ``state`` was saved in)."""
    if list(names) == list(wanted):
        return dict(state)
    group = _single_group(state, "the saved outer optimizer")
    index = {name: i for i, name in enumerate(names)}
    missing = [n for n in wanted if n not in index]
    if missing:
        raise ValueError(f"the saved outer optimizer state lacks parameter(s) {missing[:5]}")
    selected = {
        j: state["state"][index[n]] for j, n in enumerate(wanted) if index[n] in state["state"]
    }
    group["params"] = list(range(len(wanted)))
    return {"state": selected, "param_groups": [group]}
