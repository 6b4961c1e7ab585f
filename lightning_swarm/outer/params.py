"""Which of an optimizer's parameters the outer loop holds, and the checks that keep it so.

Every floating parameter an optimizer trains gets an anchor, except (``frozen_params="exclude"``)
one frozen at setup. Invariant: a left-out parameter never trains (``ParameterWatch.check``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_swarm.algorithm.model_layout import Layout, param_layout
from lightning_swarm.errors import SwarmConfigError


def trained_params(
    optimizer: Optimizer,
    names: Mapping[int, str],
    index: int,
    seen: set[int],
    *,
    frozen: dict[str, torch.nn.Parameter] | None = None,
    layout: Layout | None = None,
) -> dict[str, torch.nn.Parameter]:
    """The parameters ``optimizer`` holds, by module name, in a rank-independent order (a
    DTensor as its ``local_shard``). With ``frozen`` given, frozen ones go there instead; with
    ``layout`` given, each returned parameter's layout (its slice of a DTensor) goes there."""
    params: dict[str, torch.nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.is_floating_point():
                continue
            if id(p) in seen:
                raise SwarmConfigError(
                    f"a parameter of optimizer {index} is also trained by another optimizer; "
                    "SwarmStrategy keeps one anchor per parameter, so give each parameter to "
                    "exactly one optimizer."
                )
            seen.add(id(p))
            name = names.get(id(p), f"optimizer{index}.param{len(params)}")
            if frozen is not None and not p.requires_grad:
                frozen[name] = p
            else:
                check_tensor_parallel_split(name, p)
                params[name] = local_shard(p)
                if layout is not None:
                    layout[name] = param_layout(p)
    return params


def check_tensor_parallel_split(name: str, param: torch.Tensor) -> None:
    """Refuse a parameter that tensor parallel splits unevenly (torch fails on it later, inside
    a collective, naming no parameter): the layout of such a split is not mapped here."""
    if not isinstance(param, DTensor):
        return
    mesh = param.device_mesh
    for axis, placement in enumerate(param.placements):
        names = mesh.mesh_dim_names or ()
        if not placement.is_shard() or axis >= len(names) or names[axis] != "tensor_parallel":
            continue
        dim = placement.dim  # type: ignore[attr-defined]
        size, ways = int(param.shape[dim]), int(mesh.size(axis))
        if size % ways:
            raise SwarmConfigError(
                f"parameter {name!r} of shape {tuple(param.shape)} is split along dim {dim} "
                f"over tensor_parallel_size={ways}, which does not divide its {size}; such a "
                "split cannot be mapped. Choose sizes the tensor-parallel degree divides, or "
                "another tensor_parallel_size, or leave that layer out of the parallel plan."
            )


@torch.no_grad()
def local_shard(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """``param`` itself, or for a DTensor its local shard: under ``no_grad`` an alias of the
    same storage (reads see the inner steps, writes reach the module); it may be empty."""
    if isinstance(param, DTensor):
        return cast(torch.nn.Parameter, param.to_local())
    return param


class ParameterWatch:
    """What each optimizer held at setup, checked before every inner step."""

    def __init__(
        self, optimizers: Sequence[Optimizer], frozen: Mapping[str, torch.nn.Parameter]
    ) -> None:
        self._counts = {id(opt): _num_params(opt) for opt in optimizers}
        self._frozen = dict(frozen)

    def check(self, optimizer: Optimizer) -> None:
        expected = self._counts.get(id(optimizer))
        if expected is not None and _num_params(optimizer) != expected:
            raise SwarmConfigError(
                f"an optimizer gained or lost parameters after setup ({expected} at setup, "
                f"{_num_params(optimizer)} now), e.g. through add_param_group (as "
                "BackboneFinetuning does); SwarmStrategy anchors every parameter at setup, so "
                "give the optimizer all parameters from the start and freeze them with "
                "requires_grad=False instead (with frozen_params='sync' to unfreeze them later)."
            )
        thawed = [name for name, p in self._frozen.items() if p.requires_grad]
        if thawed:
            raise SwarmConfigError(
                f"parameter(s) {thawed[:5]} were frozen (requires_grad=False) at setup and left "
                "out of the outer loop (frozen_params='exclude'), and now require gradients: "
                "they would train on every island and never be synced. Set "
                "frozen_params='sync' (strategy.frozen_params=sync) to keep frozen parameters "
                "in the outer loop so they can be unfrozen mid-run."
            )


def _num_params(optimizer: Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)
