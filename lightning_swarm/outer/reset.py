"""Restarting an island whose contribution was rejected for NaN or inf (swarm transport).

The island gets the anchors back at the merge, but its inner optimizer state stays NaN and would
poison every later step. ``reset_island`` overwrites every parameter with the anchors, forgets the
residuals, clears the inner optimizer's state (hyper-parameters and schedule kept) and warns.
Sharded, the island agrees first, so it resets whole or not at all.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.sync import OuterSync


def island_must_reset(report: SyncReport, island_group: dist.ProcessGroup | None) -> bool:
    """Whether any rank of this island saw its own contribution rejected as non-finite.

    Collective over ``island_group`` when given (every rank of the island calls it after the
    same round).
    """
    # Also after a skipped round: the anchors did not move, and they are still finite.
    flag = report.rejected_own
    if island_group is None or dist.get_world_size(island_group) == 1:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=island_group)
    return bool(value.item())


def reset_island(outer: OuterSync, optimizer: Optimizer, round_index: int) -> None:
    """Put the anchors into the island's parameters and clear its inner optimizer state."""
    outer.reset_to_anchors()
    optimizer.state.clear()
    warnings.warn(
        f"swarm round {round_index}: this island's pseudo-gradient held NaN or inf and was left "
        "out of the mean; the island restarts from the new anchors with its inner optimizer "
        f"state ({type(optimizer).__name__}) cleared, so it trains again from the next step. "
        "swarm/islands_reset counts these resets; frequent ones mean the inner learning rate "
        "is too high or the data holds bad values.",
        RuntimeWarning,
        stacklevel=3,
    )
