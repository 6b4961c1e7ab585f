"""Restarting an island whose contribution was rejected for NaN or inf (swarm transport).

The swarm transport leaves a non-finite contribution out of the mean and still sends the
round's result to its island, so the island's parameters get the new anchors back at the merge.
Its inner optimizer state does not: AdamW's moments hold NaN and turn every later step NaN, and
the island would be rejected in every round to come, training for nothing. ``reset_island``
therefore, after such a round (applied, or skipped for too few contributions: then the
anchors it restarts from are the unchanged ones):

- overwrites every parameter of the island with the anchors (all fragments; sharded, each rank
  writes its own share and the island gathers the rest), whatever ``merge_alpha`` mixed in;
- forgets the island's error-feedback residuals and clears its inner optimizer's state (the
  optimizer starts again as at step 0, with its hyper-parameters and schedule unchanged);
- warns, once per reset.

Sharded, the ranks of an island exchange different shares and may see different verdicts; they
agree first (a max over the island's group), so the whole island resets or none of it does.
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
