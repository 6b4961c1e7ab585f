"""Agreement on whether every island's pseudo-gradient is finite, before any payload moves.

A diverged island must neither poison every anchor through a mean nor leave its peers blocked
while it alone raises. One tiny exchange of a flag per round (``transport.agree`` over
``flags_over``, an all-gather, or ``flags_direct``, one byte per peer in one step) lets every
rank raise the same error, naming the islands at fault.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_swarm.algorithm.budget import scale_of
from lightning_swarm.transport.agree import agree, flags_direct, flags_over
from lightning_swarm.transport.base import Opening, Work
from lightning_swarm.transport.errors import BadWorkError, NonFinitePseudoGradientError


def island_verdict(
    local: bool, island_group: dist.ProcessGroup | None, device: torch.device
) -> bool:
    """One finite verdict for a model-sharded island (its ranks hold different shards), so
    that every peer group of the island raises or proceeds together; ``local`` unchanged
    without an island group. Collective over ``island_group``."""
    if island_group is None:
        return local
    gather = flags_over(island_group, dist.get_world_size(island_group), device)
    return agree(local, gather=gather).all_ok


def agree_finite(
    local: bool,
    group: dist.ProcessGroup | None,
    num_islands: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
    *,
    direct: bool = False,
    work: Work | None = None,
    island_index: int = 0,
) -> Opening:
    """Raise ``NonFinitePseudoGradientError`` on every rank unless every island's ``local``
    verdict is true. Collective over the peer group (ordered by island); with one island only
    the local verdict counts. With ``island_group`` the island agrees on one verdict first
    (``island_verdict``).

    ``direct``: one step (``agree.flags_direct``: straight to every peer instead of around a
    ring), so over long-latency links the vote costs one message time whatever the number of
    islands. ``work`` (a time-budgeted round): each island's rides in the same message as its
    flag; the returned ``Opening`` weighs island ``island_index`` (``budget.scale_of``) and
    carries the most inner steps of any island. Without it the ``Opening`` is the default.

    Raises:
        NonFinitePseudoGradientError: some island is not finite, on every rank.
        BadWorkError: some island's work is malformed (``checked_work``), on every rank.
    """
    local = island_verdict(local, island_group, device)
    flags = flags_direct if direct else flags_over
    values = () if work is None else (float(work.steps), float(work.inner_steps))
    agreed = agree(local, gather=flags(group, num_islands, device), values=values)
    if bad := list(agreed.bad):
        raise NonFinitePseudoGradientError(
            f"the pseudo-gradient of island(s) {bad} holds NaN or inf, so the outer step was "
            "not taken on any island (anchors unchanged): that island's training diverged; check "
            "its loss for NaN, lower the inner learning rate or enable gradient clipping, then "
            "resume from the last checkpoint."
        )
    if work is None:
        return Opening()
    weights, swarm_steps = checked_work([(v[0], v[1]) for v in agreed.values])
    return Opening(scale=scale_of(weights, island_index), swarm_steps=swarm_steps)


def checked_work(
    rows: Sequence[tuple[float, float]], names: Sequence[str] | None = None
) -> tuple[list[float], int]:
    """Every island's weight and the swarm's most inner steps, from the ``(Work.steps,
    Work.inner_steps)`` each island sent (untrusted: a peer's bytes).

    ``names`` says how the message names each row's sender (``island i`` by default).

    Raises:
        BadWorkError: some row is not a pair of finite whole numbers with ``steps >= 1`` and
            ``inner_steps >= steps``; the message names the first such sender. Every rank
            that reads the same rows raises the same error.
    """
    for i, (steps, inner) in enumerate(rows):
        if not (_whole(steps) and _whole(inner) and 1 <= steps <= inner):
            who = names[i] if names is not None else f"island {i}"
            raise BadWorkError(
                f"{who} sent the weight {steps!r} (inner steps since the last round) with "
                f"{inner!r} inner steps in all; a weight must be a whole number >= 1 and at "
                "most its inner steps, so the round was not run on any island (anchors "
                "unchanged). That island runs a different or modified lightning_swarm: run "
                "the same version with the same sync_every_s on every island."
            )
    return [float(steps) for steps, _ in rows], int(max(inner for _, inner in rows))


def _whole(value: float) -> bool:
    return math.isfinite(value) and value == math.floor(value)
