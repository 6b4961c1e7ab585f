"""Agreement on whether every island's pseudo-gradient is finite, before any payload moves.

A diverged island (NaN or inf in its pseudo-gradient) must not poison the anchors of every
island through a mean, and must not leave its peers blocked in a collective while it alone
raises. One tiny all-gather of a flag per round lets every rank of the peer group raise the same
clear error, naming the islands at fault, before any payload is exchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.errors import SwarmError


class NonFinitePseudoGradientError(SwarmError, ValueError):
    """Some island's pseudo-gradient holds NaN or inf; the round was not run anywhere."""


def all_finite(tensors: Iterable[Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def agree_finite(
    tensors: Iterable[Tensor],
    group: dist.ProcessGroup | None,
    num_islands: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
) -> None:
    """Raise ``NonFinitePseudoGradientError`` on every rank if any island's tensors are not finite.

    Collective over the peer group (ordered by island). With one island only the local check
    runs. Costs one all-gather of ``num_islands`` floats. With ``island_group`` (model-sharded
    islands, whose ranks hold different shards) the island first agrees on one verdict, so that
    every peer group raises or proceeds together.
    """
    agree_finite_flag(all_finite(tensors), group, num_islands, device, island_group)


def agree_finite_flag(
    local: bool,
    group: dist.ProcessGroup | None,
    num_islands: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
) -> None:
    """``agree_finite`` for a verdict the caller already has (e.g. from a norm it computed)."""
    if island_group is not None:
        island_flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(island_flag, op=dist.ReduceOp.MIN, group=island_group)
        local = bool(island_flag.item() == 1.0)
    if num_islands > 1:
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        flags = [torch.empty_like(flag) for _ in range(num_islands)]
        dist.all_gather(flags, flag, group=group)
        bad = [i for i, f in enumerate(flags) if f.item() == 0.0]
    else:
        bad = [] if local else [0]
    if bad:
        raise NonFinitePseudoGradientError(
            f"the pseudo-gradient of island(s) {bad} holds NaN or inf, so the outer step was not "
            "taken on any island (anchors unchanged): that island's training diverged; check its "
            "loss for NaN, lower the inner learning rate or enable gradient clipping, then resume "
            "from the last checkpoint."
        )
