"""DiLoCo's outer update (arXiv 2311.08105), as small functions over tensors.

*anchor*: the global parameter as of the last sync; *local*: the island's after its inner steps;
*pseudo-gradient*: ``anchor - local``, in float32. Functions mutate only what they name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def pseudo_gradient(anchor: Tensor, local: Tensor) -> Tensor:
    """Return ``anchor - local`` as a new float32 tensor on the anchor's device."""
    if anchor.shape != local.shape:
        raise ValueError(
            f"anchor shape {tuple(anchor.shape)} != local shape {tuple(local.shape)}; "
            "anchors must be built from the same parameters the optimizer trains."
        )
    local_f32 = local.detach().to(device=anchor.device, dtype=torch.float32)
    return anchor.to(torch.float32) - local_f32


def pseudo_gradient_into(anchor: Tensor, local: Tensor, out: Tensor) -> None:
    """Write ``anchor - local`` in float32 into the caller's ``out`` (all of one numel): the
    bits of ``pseudo_gradient`` without its temporaries."""
    if anchor.numel() != local.numel() or out.numel() != local.numel():
        raise ValueError(
            f"pseudo_gradient_into: anchor ({anchor.numel()}), local ({local.numel()}) and out "
            f"({out.numel()}) must have the same number of elements"
        )
    if out.dtype != torch.float32:
        raise ValueError(f"pseudo_gradient_into writes float32, got an out of {out.dtype}")
    torch.sub(anchor.reshape(-1), local.detach().reshape(-1), out=out.view(-1))


def sum_of_squares(flat: Tensor) -> Tensor:
    """Sum of squares of ``flat`` in float32, a 0-d tensor on its device (no host sync); not
    finite when a value is not."""
    return torch.linalg.vector_norm(flat, dtype=torch.float32).square()


def max_abs(tensors: list[Tensor]) -> Tensor:
    """The largest magnitude over ``tensors`` as a 0-d float32 tensor: not finite iff one value
    is (unlike a sum of squares it cannot overflow for finite inputs)."""
    extremes = []
    for t in tensors:
        if t.numel():
            low, high = torch.aminmax(t.detach())  # vectorized on the CPU; the inf-norm is not
            extremes += [high.to(torch.float32), -low.to(torch.float32)]
    if not extremes:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(extremes).max()


def global_norm(tensors: Sequence[Tensor]) -> float:
    """L2 norm of all tensors taken together (each tensor's norm in float32)."""
    norms = (float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)) for t in tensors)
    return sum(n**2 for n in norms) ** 0.5


def outer_step(
    optimizer: torch.optim.Optimizer,
    anchors: Sequence[Tensor],
    averaged: Sequence[Tensor],
    *,
    seed: int = 0,
) -> None:
    """Step the outer optimizer on ``anchors`` with ``averaged`` pseudo-gradients as gradients.

    ``anchors`` must be tensors the outer optimizer was built over. The gradients are released
    after the step, so no pseudo-gradient stays resident between syncs. A low-precision anchor
    is swapped for a float32 copy inside the optimizer (parameters and state, which stays
    float32) for the step, then written back, stochastically rounded with ``seed`` (the same on
    every island) for bfloat16.
    """
    if len(anchors) != len(averaged):
        raise ValueError(f"{len(anchors)} anchors but {len(averaged)} pseudo-gradients")
    slots = {
        id(p): (g, i)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    }
    swapped: list[tuple[Tensor, Tensor]] = []
    for anchor, delta in zip(anchors, averaged, strict=True):
        work = anchor
        if anchor.dtype != torch.float32:
            work = anchor.detach().to(torch.float32)
            _swap(optimizer, slots, anchor, work)
            swapped.append((anchor, work))
        work.grad = delta.to(dtype=torch.float32, device=work.device)
    try:
        optimizer.step()
    finally:
        generator = None
        for anchor, work in swapped:
            with torch.no_grad():
                if anchor.dtype == torch.bfloat16:
                    if generator is None:
                        generator = torch.Generator(device=anchor.device).manual_seed(seed)
                    anchor.copy_(stochastic_round_to_bf16(work, generator))
                else:
                    anchor.copy_(work)
            work.grad = None
            _swap(optimizer, slots, work, anchor)
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def merge_into_local(local: Tensor, anchor: Tensor, alpha: float = 0.0) -> None:
    """Overwrite ``local`` with ``(1 - alpha) * anchor + alpha * local``: 0 is plain DiLoCo,
    more keeps part of the island's progress (Streaming DiLoCo)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge alpha must lie in [0, 1], got {alpha}")
    incoming = anchor.to(device=local.device, dtype=local.dtype)
    if alpha == 0.0:
        local.copy_(incoming)
    else:
        local.lerp_(incoming, 1.0 - alpha)


@torch.no_grad()
def catch_up_(local: Tensor, anchor_old: Tensor, global_new: Tensor) -> None:
    """Rebase an island that resumes from an older round: ``local <- global_new + (local -
    anchor_old)``, computed in float32, so its progress is kept without dragging the new
    anchors back. Raises ``ValueError`` unless the three share one shape."""
    if not local.shape == anchor_old.shape == global_new.shape:
        raise ValueError(
            f"catch-up needs one shape, got local {tuple(local.shape)}, old anchor "
            f"{tuple(anchor_old.shape)}, new anchor {tuple(global_new.shape)}"
        )
    progress = local.to(torch.float32) - anchor_old.to(device=local.device, dtype=torch.float32)
    progress += global_new.to(device=local.device, dtype=torch.float32)
    local.copy_(progress)


def stochastic_round_to_bf16(x: Tensor, generator: torch.Generator) -> Tensor:
    """Round float32 ``x`` to bfloat16, up or down with probability given by the distance:
    uniform noise added to the 16 bits bfloat16 drops (as integers, so for both signs)."""
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, generator=generator, device=bits.device, dtype=torch.int32
    )
    # In place on the noise: one int32 temporary per element besides the result, which bounds
    # the streamed round's GPU working set (lightning_swarm.outer.staging).
    rounded = noise.add_(bits).bitwise_and_(-65536)  # clear the 16 low bits (0xFFFF0000)
    return rounded.view(torch.float32).to(torch.bfloat16)


def keep_state_float32(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """After ``optimizer.load_state_dict(saved)``, which casts state to each parameter's dtype,
    copy the saved float32 state of low-precision params back (an exact resume needs it)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in saved.get("state", {}).items():
        param = params[int(index)]
        if param.dtype == torch.float32:
            continue
        for key, value in state.items():
            if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
                optimizer.state[param][key] = value.to(param.device, torch.float32, copy=True)


def _swap(
    optimizer: torch.optim.Optimizer, slots: dict[int, tuple[int, int]], old: Tensor, new: Tensor
) -> None:
    g, i = slots.pop(id(old))
    optimizer.param_groups[g]["params"][i] = new
    slots[id(new)] = (g, i)
    if old in optimizer.state:
        state = optimizer.state.pop(old)
        optimizer.state[new] = {
            k: v.to(torch.float32)
            if isinstance(v, Tensor) and v.is_floating_point() and k != "step"
            else v
            for k, v in state.items()
        }
