"""One verdict per model-sharded island, agreed over the island's group.

Under FSDP islands each peer group sees one shard of every contribution. A contribution counts
only if every shard of it arrived and is finite (a ``MIN`` of flags); its norm is the
island-wide one; a last flag says whether every peer group got as far as validating, so that no
shard moves unless all do. Every rank calls ``agree`` once per round, failures included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

# (every shard arrived and is finite, the sum of squares of its values)
IslandMeasure = tuple[bool, float]


def agree(
    measures: Mapping[int, IslandMeasure] | None, num_islands: int, group: dist.ProcessGroup
) -> tuple[bool, list[IslandMeasure]]:
    """Combine this rank's ``measures`` (island -> finite, sum of squares) with the
    other shards' (collective over ``group``).

    ``None`` means this rank's peer group failed before validating. An island missing from
    ``measures`` (its payload was refused or never arrived) counts as not finite.

    Returns:
        Whether every peer group validated, and per island (finite everywhere, island norm).
    """
    flags = torch.zeros(num_islands + 1, dtype=torch.float64)
    sums = torch.zeros(num_islands, dtype=torch.float64)
    if measures is not None:
        flags[num_islands] = 1.0
        for island, (finite, sum_sq) in measures.items():
            flags[island] = 1.0 if finite else 0.0
            sums[island] = sum_sq
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    islands = [(bool(flags[i] == 1.0), math.sqrt(float(sums[i]))) for i in range(num_islands)]
    return bool(flags[num_islands] == 1.0), islands


def island_all(flags: list[bool], group: dist.ProcessGroup | None) -> list[bool]:
    """Each of ``flags`` ANDed over the island's ranks (collective over ``group``): the sharded
    aggregator's peer groups take every decision of a round together, so no shard of an island
    moves unless all do. ``None`` (an island of one rank per peer group) returns ``flags``."""
    if group is None:
        return flags
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(v == 1.0) for v in t]


def elsewhere_message(round_index: int, what: str) -> str:
    """What a rank raises when another peer group of its model-sharded island failed."""
    return (
        f"swarm round {round_index}: {what} in another shard's peer group of this model-sharded "
        "island (its ranks' logs say why). Anchors are unchanged."
    )
