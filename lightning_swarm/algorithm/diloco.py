"""DiLoCo's outer update (arXiv 2311.08105), as small functions over tensors.

The *anchor* is the global parameter as of the last outer sync, *local* the island's parameter
after its inner steps, the *pseudo-gradient* ``anchor - local``: outer SGD with lr=1 lands on the
mean of the locals. Functions return new tensors or mutate only the arguments they name.
Pseudo-gradients are float32 whatever the dtypes, so bfloat16 anchors keep small differences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_swarm.algorithm.precision import float32_outer_step


def pseudo_gradient(anchor: Tensor, local: Tensor) -> Tensor:
    """Return ``anchor - local`` as a new float32 tensor on the anchor's device.

    ``local`` may live on an accelerator; it is copied to the anchor's device first. Neither
    argument is modified; the caller owns the result.
    """
    if anchor.shape != local.shape:
        raise ValueError(
            f"anchor shape {tuple(anchor.shape)} != local shape {tuple(local.shape)}; "
            "anchors must be built from the same parameters the optimizer trains."
        )
    local_f32 = local.detach().to(device=anchor.device, dtype=torch.float32)
    return anchor.to(torch.float32) - local_f32


def outer_step(
    optimizer: torch.optim.Optimizer,
    anchors: Sequence[Tensor],
    averaged: Sequence[Tensor],
    *,
    seed: int = 0,
) -> None:
    """Step the outer optimizer on ``anchors`` with ``averaged`` pseudo-gradients as gradients.

    ``anchors`` must be tensors the outer optimizer was built over. The gradients are installed
    only for the duration of the step and released afterwards (``grad = None``), so between
    syncs no pseudo-gradient memory stays resident. Low-precision anchors are stepped in
    float32 and written back with stochastic rounding seeded by ``seed``, which must be the
    same on every island (``lightning_swarm.algorithm.precision``).
    """
    if len(anchors) != len(averaged):
        raise ValueError(f"{len(anchors)} anchors but {len(averaged)} pseudo-gradients")
    if any(a.dtype != torch.float32 for a in anchors):
        float32_outer_step(optimizer, anchors, averaged, seed=seed)
        return
    for anchor, delta in zip(anchors, averaged, strict=True):
        anchor.grad = delta.to(dtype=anchor.dtype, device=anchor.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def merge_into_local(local: Tensor, anchor: Tensor, alpha: float = 0.0) -> None:
    """Overwrite ``local`` in place with ``(1 - alpha) * anchor + alpha * local``.

    ``alpha = 0`` is plain DiLoCo (local <- anchor); a positive alpha keeps part of the island's
    own progress (Streaming DiLoCo's mixing). The anchor is not modified.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge alpha must lie in [0, 1], got {alpha}")
    incoming = anchor.to(device=local.device, dtype=local.dtype)
    if alpha == 0.0:
        local.copy_(incoming)
    else:
        local.lerp_(incoming, 1.0 - alpha)


def global_norm(tensors: Sequence[Tensor]) -> float:
    """L2 norm of all tensors taken together: each tensor's norm in float32 (no float64 copy;
    the two-phase round's copies were half its time), the squares summed as Python floats."""
    return (
        sum(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)) ** 2 for t in tensors)
        ** 0.5
    )
