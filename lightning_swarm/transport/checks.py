"""Agreement on whether every island's pseudo-gradient is finite, before any payload moves.

A diverged island must neither poison every anchor through a mean nor leave its peers blocked
while it alone raises. One tiny exchange of a flag per round (``agree_finite``, an all-gather;
``agree_finite_direct``, one byte per peer in one step) lets every rank raise the same error,
naming the islands at fault.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.transport.errors import NonFinitePseudoGradientError


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


def island_verdict(
    local: bool, island_group: dist.ProcessGroup | None, device: torch.device
) -> bool:
    """One finite verdict for a model-sharded island (its ranks hold different shards), so
    that every peer group of the island raises or proceeds together; ``local`` unchanged
    without an island group. Collective over ``island_group``."""
    if island_group is None:
        return local
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=island_group)
    return bool(flag.item() == 1.0)


def agree_finite_flag(
    local: bool,
    group: dist.ProcessGroup | None,
    num_islands: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
) -> None:
    """``agree_finite`` for a verdict the caller already has (e.g. from a norm it computed)."""
    local = island_verdict(local, island_group, device)
    if num_islands > 1:
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        flags = [torch.empty_like(flag) for _ in range(num_islands)]
        dist.all_gather(flags, flag, group=group)
        bad = [i for i, f in enumerate(flags) if f.item() == 0.0]
    else:
        bad = [] if local else [0]
    _raise_if_any(bad)


def agree_finite_direct(
    tensors: Iterable[Tensor],
    group: dist.ProcessGroup | None,
    num_islands: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
) -> None:
    """``agree_finite`` in one step: every rank sends its one-byte verdict straight to every
    other (``all_to_all_single``) instead of around a ring (n - 1 steps in sequence), so over
    long-latency links the vote costs one message time whatever the number of islands. With
    ``island_group`` the island agrees on one verdict first (``island_verdict``)."""
    agree_finite_direct_flag(all_finite(tensors), group, num_islands, device, island_group)


def agree_finite_direct_flag(
    local: bool,
    group: dist.ProcessGroup | None,
    num_islands: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
) -> None:
    """``agree_finite_direct`` for a verdict the caller already has."""
    local = island_verdict(local, island_group, device)
    if num_islands <= 1:
        _raise_if_any([] if local else [0])
        return
    mine = torch.full((num_islands,), 1 if local else 0, dtype=torch.uint8, device=device)
    flags = torch.empty_like(mine)
    dist.all_to_all_single(flags, mine, group=group)
    _raise_if_any([i for i, f in enumerate(flags.tolist()) if f == 0])


def _raise_if_any(bad: list[int]) -> None:
    if bad:
        raise NonFinitePseudoGradientError(
            f"the pseudo-gradient of island(s) {bad} holds NaN or inf, so the outer step was not "
            "taken on any island (anchors unchanged): that island's training diverged; check its "
            "loss for NaN, lower the inner learning rate or enable gradient clipping, then resume "
            "from the last checkpoint."
        )
