"""The aggregator's side of one swarm round: receive, validate, aggregate, answer, clean up.

``Aggregator.run`` is steps 2-6 of the round described in ``swarm``:
- it receives every peer's announcement, then every peer's chunks at once (two in flight per
  peer), each into that peer's sink (a spool file, memory, or a discard sink for a peer whose
  layout differs), so it never holds a whole peer payload in RAM with offload on;
- it validates every contribution, its own included (finite values, ``max_norm``), one block
  at a time, and with at least ``min_contributions`` accepted runs the rule block by block in
  island order into its own tensors; with model-sharded islands (``island_group``) the
  round's aggregators, one per shard position, first agree on one verdict per island
  (``island_verdicts``), joining as failed when they cannot validate;
- it sends every peer a ``RoundStatus`` and then the result (a point-to-point fan-out);
- it removes the round's spool files. Any exception while collecting first aborts the writers,
  so their leases go at once and cleanup never waits for ``cleanup_timeout_s``.

``AggregatorRound`` is one round's state, handed explicitly from step to step; the caller owns the
tensors in it, and nothing of a round outlives ``run``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.transport.aggregator.coded import CodedPayload
from lightning_swarm.transport.aggregator.contributions import (
    Contribution,
    Sink,
    finish_sinks,
    measure,
    open_sinks,
)
from lightning_swarm.transport.aggregator.island_verdicts import agree
from lightning_swarm.transport.aggregator.links import TAG_CHUNK, TAG_RESULT, TAG_STATUS, Link
from lightning_swarm.transport.aggregator.owners import AggregationRule, join_own
from lightning_swarm.transport.aggregator.round_status import (
    AggregatorOutcome,
    RoundReport,
    RoundStatus,
    Verdict,
)
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.errors import SpoolError, SwarmRoundError
from lightning_swarm.transport.payload import PayloadLayout

log = logging.getLogger(
    "lightning_swarm.transport.aggregator.rotating"
)  # one logger for the whole round


@dataclass
class AggregatorRound:
    """One ``average`` call's state, handed explicitly from method to method."""

    report: RoundReport
    layout: PayloadLayout  # the caller's float tensors; the result travels in it
    coded: CodedPayload | None
    targets: list[Tensor]
    round_id: int  # names the round's spool files
    agreed: bool = False  # model-sharded islands: this aggregator has joined the agreement

    @property
    def wire(self) -> PayloadLayout:
        """What peers send and the spool holds: the codec's encoding, or the floats."""
        return self.coded.wire if self.coded is not None else self.layout


