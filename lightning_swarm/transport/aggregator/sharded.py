"""The swarm transport with every island owning 1/n of every payload (``aggregator="sharded"``).

No island's load grows with the number of islands. The round is ``swarm_round``'s with shards cut
on codec blocks; ``max_norm`` judges the whole contribution and results are bitwise the rotating
transport's. An island whose layout or options differ from island 0's makes every island raise
``ValueError``. ``mean`` / ``weighted_mean`` without codec or ``max_norm`` are summed as the
chunks arrive (``fold``).
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
