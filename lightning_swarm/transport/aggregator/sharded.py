"""Sharded swarm transport: every island owns 1/n of every payload, so no island's load grows
with the number of islands.

The round is ``swarm_round``'s; here shard j is a run of elements cut on codec blocks
(``shards.plan_shards``). Every owner validates and aggregates its shard of every contribution;
``max_norm`` judges the whole contribution (the shards' sums of squares are all-gathered), and
results are bitwise the rotating transport's (the same operations, in the same order, per
element). Unlike the rotating transport, an island whose layout or swarm options differ from
island 0's makes every island raise ``ValueError``: shard boundaries and collectives follow
from them. ``mean`` / ``weighted_mean`` without a codec or ``max_norm`` are summed as the chunks
arrive (``shard_fold``): no spool, unless a non-finite sum makes the round judged again.

Bytes per rank: about 2 (n - 1) / n payloads each way, flat in n (``docs/swarm_transport.md``).
"""

from __future__ import annotations

import lightning_swarm.profiling as labels
from lightning_swarm.transport.aggregator.coded import CodedPayload
from lightning_swarm.transport.aggregator.shards import Shard, plan_shards
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.payload import PayloadLayout

__all__ = ["ShardedAggregatorTransport"]


class ShardedAggregatorTransport(SwarmAggregator):
    """Sharded swarm transport; see the module docstring. Takes the rotating transport's
    arguments (``AggregatorTransport``) and honours them the same way."""

    ROUND_LABEL = labels.SHARDED_ROUND

    def _shards(self, layout: PayloadLayout, round_index: int) -> tuple[list[Shard], int | None]:
        align = CodedPayload(layout, self.codec).align if self.codec is not None else 1
        return plan_shards(layout, self.num_islands, align), None
