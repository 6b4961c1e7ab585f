"""The swarm transport's default: one owner per round, in turn.

Round ``r`` is owned by island ``r % num_islands`` (no message elects it): ``swarm_round`` with
the whole payload as the owner's shard. The owner spools every peer's payload as it arrives
(memory flat in peers), validates and aggregates block by block in island order, and streams the
result back in float32; its rule and chunk size rule the round (``terms``). A peer whose layout
or codec differs is left out and raises ``ValueError`` alone.
"""

from __future__ import annotations

from lightning_swarm.transport.aggregator.round_status import AggregatorOutcome, RoundReport
from lightning_swarm.transport.aggregator.shards import Shard, whole_shards
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.payload import PayloadLayout

__all__ = ["AggregatorOutcome", "AggregatorTransport", "RoundReport"]


class AggregatorTransport(SwarmAggregator):
    """Rotating-aggregator transport; see the module docstring.

    Args:
        group: the peer group (one rank per island, ordered by island); ``None`` = default.
            Payloads and messages live on the CPU: with NCCL as the default backend, pass a
            gloo peer group (``groups.build_groups(peer_backend="gloo")``).
        num_islands: size of the peer group.
        island_index: this rank's island.
        offload: spool peer payloads to disk (``True``) or hold them in memory.
        spool_dir: where the run's spool root is created (``None``: TMPDIR).
        aggregation: one of ``mean``, ``weighted_mean``, ``median``, ``trimmed_mean``.
        trim_ratio: fraction trimmed at each end by ``trimmed_mean``.
        min_contributions: accepted contributions (the owner's own included) a round needs.
        max_norm: reject a contribution whose L2 norm exceeds this; ``None`` = no bound.
        island_weights: one weight per island for ``weighted_mean``.
        chunk_bytes: bytes per message and the block size of validation and aggregation.
        cleanup_timeout_s: how long spool cleanup waits for in-flight writes and reads.
        codec: encode contributions with this codec (module docstring); ``None`` sends float32
            as is. Every island must pass the same codec.
        spool: an existing ``Spool`` to use instead of creating one (tests inject faults).
        island_group: a model-sharded island's group (CPU-capable, e.g. gloo): every verdict
            is agreed over the island's shards (``terms.agree_island``); ``None`` otherwise.

    Raises:
        ValueError: an option is out of range for this topology.
        SpoolError: the spool root cannot be created.
    """

    def aggregator_of(self, round_index: int) -> int:
        """The island that aggregates round ``round_index`` (round-robin)."""
        return round_index % self.num_islands

    def _shards(self, layout: PayloadLayout, round_index: int) -> tuple[list[Shard], int | None]:
        owner = self.aggregator_of(round_index)
        return whole_shards(layout, self.num_islands, owner), owner
