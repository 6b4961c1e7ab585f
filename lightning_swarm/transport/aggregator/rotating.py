"""Swarm transport: a rotating aggregator that spools, validates and aggregates, then broadcasts.

Round ``r`` is aggregated by island ``r % num_islands``; every rank computes this itself, so no
message elects it. One round, over the peer group (one rank per island):
1. Each other island sends the aggregator a descriptor (description length, payload bytes,
   chunk bytes), the description of its payload (names, shapes, dtypes) and then its payload in
   fixed-size chunks, double-buffered, through torch.distributed point-to-point ops.
2. The aggregator receives from all peers at once (two chunks in flight per peer) and writes
   each chunk straight into that peer's sink: a preallocated safetensors spool file
   (``offload=True``) or a flat in-memory buffer (``offload=False``). A peer whose description
   differs from the aggregator's own is received into a discard sink and rejected. It never
   holds a whole peer payload in RAM with offload on: at most two chunks per peer.
3. Validation: finite values and an optional L2 norm bound, read back one block at a time.
   Rejected contributions are logged with their island and left out. The aggregator's own
   contribution (the caller's tensors) stays in memory and is validated the same way.
4. With at least ``min_contributions`` accepted, the aggregation rule runs block by block over
   the accepted contributions in island order, writing into the aggregator's own tensors.
5. The aggregator sends every peer a status (the round's ``AggregatorOutcome``: applied,
   skipped, spool failed or error; and each island's ``Verdict``), then the result in chunks
   (a point-to-point fan-out, so byte counts are exact). Each rank unpacks it into its own
   tensors: ordinary in-memory tensors everywhere.
6. The round's spool files are deleted (``Spool.release_round`` waits for leases).

The messages of steps 1 and 5 and the words for a round's outcome and each island's verdict
are defined once, in ``round_status``; steps 2-6 are ``rounds.Aggregator``. A round's state
travels explicitly (``AggregatorRound``); ``last_round`` keeps the last ``RoundReport`` for
diagnostics.
Profiler labels (``lightning_swarm.profiling``): ``AGGREGATOR_ROUND`` (the whole ``average``),
``SEND`` and ``RECEIVE`` (payloads and results on the wire), ``AGGREGATE`` (validation and rule).

Failure modes: too few accepted contributions, or (``weighted_mean``) accepted islands whose
weights sum to 0 -> ``RoundStats(applied=False)`` and a warning naming the cause on every rank.
A spool that cannot be written or read (disk full, unwritable root, truncated or corrupt file)
-> every rank raises ``SwarmRoundError`` after the peers' sends completed, with no spool file
left; the caller's anchors are untouched. Any other exception on the aggregator once the peers'
payloads are in (validation, decoding, the rule) -> the peers get an ``ERROR`` status and raise
``SwarmRoundError`` naming the aggregator's island, the round's files are removed, and the
aggregator re-raises its own exception. A rank whose own layout was rejected raises
``ValueError``. Any exception while payloads are arriving (a peer died and gloo raised,
Ctrl-C, anything) aborts the round's spool writers at once, so their leases go, the round's files
are removed without waiting for ``cleanup_timeout_s``, and the real error is re-raised. The peers
of an aggregator that died or was interrupted fail in their own sends or receives (gloo reports
the closed connection); a live aggregator that raised before the status leaves them waiting up
to the process group's timeout.

Results are identical whichever island aggregates and whether offload is on: contributions
always enter the rule in island order, and blocking does not change elementwise results.

Quantized payloads (``codec``, see ``coded``): every island, the aggregator included, encodes
its pseudo-gradient; peers stream and the aggregator spools the encoded bytes (per tensor: the
codec's data and float32 block scales), and validation and aggregation read them back decoded,
one block at a time, in float32. The aggregator's own contribution takes the same encode/decode
round trip, so the mean is ``mean_i decode(encode(x_i))``, bitwise what ``QuantizedTransport``
computes, and error feedback upstream stays exact. The result is sent back in float32: encoding
it again would add an error no island's residual accounts for. So each round moves encoded
bytes towards the aggregator and float32 bytes back. With one island the tensors are replaced
by their round trip (nothing moves), as with ``QuantizedTransport``. There is one value for
"no codec": ``codec=None`` (``algorithm.codecs.codec_for("none", ...)`` returns it).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.aggregator.coded import CodedPayload
from lightning_swarm.transport.aggregator.links import TAG_CHUNK, TAG_RESULT, TAG_STATUS, Link
from lightning_swarm.transport.aggregator.owners import SwarmAggregatorBase
from lightning_swarm.transport.aggregator.round_status import (
    AggregatorOutcome,
    RoundReport,
    RoundStatus,
    Verdict,
    bad_layout_message,
    peer_failure_message,
    skip_message,
)
from lightning_swarm.transport.aggregator.rounds import Aggregator, AggregatorRound
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.errors import SwarmRoundError
from lightning_swarm.transport.payload import PayloadLayout

log = logging.getLogger(__name__)

__all__ = ["AggregatorOutcome", "AggregatorTransport", "RoundReport", "Verdict"]


class AggregatorTransport(SwarmAggregatorBase):
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
        min_contributions: accepted contributions (the aggregator's own included) a round needs.
        max_norm: reject a contribution whose L2 norm exceeds this; ``None`` = no bound.
        island_weights: one weight per island for ``weighted_mean``.
        chunk_bytes: bytes per message and the block size of validation and aggregation.
        cleanup_timeout_s: how long spool cleanup waits for in-flight writes and reads.
        device: where send/receive buffers live (the CPU for gloo).
        codec: encode contributions with this codec (module docstring); ``None`` sends float32
            as is. Every island must pass the same codec.
        spool: an existing ``Spool`` to use instead of creating one (tests inject faults).
        island_group: a model-sharded island's group (CPU-capable, e.g. gloo): the round's
            aggregators agree on one verdict per island, ``max_norm`` bounding the island's
            norm over all its shards (``island_verdicts``); ``None`` otherwise.

    Raises:
        ValueError: an option is out of range for this topology.
        SpoolError: the spool root cannot be created.
    """

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
        device: torch.device | str = "cpu",
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
        self.device = torch.device(device)
        self._ranks = _global_ranks(group, num_islands)
        self._link = Link(group, self.device)
        self._aggregator = Aggregator(
            self._link, self._ranks, island_index, self.rule, self._spool, chunk_bytes, island_group
        )

    # -- public ----------------------------------------------------------------------------
    def aggregator_of(self, round_index: int) -> int:
        """The island that aggregates round ``round_index`` (round-robin)."""
        return round_index % self.num_islands

    @record_function(labels.AGGREGATOR_ROUND)
    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        """Aggregate ``tensors`` across islands in place; collective over the peer group."""
        start = time.perf_counter()
        layout = PayloadLayout.from_tensors(tensors)
        report = RoundReport(round_index, self.aggregator_of(round_index))
        rnd = AggregatorRound(
            report=report,
            layout=layout,
            coded=CodedPayload(layout, self.codec) if self.codec is not None else None,
            targets=list(tensors.values()),
            round_id=self._begin(report),
        )
        if self.num_islands == 1:
            stats = RoundStats()
            self._alone(report, rnd.coded, rnd.targets)
        elif report.aggregator == self.island_index:
            stats = self._aggregator.run(rnd)
            if report.outcome == AggregatorOutcome.SKIPPED:
                self._warn_skipped(report)
        else:
            stats = self._contribute(rnd)
        stats.wall_s = time.perf_counter() - start
        stats.non_finite_islands = tuple(report.non_finite)
        stats.rejected_own = self.island_index in report.non_finite
        return stats

    # -- a peer's round --------------------------------------------------------------------
    def _contribute(self, rnd: AggregatorRound) -> RoundStats:
        report = rnd.report
        dst = self._ranks[report.aggregator]
        with record_function(labels.SEND):
            # With a codec the encoded payload travels; the result comes back in float32.
            sources = rnd.coded.encode(rnd.targets) if rnd.coded else rnd.targets
            sent = self._link.send_description(dst, rnd.wire, self.chunk_bytes)
            sent += self._link.send_stream([dst], rnd.wire, sources, self.chunk_bytes, TAG_CHUNK)
            del sources
        with record_function(labels.RECEIVE):
            raw = RoundStatus.empty(self.num_islands)
            self._link.irecv(raw, dst, TAG_STATUS).wait()
            status = RoundStatus.from_tensor(raw)
            stats = RoundStats(bytes_sent=sent, bytes_received=RoundStatus.nbytes(self.num_islands))
            report.outcome, report.accepted = status.outcome, status.accepted
            report.non_finite = [
                i for i, v in enumerate(status.verdicts) if v == Verdict.NON_FINITE
            ]
            verdict = status.verdicts[self.island_index]
            if verdict == Verdict.BAD_LAYOUT:
                raise ValueError(bad_layout_message(report))
            if verdict != Verdict.ACCEPTED:
                log.warning(
                    "swarm round %d: the aggregator rejected this island's contribution (%s)",
                    report.round_index,
                    verdict.text,
                )
            if status.outcome in (AggregatorOutcome.ERROR, AggregatorOutcome.SPOOL_FAILED):
                raise SwarmRoundError(peer_failure_message(report))
            if status.outcome == AggregatorOutcome.SKIPPED:
                stats.applied = False
                self._warn_skipped(report)
                return stats
            stats.bytes_received += self._link.recv_stream(
                dst, rnd.layout, rnd.targets, status.result_chunk_bytes, TAG_RESULT
            )
        return stats

    # -- the aggregator's round ------------------------------------------------------------
    def _warn_skipped(self, report: RoundReport) -> None:
        """The skip warning; every rank derives the cause from the same verdicts."""
        warnings.warn(
            skip_message(report, self.num_islands, self.rule.min_contributions),
            RuntimeWarning,
            stacklevel=4,
        )


def _global_ranks(group: dist.ProcessGroup | None, num_islands: int) -> list[int]:
    """Global rank of each island's member of the peer group (the group is ordered by island)."""
    if num_islands == 1 or group is None or group is dist.group.WORLD:
        return list(range(num_islands))
    return [dist.get_global_rank(group, i) for i in range(num_islands)]
