"""One-pass pseudo-gradients: ``anchor - local`` in float32 into a reused buffer, with its norm.

The round's first pass reads each anchor and each local parameter once and writes the float32
difference straight into a slice of a caller-owned flat buffer (a transport bucket), so no
full-size pseudo-gradient is allocated per round. The sum of squares of what was written is
accumulated in float32, per bucket, from the same buffer while it is hot: there are no float64
copies and no separate finiteness pass, because a non-finite sum of squares means a non-finite
value (or, with float32 accumulation, a magnitude beyond 1.8e19, which is divergence anyway).

Ownership: ``out`` belongs to the caller and is overwritten; ``anchor`` and ``local`` are only
read. The returned scalar is a new 0-d float32 tensor on ``out``'s device (no host sync here, so
a GPU caller can keep its streams busy).
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
    ``aminmax`` is used because it is vectorized on the CPU (the infinity norm is measured ~20x
    slower there).
    """
    extremes = []
    for t in tensors:
        if t.numel():
            low, high = torch.aminmax(t.detach())
            extremes += [high.to(torch.float32), -low.to(torch.float32)]
    if not extremes:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(extremes).max()
