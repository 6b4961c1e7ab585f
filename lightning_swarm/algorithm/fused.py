"""One-pass pseudo-gradients: ``anchor - local`` in float32 into a reused buffer, with its norm.

Each anchor and local is read once and the difference written into a slice of a caller-owned
flat buffer, so no full-size pseudo-gradient is allocated. The float32 sum of squares doubles as
the finiteness check (a non-finite sum means a non-finite value or divergence).

Ownership: ``out`` is the caller's and is overwritten; ``anchor`` and ``local`` are only read. The
norm is a new 0-d tensor on ``out``'s device, with no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pseudo_gradient_into(anchor: Tensor, local: Tensor, out: Tensor) -> None:
    """Write ``anchor - local`` in float32 into ``out`` (all three of the same numel).

    The subtraction promotes both operands to float32 element by element, which gives the
    same bits as ``anchor.float() - local.float()`` without the two temporaries.
    """
    if anchor.numel() != local.numel() or out.numel() != local.numel():
        raise ValueError(
            f"pseudo_gradient_into: anchor ({anchor.numel()}), local ({local.numel()}) and out "
            f"({out.numel()}) must have the same number of elements"
        )
    if out.dtype != torch.float32:
        raise ValueError(f"pseudo_gradient_into writes float32, got an out of {out.dtype}")
    torch.sub(anchor.reshape(-1), local.detach().reshape(-1), out=out.view(-1))


def sum_of_squares(flat: Tensor) -> Tensor:
    """Sum of squares of ``flat`` accumulated in float32 (a 0-d tensor on its device)."""
    return torch.linalg.vector_norm(flat, dtype=torch.float32).square()


def max_abs(tensors: list[Tensor]) -> Tensor:
    """The largest magnitude over ``tensors`` as a 0-d float32 tensor: not finite iff one value is.

    A min/max reduction needs no float64 copy and, unlike a sum of squares, cannot overflow for
    finite inputs, so it answers "is every value finite" exactly; NaN propagates through it.
    ``aminmax`` is used because it is vectorized on the CPU, where the infinity norm is not.
    """
    extremes = []
    for t in tensors:
        if t.numel():
            low, high = torch.aminmax(t.detach())
            extremes += [high.to(torch.float32), -low.to(torch.float32)]
    if not extremes:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(extremes).max()
