"""Outer steps on low-precision anchors, done in float32.

On bfloat16 anchors an update under half a step would round away every round and training would
stall. So the step runs on float32 copies with float32 state, and is written back with stochastic
rounding (unbiased). The caller seeds the noise with a value all islands share, so every rank
stores identical anchors and a resume repeats it. float16 rounds to nearest; float32 skips this.
The working copies live only during ``float32_outer_step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def stochastic_round_to_bf16(x: Tensor, generator: torch.Generator) -> Tensor:
    """Round float32 ``x`` to bfloat16, up or down with probability given by the distance.

    bfloat16 keeps the top 16 bits of a float32; adding uniform noise below them and then
    clearing them rounds away from zero with probability equal to the dropped fraction.
    Integer addition on the bit pattern is what makes this work for both signs.
    """
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, generator=generator, device=bits.device, dtype=torch.int32
    )
    # In place on the noise: one int32 temporary per element besides the result, which bounds
    # the streamed round's GPU working set (lightning_swarm.outer.staging).
    rounded = noise.add_(bits).bitwise_and_(-65536)  # clear the 16 low bits (0xFFFF0000)
    return rounded.view(torch.float32).to(torch.bfloat16)


def float32_outer_step(
    optimizer: torch.optim.Optimizer,
    anchors: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    seed: int,
) -> None:
    """One optimizer step over low-precision ``anchors``, computed in float32.

    Each anchor is swapped for a float32 copy inside the optimizer (parameter list and state),
    stepped, written back (stochastically rounded for bfloat16), and swapped back. The state
    is converted to float32 on first use and stays float32.
    """
    slots = _param_slots(optimizer)
    swapped: list[tuple[Tensor, Tensor]] = []
    for anchor, grad in zip(anchors, grads, strict=True):
        work = anchor.detach().to(torch.float32)
        work.grad = grad.to(device=work.device, dtype=torch.float32)
        _swap(optimizer, slots, anchor, work)
        swapped.append((anchor, work))
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


def keep_state_float32(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """After ``optimizer.load_state_dict(saved)``, restore float32 state of low-precision params.

    ``load_state_dict`` casts floating state to each parameter's dtype; for bfloat16 anchors
    that would round the float32 momentum saved by ``float32_outer_step`` and break an exact
    resume. The saved values are copied back in float32.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in saved.get("state", {}).items():
        param = params[int(index)]
        if param.dtype == torch.float32:
            continue
        for key, value in state.items():
            if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
                optimizer.state[param][key] = value.to(param.device, torch.float32, copy=True)


def _param_slots(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    return {
        id(p): (g, i)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    }


def _swap(
    optimizer: torch.optim.Optimizer,
    slots: dict[int, tuple[int, int]],
    old: Tensor,
    new: Tensor,
) -> None:
    """Put ``new`` where ``old`` is in the optimizer's parameter list and state."""
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
