"""Sharded swarm transport: every island aggregates 1/n of every payload, so no island's load
grows with the number of islands.

The rotating aggregator (``rotating.AggregatorTransport``) takes n - 1 payloads in and sends
n - 1 out in one round. Here every island owns one shard of the payload (``shards``: a run of
elements cut on codec blocks) and aggregates it over all islands at once, with the same
validation and rules:

1. Layout check: a CRC of every island's wire layout is all-gathered; islands that differ from
   island 0's make every rank raise ``ValueError`` naming them (the rotating transport drops
   such an island and goes on; a sharded round cannot, since shard boundaries follow the
   layout).
2. Scatter: each island encodes (with a codec) and streams shard j of its payload to island j,
   in chunks of ``chunk_bytes`` per peer and step (``all_to_all_single``, so nothing blocks on
   a send nobody receives); one send and one receive buffer of n - 1 chunks.
3. Judge and aggregate, one of two ways (every rank takes the same, from what every rank knows):
   - ``mean`` / ``weighted_mean`` without a codec or ``max_norm``: each owner adds the chunks
     into a float32 sum of its shard as they arrive, in island order (``shard_fold``); nothing
     is spooled or read back. A finite sum proves every island's shard finite; one all-gather
     of (succeeded, finite) rows settles the round: all finite, every island is accepted and
     the mean is the round's result. If some owner's sum is not finite, the round is judged
     again the second way (a second scatter: the tensors are still untouched).
   - Otherwise the owner writes each peer's chunks into that peer's sink (a safetensors spool
     file with offload, memory without), reads its shard of every contribution back one block
     at a time (decoded with a codec) and reports per island whether it is finite and its sum
     of squares, plus whether its spool held. One all-gather of these rows gives every rank the
     same table and so the same verdicts (``shard_verdicts``): non-finite anywhere rejects the
     island; ``max_norm`` compares the *whole* contribution's norm (equal to the rotating
     transport's up to float64 rounding); ``min_contributions`` and ``weighted_mean``'s weights
     follow. Each owner then runs the rule over the accepted contributions of its shard, in
     island order, into its own tensors, and an all-gather of one flag tells every rank
     whether every owner succeeded. The rules are elementwise, so they keep their semantics.
4. Gather: each owner streams its shard's result (float32) to every island in chunks
   (all-to-all), and every island receives the other shards straight into its tensors. Results
   are bitwise the rotating transport's: the same operations on the same values in the same
   order, per element.

Model-sharded islands (``island_group``): each peer group (one shard position) runs this round
on its ranks' local shards, and every decision of the round (the layout check, summing or
spooling, the verdicts, success) is ANDed over the island's group (``island_verdicts``): an
island's contribution counts only if every shard of it is finite, ``max_norm`` bounds the
island's norm over all its shards, and no shard moves unless every peer group applies.

A spool that fails on any owner, or an exception while an owner aggregates (or sums), makes
every rank raise ``SwarmRoundError`` after the collectives of the round completed (anchors
unchanged); the owner whose aggregation raised re-raises its own exception. Any exception while
chunks are arriving aborts that rank's spool writers at once, and the round's files are removed
in every case (``Spool.release_round`` waits for leases).

Bytes per rank: the scatter sends sum_(j != me) of the shards' wire bytes and receives n - 1
contributions of its own shard; the gather sends its result shard (float) to n - 1 islands and
receives every other shard's: about 2 (n - 1) / n payloads each way, flat in n (a summed round
judged again scatters twice). The small all-gathers (layout CRC, verdict rows, flags) are
counted too. Memory per round: a summed mean holds one float32 shard (the payload / n);
otherwise the spool (or memory) holds n - 1 contributions of one shard, about the payload / n
each; buffers are (n - 1) chunks per direction and step.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.aggregator.coded import CodedPayload
from lightning_swarm.transport.aggregator.contributions import (
    Contribution,
    Sink,
    finish_sinks,
    measure,
    open_sinks,
)
from lightning_swarm.transport.aggregator.island_verdicts import elsewhere_message, island_all
from lightning_swarm.transport.aggregator.owners import SwarmAggregatorBase, join_own
from lightning_swarm.transport.aggregator.round_status import AggregatorOutcome, RoundReport
from lightning_swarm.transport.aggregator.shard_fold import ShardFold, folds
from lightning_swarm.transport.aggregator.shard_streams import ShardStreams
from lightning_swarm.transport.aggregator.shard_verdicts import raise_if_failed, read_verdicts
from lightning_swarm.transport.aggregator.shards import Shard, plan_shards
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadLayout, byte_view

log = logging.getLogger(__name__)


class ShardedAggregatorTransport(SwarmAggregatorBase):
    """Sharded swarm transport; see the module docstring. Takes the rotating transport's
    arguments (``AggregatorTransport``) and honours them the same way."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_islands: int,
        island_index: int,
        offload: bool = True,
        spool_dir: str | None = None,
        aggregation: str = "mean",
        trim_ratio: float = 0.0,
        min_contributions: int = 1,
        max_norm: float | None = None,
        island_weights: Sequence[float] | None = None,
        chunk_bytes: int = 4 * 2**20,
        cleanup_timeout_s: float = 60.0,
        codec: Codec | None = None,
        spool: Spool | None = None,
        island_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            group,
            num_islands=num_islands,
            island_index=island_index,
            offload=offload,
            spool_dir=spool_dir,
            aggregation=aggregation,
            trim_ratio=trim_ratio,
            min_contributions=min_contributions,
            max_norm=max_norm,
            island_weights=island_weights,
            chunk_bytes=chunk_bytes,
            cleanup_timeout_s=cleanup_timeout_s,
            codec=codec,
            spool=spool,
        )
        self.island_group = island_group
        self._streams = ShardStreams(group, island_index, num_islands, chunk_bytes)

    @record_function(labels.SHARDED_ROUND)
    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        """Aggregate ``tensors`` across islands in place; collective over the peer group."""
        start = time.perf_counter()
        layout = PayloadLayout.from_tensors(tensors)
        targets = list(tensors.values())
        report = RoundReport(round_index, self.island_index)
        round_id = self._begin(report)
        if self.num_islands == 1:
            self._alone(report, CodedPayload(layout, self.codec) if self.codec else None, targets)
            return RoundStats(wall_s=time.perf_counter() - start)
        stats = RoundStats()
        align = CodedPayload(layout, self.codec).align if self.codec is not None else 1
        shards = plan_shards(layout, self.num_islands, align)
        # Decided on the whole layout, which every island agreed on: a shard's own dtypes
        # could send two islands different ways, and their collectives would not match.
        fold = self.codec is None and folds(
            layout, self.rule.aggregation, self.rule.max_norm, self.chunk_bytes
        )
        stats.bytes_sent = stats.bytes_received = self._agree_layout(shards, round_index)
        (fold,) = island_all([fold], self.island_group)  # every peer group the same way
        coded = [CodedPayload(s.layout, self.codec) if self.codec else None for s in shards]
        wires = [c.wire if c is not None else s.layout for c, s in zip(coded, shards, strict=True)]
        mine = shards[self.island_index]
        own = mine.views(targets)
        contributions: dict[int, Contribution] = {}
        sinks: dict[int, Sink] = {}
        try:
            settled = fold and self._fold_round(report, targets, shards, own, stats)
            if not settled:
                self._spooled_round(
                    report, targets, shards, coded, wires, own, round_id, sinks, contributions,
                    stats,
                )  # fmt: skip
            if report.outcome == AggregatorOutcome.APPLIED:
                with record_function(labels.RECEIVE):
                    views = [[byte_view(v) for v in s.views(targets)] for s in shards]
                    self._streams.gather(views, [s.layout for s in shards], stats)
        except BaseException:
            for sink in sinks.values():
                sink.abort()  # their leases go now: cleanup below does not wait for them
            raise
        finally:
            for c in contributions.values():
                c.close()
            if self._spool is not None:
                self._spool.release_round(round_id)
        stats.applied = report.outcome == AggregatorOutcome.APPLIED
        stats.wall_s = time.perf_counter() - start
        stats.non_finite_islands = tuple(report.non_finite)
        stats.rejected_own = self.island_index in report.non_finite
        return stats

    # -- the phases ------------------------------------------------------------------------
    def _all_gather(self, row: Tensor) -> list[Tensor]:
        """Every island's ``row`` (one small tensor each), in island order: one all-to-all
        step, where a ring all-gather would take n - 1 message times in sequence."""
        rows = torch.empty((self.num_islands, row.numel()), dtype=row.dtype)
        dist.all_to_all_single(rows, row.reshape(1, -1).expand(self.num_islands, -1).contiguous(),
                               group=self.group)  # fmt: skip
        return list(rows)

    def _agree_layout(self, shards: list[Shard], round_index: int) -> int:
        """Raise ``ValueError`` on every rank unless every island cut the same shards and
        runs the same rule in the same chunks (which decide the round's collectives)."""
        blob = b"".join(s.layout.to_json() for s in shards)
        blob += f"{self.codec!r} {self.rule!r} {self.chunk_bytes}".encode()
        crcs = self._all_gather(torch.tensor([zlib.crc32(blob)], dtype=torch.int64))
        odd = [i for i, c in enumerate(crcs) if int(c) != int(crcs[0])]
        (same,) = island_all([not odd], self.island_group)
        if not same and not odd:
            raise ValueError(elsewhere_message(round_index, "the layout or swarm options differ"))
        if odd:
            raise ValueError(
                f"swarm round: the pseudo-gradient layout (names, shapes, dtypes), codec or "
                f"swarm options of island(s) {odd} differs from island 0's; every island must "
                "train the same parameters with the same quantize, quantize_block_size and "
                "swarm options (aggregation, trim_ratio, min_contributions, max_norm, "
                "island_weights, chunk_mb)."
            )
        return 8 * (self.num_islands - 1)

    def _fold_round(
        self,
        report: RoundReport,
        targets: list[Tensor],
        shards: list[Shard],
        own: list[Tensor],
        stats: RoundStats,
    ) -> bool:
        """Sum the shard's contributions as they arrive (``shard_fold``), with no spool. True:
        every shard was finite, all are accepted and the mean is in ``own``; False: some sum was
        not, judge island by island (every rank reads the same table and returns the same)."""
        me, n = self.island_index, self.num_islands
        weights = self.rule.island_weights if self.rule.aggregation == "weighted_mean" else None
        fold = ShardFold(shards[me].layout, own, me, n, self.chunk_bytes, weights)
        with record_function(labels.SEND):
            sources = [[byte_view(t) for t in s.views(targets)] if j != me else []
                       for j, s in enumerate(shards)]  # fmt: skip
            wires = [s.layout for s in shards]
            finite, error = fold.collect(self._streams, sources, wires, stats)
        if error is not None:
            log.error("swarm round %d: summing this island's shard failed", report.round_index,
                      exc_info=error)  # fmt: skip
        row = torch.tensor([float(error is None), float(finite)], dtype=torch.float64)
        table = torch.stack(self._all_gather(row))
        _count_all_gather(stats, row, n)
        failed = [j for j in range(n) if table[j, 0] == 0.0]
        ok, finite = island_all([not failed, bool((table[:, 1] == 1.0).all())], self.island_group)
        raise_if_failed(report, error, failed, ok)
        if not finite:
            return False
        report.accepted = list(range(n))
        fold.write_into(own)
        return True

    def _spooled_round(
        self,
        report: RoundReport,
        targets: list[Tensor],
        shards: list[Shard],
        coded: list[CodedPayload | None],
        wires: list[PayloadLayout],
        own: list[Tensor],
        round_id: int,
        sinks: dict[int, Sink],
        contributions: dict[int, Contribution],
        stats: RoundStats,
    ) -> None:
        """Every rule: spool the shard's contributions, judge each island, aggregate."""
        failure = self._scatter(targets, shards, coded, wires, round_id, sinks, stats)
        failure = finish_sinks(sinks, contributions, failure)
        block_numel = join_own(
            contributions, self.island_index, own, coded[self.island_index], self.chunk_bytes
        )
        mine = shards[self.island_index]
        outcome = self._judge(report, mine, contributions, failure, block_numel, stats)
        if outcome == AggregatorOutcome.APPLIED:
            self._aggregate(report, mine, own, contributions, block_numel, stats)

    def _scatter(
        self,
        targets: list[Tensor],
        shards: list[Shard],
        coded: list[CodedPayload | None],
        wires: list[PayloadLayout],
        round_id: int,
        sinks: dict[int, Sink],
        stats: RoundStats,
    ) -> SpoolError | None:
        """Stream shard j of this island's payload to island j, and every peer's contribution
        to this island's shard into ``sinks``; returns the first spool error met."""
        me = self.island_index
        peers = [i for i in range(self.num_islands) if i != me]
        failure = open_sinks(
            sinks, peers, peers, wires[me], self._spool, round_id, remap_bytes=self.chunk_bytes
        )
        with record_function(labels.SEND):
            sources: list[list[Tensor]] = []
            for j, (shard, c) in enumerate(zip(shards, coded, strict=True)):
                views = shard.views(targets) if j != me else []
                encoded = c.encode(views) if c is not None and j != me else views
                sources.append([byte_view(t) for t in encoded])
            streamed = self._streams.scatter(sources, wires, sinks, stats)
        failure = failure or streamed
        if failure is not None:
            for sink in sinks.values():
                sink.abort()
        return failure

    def _judge(
        self,
        report: RoundReport,
        mine: Shard,
        contributions: dict[int, Contribution],
        failure: SpoolError | None,
        block_numel: int,
        stats: RoundStats,
    ) -> AggregatorOutcome:
        """The verdict table: every rank derives the same verdicts and outcome from it."""
        n = self.num_islands
        row = torch.zeros(1 + 2 * n, dtype=torch.float64)
        row[0] = 1.0 if failure is None else 0.0
        if failure is None:
            with record_function(labels.AGGREGATE):
                squares = self.rule.max_norm is not None
                for island, c in contributions.items():
                    found = measure(c, mine.layout, block_numel=block_numel, sum_sq=squares)
                    row[1 + island], row[1 + n + island] = float(found.finite), found.sum_sq
        table = torch.stack(self._all_gather(row))
        _count_all_gather(stats, row, n)
        return read_verdicts(
            table, self.rule, report, self.island_index, failure, self.island_group
        )

    def _aggregate(
        self,
        report: RoundReport,
        mine: Shard,
        own: list[Tensor],
        contributions: dict[int, Contribution],
        block_numel: int,
        stats: RoundStats,
    ) -> None:
        """The rule over this island's shard; then every rank learns whether every owner's
        aggregation succeeded."""
        error: Exception | None = None
        try:
            with record_function(labels.AGGREGATE):
                self.rule.aggregate(own, contributions, report.accepted, mine.layout, block_numel)
        except Exception as err:
            error = err
            log.exception(
                "swarm round %d: aggregating this island's shard failed", report.round_index
            )
        flag = torch.tensor([0 if error is not None else 1], dtype=torch.int64)
        flags = self._all_gather(flag)
        _count_all_gather(stats, flag, self.num_islands)
        failed = [j for j, f in enumerate(flags) if int(f) == 0]
        (ok,) = island_all([not failed], self.island_group)
        raise_if_failed(report, error, failed, ok)


def _count_all_gather(stats: RoundStats, row: Tensor, num_islands: int) -> None:
    moved = (num_islands - 1) * row.numel() * row.element_size()
    stats.bytes_sent += moved
    stats.bytes_received += moved
