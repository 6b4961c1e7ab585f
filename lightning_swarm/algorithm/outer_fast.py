"""Functional outer steps over flat slices, for the outer optimizers people use.

A bucketed round cannot call ``optimizer.step()``, so for ``SGD`` and ``Adam`` / ``AdamW`` this
module repeats torch's single-tensor update on a flat slice, same operations in the same order,
with state in torch's format: either path may take over at any round or checkpoint, and a slice
gets the bits of the whole tensor. Anything else: ``fast_outer_kind`` returns ``None``. The caller
owns the slices; anchor and state slices are written in place, the gradient slice is scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

FastKind = Literal["sgd", "adam"]


def fast_outer_kind(optimizer: torch.optim.Optimizer) -> FastKind | None:
    """``"sgd"`` or ``"adam"`` when every group can take the functional step, else ``None``."""
    kind: FastKind
    numbers: tuple[str, ...]
    if type(optimizer) is torch.optim.SGD:
        kind = "sgd"
        numbers = ("lr", "momentum", "dampening", "weight_decay")
    elif type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        kind = "adam"
        numbers = ("lr", "eps", "weight_decay")
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
    the memory, e.g. pinned). A fresh SGD momentum buffer must be *set* to the first gradient
    (torch clones it), so the caller needs to know; Adam's moments start at zero.
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


def sgd_step_(
    anchor: Tensor, grad: Tensor, buf: Tensor | None, group: dict[str, Any], *, fresh: bool
) -> None:
    """torch.optim.SGD's single-tensor update on one flat slice (``buf`` None without momentum).

    ``fresh``: the momentum buffer was just created and takes the gradient as it is. ``grad`` is
    overwritten (scratch).
    """
    if group["maximize"]:
        grad = -grad
    weight_decay, momentum = group["weight_decay"], group["momentum"]
    if weight_decay != 0:
        grad = grad.add_(anchor, alpha=weight_decay)
    if momentum != 0:
        assert buf is not None, "SGD with momentum needs its buffer"
        if fresh:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
        grad = grad.add_(buf, alpha=momentum) if group["nesterov"] else buf
    anchor.add_(grad, alpha=-group["lr"])


def adam_step_(
    anchor: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    group: dict[str, Any],
    *,
    step: float,
) -> None:
    """torch.optim.Adam/AdamW's single-tensor update on one flat slice at (1-based) ``step``.

    The caller increments the parameter's ``state["step"]`` once per round and passes its value
    for every slice of that parameter. ``grad`` is overwritten (scratch).
    """
    if group["maximize"]:
        grad = -grad
    lr, weight_decay = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    if weight_decay != 0:
        if group["decoupled_weight_decay"]:
            anchor.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add_(anchor, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    # The gradient is spent: its slice holds the denominator (torch allocates two temporaries).
    denom = torch.sqrt(exp_avg_sq, out=grad).div_(bias_correction2_sqrt).add_(group["eps"])
    anchor.addcdiv_(exp_avg, denom, value=-step_size)