class Aggregator:
    """Runs the aggregator's side of rounds; holds no state between them.

    Args:
        link: point-to-point ops over the peer group.
        ranks: the global rank of each island's member of the peer group.
        island_index: this rank's island.
        rule: the aggregation rule and its options.
        spool: where peer payloads are spooled; ``None`` holds them in memory.
        chunk_bytes: bytes per result message and the block size of validation.
        island_group: a model-sharded island's group: the round's aggregators (one per shard
            position) agree on one verdict per island (``island_verdicts``); ``None`` judges
            this peer group's contributions alone.
    """

    def __init__(
        self,
        link: Link,
        ranks: list[int],
        island_index: int,
        rule: AggregationRule,
        spool: Spool | None,
        chunk_bytes: int,
        island_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._link, self._ranks, self.island_index = link, ranks, island_index
        self.num_islands = len(ranks)
        self.rule, self._spool, self.chunk_bytes = rule, spool, chunk_bytes
        self.island_group = island_group

    def run(self, rnd: AggregatorRound) -> RoundStats:
        """Steps 2-6 of the round; raises ``SwarmRoundError`` on spool trouble."""
        contributions: dict[int, Contribution] = {}
        sinks: dict[int, Sink] = {}
        verdicts: dict[int, Verdict] = {}
        stats = RoundStats()
        try:
            with record_function(labels.RECEIVE):
                peers = {i: r for i, r in enumerate(self._ranks) if i != self.island_index}
                plans, stats.bytes_received = self._link.recv_descriptions(peers, rnd.wire)
                for p in plans:
                    if p.layout_problem:
                        verdicts[p.island] = Verdict.BAD_LAYOUT
                        self._log_rejection(rnd.report, p.island, p.layout_problem)
                accepted_layout = [p.island for p in plans if p.layout_problem is None]
                islands = [p.island for p in plans]
                failure = open_sinks(
                    sinks, islands, accepted_layout, rnd.wire, self._spool, rnd.round_id,
                    remap_bytes=self.chunk_bytes,
                )  # fmt: skip
                received, receive_failure = self._link.recv_into_sinks(plans, sinks, TAG_CHUNK)
                stats.bytes_received += received
                failure = finish_sinks(sinks, contributions, failure or receive_failure)
            outcome = AggregatorOutcome.SPOOL_FAILED
            if failure is None:
                outcome = self._combine(rnd, contributions, verdicts)
            else:
                self._abstain(rnd)
            stats.bytes_sent = self._send_status(self._status(outcome, verdicts, rnd))
            if outcome == AggregatorOutcome.APPLIED:
                with record_function(labels.SEND):
                    receivers = [self._ranks[i] for i in accepted_layout]
                    stats.bytes_sent += self._link.send_stream(
                        receivers, rnd.layout, rnd.targets, self.chunk_bytes, TAG_RESULT
                    )
        except BaseException:
            # A dead peer (gloo error), Ctrl-C, anything: the writers still hold their leases,
            # and release_round below would wait cleanup_timeout_s for them. Abort them now.
            for sink in sinks.values():
                sink.abort()
            self._abstain(rnd)
            raise
        finally:
            for c in contributions.values():
                c.close()
            if self._spool is not None:
                self._spool.release_round(rnd.round_id)
        return self._conclude(rnd.report, stats, outcome, failure)

    def _conclude(
        self,
        report: RoundReport,
        stats: RoundStats,
        outcome: AggregatorOutcome,
        failure: SpoolError | None,
    ) -> RoundStats:
        report.outcome = outcome
        if failure is not None:
            raise SwarmRoundError(
                f"swarm round {report.round_index} failed on this aggregator (island "
                f"{self.island_index}): {failure}. Anchors are unchanged."
            ) from failure
        stats.applied = outcome == AggregatorOutcome.APPLIED
        return stats

    def _combine(
        self,
        rnd: AggregatorRound,
        contributions: dict[int, Contribution],
        verdicts: dict[int, Verdict],
    ) -> AggregatorOutcome:
        """Add the aggregator's own contribution, then validate and aggregate.

        Anything raised here is re-raised after every peer got an ``ERROR`` status (with the
        verdicts known so far): the peers wait for the status, and would otherwise block until
        the process group's timeout. The caller's ``finally`` removes the round's files.
        """
        try:
            with record_function(labels.AGGREGATE):
                block_numel = join_own(
                    contributions, self.island_index, rnd.targets, rnd.coded, self.chunk_bytes
                )
                return self._validate_and_aggregate(rnd, contributions, verdicts, block_numel)
        except Exception:
            self._abstain(rnd)
            rnd.report.outcome = AggregatorOutcome.ERROR
            log.exception(
                "swarm round %d failed on this aggregator (island %d); telling the peers",
                rnd.report.round_index,
                self.island_index,
            )
            self._send_status(self._status(AggregatorOutcome.ERROR, verdicts, rnd))
            raise

    def _validate_and_aggregate(
        self,
        rnd: AggregatorRound,
        contributions: dict[int, Contribution],
        verdicts: dict[int, Verdict],
        block_numel: int,
    ) -> AggregatorOutcome:
        problems = self._problems(rnd, contributions, block_numel)
        if problems is None:  # another shard's aggregator failed: no shard moves
            return AggregatorOutcome.SKIPPED
        for island in sorted(contributions):
            problem = problems[island]
            if problem is None:
                verdicts[island] = Verdict.ACCEPTED
                rnd.report.accepted.append(island)
            else:
                above = problem.startswith("L2 norm")
                verdicts[island] = Verdict.ABOVE_NORM if above else Verdict.NON_FINITE
                self._log_rejection(rnd.report, island, problem)
        rnd.report.non_finite = sorted(i for i, v in verdicts.items() if v == Verdict.NON_FINITE)
        if self.rule.skips(rnd.report.accepted):
            return AggregatorOutcome.SKIPPED
        self.rule.aggregate(
            rnd.targets, contributions, rnd.report.accepted, rnd.layout, block_numel
        )
        return AggregatorOutcome.APPLIED

    def _problems(
        self, rnd: AggregatorRound, contributions: dict[int, Contribution], block_numel: int
    ) -> dict[int, str | None] | None:
        """Why each island's contribution must not count (``AggregationRule.problem``). With
        model-sharded islands, agreed over the island's shards (``island_verdicts``): ``None``
        when another shard's aggregator failed."""
        squares = self.rule.max_norm is not None
        found = {
            i: measure(c, rnd.layout, block_numel=block_numel, sum_sq=squares)
            for i, c in contributions.items()
        }
        if self.island_group is None:
            return {
                i: self.rule.problem(
                    m.finite, math.sqrt(m.sum_sq), where=f" in tensor {m.bad_tensor!r}"
                )
                for i, m in found.items()
            }
        rnd.agreed = True
        measures = {i: (m.finite, m.sum_sq) for i, m in found.items()}
        validated, islands = agree(measures, self.num_islands, self.island_group)
        if not validated:
            return None
        return {
            i: self.rule.problem(
                *islands[i],
                where=" or no payload in some shard",
                over=" over the island's shards",
            )
            for i in contributions
        }

    def _abstain(self, rnd: AggregatorRound) -> None:
        """Join the island's agreement as failed, once, so the other shards do not wait.

        Called on failure paths only: if the agreement itself fails (a rank of the island is
        gone), that is logged and the failure being handled is the one that propagates.
        """
        if self.island_group is None or rnd.agreed:
            return
        rnd.agreed = True
        try:
            agree(None, self.num_islands, self.island_group)
        except Exception:
            log.exception("swarm round %d: the island's agreement failed", rnd.report.round_index)

    def _status(
        self, outcome: AggregatorOutcome, verdicts: dict[int, Verdict], rnd: AggregatorRound
    ) -> RoundStatus:
        # An island without a verdict (the round failed before validating it) reads ACCEPTED;
        # with a failed outcome no peer acts on it.
        every = tuple(verdicts.get(i, Verdict.ACCEPTED) for i in range(self.num_islands))
        return RoundStatus(outcome, rnd.layout.data_bytes, self.chunk_bytes, every)

    def _send_status(self, status: RoundStatus) -> int:
        raw = status.to_tensor()
        peers = [self._ranks[i] for i in range(self.num_islands) if i != self.island_index]
        for w in [self._link.isend(raw, r, TAG_STATUS) for r in peers]:
            w.wait()
        return RoundStatus.nbytes(self.num_islands) * len(peers)

    def _log_rejection(self, report: RoundReport, island: int, problem: str) -> None:
        report.rejected[island] = problem
        log.warning(
            "swarm round %d: contribution of island %d rejected: %s; aggregating without it",
            report.round_index,
            island,
            problem,
        )
