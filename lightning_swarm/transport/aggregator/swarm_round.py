"""The swarm transport's aggregator and its round: agree, scatter, judge, aggregate, gather.
Island j owns part j of a round's payload; every owner spools its part of the peers' payloads
as they arrive (memory flat in peers) and judges whole contributions, with bitwise the same
results whether one island owns all (``rotating``) or every island 1/n (``sharded``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.robust import check_aggregation, check_weights
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.transport.aggregator.contributions import (
    CodedPayload,
    Contribution,
    DecodedContribution,
    MemoryContribution,
    MemorySink,
    Sink,
    measure,
)
from lightning_swarm.transport.aggregator.exchange import Exchange, PartFold, folds
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.aggregator.terms import (
    AggregationRule,
    Part,
    RoundTerms,
    agree_owner,
    agree_parts,
    all_gather_rows,
    island_all,
    plan_parts,
    whole_part,
)
from lightning_swarm.transport.aggregator.verdicts import (
    FAILED,
    JUDGED,
    SPOOL_FAILED,
    RoundReport,
    raise_if_failed,
    read_verdicts,
)
from lightning_swarm.transport.base import Bucket, Handle, Opening, RoundRequest, RoundStats, Work
from lightning_swarm.transport.config import check_aggregator
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.link import LinkWatch
from lightning_swarm.transport.payload import PayloadMap, byte_view

log = logging.getLogger(__name__)


class _Round:
    """One round's state, handed from phase to phase; nothing outlives the round. Its spool
    files live from the scatter to its end: any exception aborts the writers (their leases go)
    and ``Spool.release_round`` removes the files."""

    def __init__(
        self, report: RoundReport, targets: list[Tensor], parts: list[Part], owner: int | None
    ) -> None:
        self.report, self.targets, self.parts, self.owner = report, targets, parts, owner
        self.terms: RoundTerms
        self.exchange: Exchange
        self.coded: list[CodedPayload | None] = []
        self.wires: list[PayloadMap] = []
        self.sinks: dict[int, Sink | None] = {}
        self.contributions: dict[int, Contribution] = {}
        self.stats = RoundStats()


class SwarmAggregator:
    """The swarm transport (``transport="swarm"``), whose options are
    ``SwarmTransportConfig``'s (``owners``: ``swarm.aggregator``; ``chunk_bytes``: ``chunk_mb``
    in bytes). It owns its ``Spool`` (created unless ``spool`` is injected) until ``close``.

    ``"rotating"`` gives the whole payload to island ``r % num_islands`` in round ``r``: its
    rule and chunk size rule the round, and a peer whose layout or codec differs is left out
    and raises alone. ``"sharded"`` cuts it on codec blocks: an island whose layout or options
    differ makes every island raise, and ``mean`` / ``weighted_mean`` without codec or
    ``max_norm`` are summed as the chunks arrive. Contributions are validated whole, so the
    round runs at the first ``wait`` (not pipelined), and writes the caller's buckets only once
    every island's verdicts are read (a round that raises may leave them partly written: the
    caller keeps its anchors). Payloads and messages live on the CPU: under NCCL, pass gloo
    groups (``group``: the peers, ordered by island; ``island_group``: a model-sharded
    island's ranks, which agree on every verdict). A collective that times out or loses its
    peer raises ``RoundTimeoutError`` or ``PeerLostError``, as the all-reduce does; the
    group keeps its own timeout.

    Raises:
        ValueError: an option is out of range for this topology.
        SpoolError: the spool root cannot be created.
    """

    # The whole payload is one round: buckets as large as the engine plans them.
    pipelined = False
    heals = False
    every_rank_in_round = False
    bucket_numel = 1 << 30

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_islands: int,
        island_index: int,
        owners: str = "rotating",
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
        if not 0 <= island_index < num_islands:
            raise ValueError(f"island_index {island_index} outside 0..{num_islands - 1}")
        if not 1 <= min_contributions <= num_islands:
            raise ValueError(
                f"min_contributions={min_contributions} must lie in 1..{num_islands} (the number "
                "of islands); a larger value would skip every round"
            )
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}; e.g. 4 MiB per chunk")
        check_aggregator(owners, option="owners")
        check_aggregation(aggregation)
        weights = (
            None
            if island_weights is None
            else check_weights(island_weights, option="island_weights")
        )
        if aggregation == "weighted_mean" and (weights is None or len(weights) != num_islands):
            raise ValueError(
                f"aggregation='weighted_mean' needs island_weights with one weight per island "
                f"({num_islands}), got {island_weights!r}; e.g. each island's samples per step"
            )
        self.group, self.island_group, self.owners = group, island_group, owners
        self.num_islands, self.island_index = num_islands, island_index
        self.chunk_bytes, self.codec = chunk_bytes, codec
        self.rule = AggregationRule(aggregation, trim_ratio, min_contributions, max_norm, weights)
        self.spool = spool
        if self.spool is None and offload and num_islands > 1:
            self.spool = Spool(spool_dir, cleanup_timeout_s=cleanup_timeout_s)
        self.device = torch.device("cpu")  # payloads, buffers and the spool, whatever the chip
        self._sequence = 0  # rounds so far: names spool rounds uniquely
        self.last_round: RoundReport | None = None
        # The round between ``open`` and ``agree``: its names, buckets and, once run, stats.
        self._round_index = 0
        self._names: dict[str, torch.Size] = {}
        self._work: Work | None = None
        self._model = 0  # ``RoundRequest.layout``: the slices this rank sends
        self._buckets: list[Tensor] = []
        self._stats: RoundStats | None = None
        self.link = LinkWatch(group, num_islands=num_islands)  # explains, sets no timeout

    def spool_bytes(self) -> int:
        return self.spool.disk_bytes if self.spool is not None else 0

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()

    @property
    def block_size(self) -> int:
        return 1 if self.codec is None else self.codec.block_size

    def open(self, request: RoundRequest) -> Opening:
        """Begin round ``round_index`` over tensors of ``names``; nothing moves yet. ``finite``
        is not agreed on: every owner drops a non-finite contribution. ``work`` travels with
        the round's terms and the owners weigh the mean by it: the ``Opening`` asks for no
        scale, and the swarm's most inner steps come back in ``RoundStats.swarm_steps``."""
        self._round_index, self._names = request.round_index, dict(request.names)
        self.link.begin(request.round_index, self._names)
        self._work, self._model = request.work, request.layout
        self._buckets, self._stats = [], None
        return Opening()

    def start(self, bucket: Bucket) -> Handle:
        """Collect ``bucket`` (the round's buckets must lie back to back in one buffer)."""
        self._buckets.append(bucket.flat)
        return self

    def wait(self) -> int:
        if self._stats is None:
            shapes = self._names.values()
            flats = _joined(self._buckets).split([shape.numel() for shape in shapes])
            named = {n: f.view(s) for n, s, f in zip(self._names, shapes, flats, strict=True)}
            self.link.started()
            try:
                with self.link.explained():
                    self._stats = self._average(named, round_index=self._round_index)
            except BaseException:
                self.link.discard()
                raise
            self.link.arrived()
        return 0

    def agree(self) -> RoundStats:
        self.wait()
        assert self._stats is not None
        self.link.finished()
        stats, self._stats, self._buckets = self._stats, None, []
        return stats

    def _average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        """Aggregate ``tensors`` across islands in place; collective over the peer group.
        Raises ``ValueError`` when this island's layout differs from the owner's or island 0's,
        ``SwarmRoundError`` when a spool or an owner failed (anchors unchanged)."""
        label = labels.AGGREGATOR_ROUND if self.owners == "rotating" else labels.SHARDED_ROUND
        with record_function(label):
            start = time.perf_counter()
            layout = PayloadMap.from_tensors(tensors)
            owner: int | None = None  # sharded: every island owns a part
            if self.owners == "rotating":
                owner = round_index % self.num_islands
                parts = whole_part(layout, self.num_islands, owner)
            else:
                align = CodedPayload(layout, self.codec).align if self.codec is not None else 1
                parts = plan_parts(layout, self.num_islands, align)
            report = RoundReport(round_index, self.island_index if owner is None else owner)
            rnd = _Round(report, list(tensors.values()), parts, owner)
            self.last_round, round_id = report, self._sequence
            self._sequence += 1
            if self.num_islands == 1:
                # Nothing moves; with a codec the tensors become their round trip (what the
                # others would have seen), as on every transport with a codec.
                report.accepted = [0]
                if self.codec is not None:
                    CodedPayload(layout, self.codec).roundtrip_into(rnd.targets)
                steps = None if self._work is None else self._work.inner_steps
                return RoundStats(wall_s=time.perf_counter() - start, swarm_steps=steps)
            self._agree(rnd, layout, round_index)
            try:
                self._run(rnd, layout, round_id)
            except BaseException:
                for sink in rnd.sinks.values():
                    if sink is not None:
                        sink.abort()  # their leases go now: cleanup below does not wait
                raise
            finally:
                for c in rnd.contributions.values():
                    c.close()
                if self.spool is not None:
                    self.spool.release_round(round_id)
            if self.island_index in rnd.terms.mismatched:
                raise SwarmConfigError(
                    f"swarm round {round_index}: this island's pseudo-gradient layout (names, "
                    f"shapes, dtypes) differs from the aggregator's (island {owner}); its log "
                    "names the first difference. Every island must train the same parameters "
                    "with the same quantize and quantize_block_size."
                )
            stats = rnd.stats
            stats.applied = report.outcome == "applied"
            stats.wall_s = time.perf_counter() - start
            stats.non_finite_islands = tuple(report.non_finite)
            stats.rejected_own = self.island_index in report.non_finite
            stats.swarm_steps = rnd.terms.swarm_steps
            return stats

    def _agree(self, rnd: _Round, layout: PayloadMap, round_index: int) -> None:
        """Step 1: the round's terms, codecs, wire layouts and exchange."""
        rnd.coded = [  # an empty part has nothing to encode
            CodedPayload(p.layout, self.codec) if self.codec and p.layout.specs else None
            for p in rnd.parts
        ]
        rnd.wires = [c.wire if c else p.layout for c, p in zip(rnd.coded, rnd.parts, strict=True)]
        if rnd.owner is None:
            rnd.terms = agree_parts(
                self.group, rnd.parts, rnd.wires, self.codec, self.rule, self.chunk_bytes,
                round_index, self.island_group, rnd.stats, self._work, self._model,
            )  # fmt: skip
        else:
            rnd.terms = agree_owner(
                self.group, self.island_index, rnd.owner, layout, rnd.wires[rnd.owner],
                self.codec, self.rule, self.chunk_bytes, rnd.stats, self._work, self._model,
            )  # fmt: skip
        silent, me, n = frozenset(rnd.terms.mismatched), self.island_index, self.num_islands
        rnd.exchange = Exchange(self.group, me, n, rnd.terms.chunk_bytes, silent, rnd.stats)

    def _run(self, rnd: _Round, layout: PayloadMap, round_id: int) -> None:
        """Steps 2-5."""
        rule, chunk_bytes = rnd.terms.rule, rnd.terms.chunk_bytes
        # Decided on the whole layout, which every island agreed on: a part's own dtypes
        # could send two islands different ways, and their collectives would not match.
        fold = rnd.owner is None and self.codec is None
        fold = fold and folds(layout, rule.aggregation, rule.max_norm, chunk_bytes)
        if rnd.owner is None:
            (fold,) = island_all([fold], self.island_group)  # every peer group the same way
        own = rnd.parts[self.island_index].views(rnd.targets)
        if not (fold and self._fold_round(rnd, own)):
            self._spooled_round(rnd, own, round_id)
        if rnd.report.outcome == "applied":
            with record_function(labels.RECEIVE):
                views = [[byte_view(v) for v in p.views(rnd.targets)] for p in rnd.parts]
                layouts = [p.layout for p in rnd.parts]
                rnd.exchange.gather(views, layouts, rnd.terms.gather_steps)

    def _fold_round(self, rnd: _Round, own: list[Tensor]) -> bool:
        """Sum the part's contributions as they arrive, with no spool. True: every part was
        finite, all are accepted and the mean is in ``own``; False (on every rank): some sum
        was not, judge island by island."""
        me, n = self.island_index, self.num_islands
        weights = rnd.terms.rule.weights_of(list(range(n)), rnd.terms.work)
        fold = PartFold(rnd.parts[me].layout, own, me, n, rnd.terms.chunk_bytes, weights)
        error: Exception | None = None
        with record_function(labels.SEND):
            steps = rnd.exchange.scatter(self._sources(rnd), rnd.wires, rnd.terms.scatter_steps)
            for k, chunks in steps:  # to its end after an error too, so that no peer blocks
                try:
                    with record_function(labels.AGGREGATE):
                        if error is None:
                            fold.add(k, chunks)
                except Exception as err:
                    error = err
            try:
                with record_function(labels.AGGREGATE):
                    finite = error is None and fold.finish()
            except Exception as err:
                error = err
        if error is not None:
            log.error("swarm round %d: summing this island's part failed",
                      rnd.report.round_index, exc_info=error)  # fmt: skip
        (finite,) = self._settle(rnd, error, finite)
        if not finite:
            return False
        rnd.report.accepted = list(range(n))
        fold.write_into(own)
        return True

    def _spooled_round(self, rnd: _Round, own: list[Tensor], round_id: int) -> None:
        """Every rule: spool the part's contributions, judge each island, aggregate."""
        failure = self._scatter(rnd, round_id)
        for island, sink in rnd.sinks.items():  # after a spool error, abort the rest
            if sink is not None and failure is not None:
                sink.abort()
            elif sink is not None:
                try:
                    rnd.contributions[island] = sink.finish()
                except SpoolError as err:
                    failure = err
        me, coded = self.island_index, rnd.coded[self.island_index]
        # The owner's own contribution (read, not copied); with a codec every contribution is
        # read back decoded, so the owner's own takes the peers' round trip.
        rnd.contributions[me] = MemoryContribution(coded.encode(own) if coded else own)
        block_numel = max(1, rnd.terms.chunk_bytes // 4)
        if coded is not None:
            for i, c in rnd.contributions.items():
                rnd.contributions[i] = DecodedContribution(coded, c)
            block_numel = coded.block_numel(rnd.terms.chunk_bytes)
        self._judge(rnd, failure, block_numel)
        if rnd.report.outcome != "applied":
            return
        error: Exception | None = None  # step 4: the rule over this island's part
        try:
            if rnd.parts[me].layout.specs:  # an empty part has nothing to aggregate
                with record_function(labels.AGGREGATE):
                    rnd.terms.rule.aggregate(
                        own, rnd.contributions, rnd.report.accepted, rnd.parts[me].layout,
                        block_numel, rnd.terms.work,
                    )  # fmt: skip
        except Exception as err:
            error = err
            log.exception(
                "swarm round %d: aggregating this island's part failed", rnd.report.round_index
            )
        self._settle(rnd, error)

    def _scatter(self, rnd: _Round, round_id: int) -> SpoolError | None:
        """Send part j of this island's payload to island j, and every peer's contribution
        to this island's part into ``rnd.sinks`` (``None``: a refused peer, or any after a
        spool error); returns the first spool error met."""
        me, chunk_bytes = self.island_index, rnd.terms.chunk_bytes
        wire = rnd.wires[me]
        failure: SpoolError | None = None
        for i in range(self.num_islands):
            if i == me:
                continue
            rnd.sinks[i] = None  # added as they open: an interrupted round aborts them all
            if i in rnd.terms.mismatched or failure is not None:
                continue
            try:
                if self.spool is None or not wire.specs:  # an empty part needs no files
                    rnd.sinks[i] = MemorySink(wire)
                else:
                    rnd.sinks[i] = self.spool.writer(round_id, i, wire, remap_bytes=chunk_bytes)
            except SpoolError as err:
                failure = err
        with record_function(labels.SEND):
            steps = rnd.exchange.scatter(self._sources(rnd), rnd.wires, rnd.terms.scatter_steps)
            for k, chunks in steps:
                for i, chunk in chunks.items():
                    sink = rnd.sinks[i]
                    try:
                        if sink is not None:
                            sink.write(k * chunk_bytes, chunk)
                    except SpoolError as err:  # drop the peer's chunks, but receive them
                        failure, rnd.sinks[i] = failure or err, None
        return failure

    def _sources(self, rnd: _Round) -> list[list[Tensor]]:
        """Part j of this island's payload (encoded with a codec) for island j, as bytes."""
        sources: list[list[Tensor]] = []
        for j, (part, c) in enumerate(zip(rnd.parts, rnd.coded, strict=True)):
            mine = j == self.island_index
            views = [] if mine else part.views(rnd.targets)
            encoded = c.encode(views) if c is not None and not mine else views
            sources.append([byte_view(t) for t in encoded])
        return sources

    def _judge(self, rnd: _Round, failure: SpoolError | None, block_numel: int) -> None:
        """Step 3: this owner's row of the verdict table, which every rank reads."""
        n, rule, mine = self.num_islands, rnd.terms.rule, rnd.parts[self.island_index].layout
        row = torch.zeros(1 + 2 * n, dtype=torch.float64)
        row[0] = JUDGED if failure is None else SPOOL_FAILED
        # An empty part holds nothing non-finite; a refused island's, no payload.
        row[1 : 1 + n] = torch.tensor([float(i not in rnd.terms.mismatched) for i in range(n)])
        error: BaseException | None = failure
        where: dict[int, str] = {}
        if failure is None and mine.specs:
            try:
                with record_function(labels.AGGREGATE):
                    squares = rule.max_norm is not None
                    for island, c in rnd.contributions.items():
                        finite, sum_sq, bad = measure(c, mine, block_numel, squares)
                        row[1 + island], row[1 + n + island] = float(finite), sum_sq
                        if not finite:
                            where[island] = f" in tensor {bad!r}"
            except Exception as err:
                row[0], error = FAILED, err
                log.exception("swarm round %d: validating this island's part failed",
                              rnd.report.round_index)  # fmt: skip
        table = all_gather_rows(row, self.group, rnd.stats)
        read_verdicts(
            table, rule, rnd.report, self.island_index, error, owner=rnd.owner,
            mismatched=rnd.terms.mismatched, where=where if rnd.owner is not None else {},
            island_group=self.island_group,
        )  # fmt: skip

    def _settle(self, rnd: _Round, error: BaseException | None, *flags: bool) -> list[bool]:
        """Every rank learns whether every owner's step succeeded (the one that failed
        re-raises its error, the others raise ``SwarmRoundError``); returns each of ``flags``
        ANDed over every rank."""
        row = torch.tensor([float(error is None), *map(float, flags)], dtype=torch.float64)
        table = all_gather_rows(row, self.group, rnd.stats)
        failed = [j for j in range(self.num_islands) if table[j, 0] == 0.0]
        every = [bool((table[:, 1 + i] == 1.0).all()) for i in range(len(flags))]
        ok, *every = island_all([not failed, *every], self.island_group)
        raise_if_failed(rnd.report, error, failed, ok, owner=rnd.owner)
        return every


def _joined(flats: list[Tensor]) -> Tensor:
    """One flat view over ``flats``, which must lie back to back in one storage."""
    if not flats:
        return torch.empty(0)
    first, total = flats[0], sum(f.numel() for f in flats)
    offset = first.storage_offset()
    for f in flats:
        same = f.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not same or f.storage_offset() != offset:
            raise ValueError("the aggregator needs a round's buckets back to back in one buffer")
        offset += f.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))
