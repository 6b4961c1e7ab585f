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
5. The aggregator sends every peer a status (applied / skipped / failed, and each island's
   verdict), then the result in chunks (a point-to-point fan-out, so byte counts are exact).
   Each rank unpacks it into its own tensors: ordinary in-memory tensors everywhere.
6. The round's spool files are deleted (``Spool.release_round`` waits for leases).

Failure modes: too few accepted contributions, or (``weighted_mean``) accepted islands whose
weights sum to 0 -> ``RoundStats(applied=False)`` and a warning naming the cause on every rank.
A spool that cannot be written or read (disk full, unwritable root, truncated or corrupt file)
-> every rank raises ``SwarmRoundError`` after the peers' sends completed, with no spool file
left; the caller's anchors are untouched. Any other exception on the aggregator once the peers'
payloads are in (validation, decoding, the rule) -> the peers get an ``ERROR`` status and raise
``SwarmRoundError`` naming the aggregator's island, the round's files are removed, and the
aggregator re-raises its own exception. A rank whose own layout was rejected raises
``ValueError``. An exception while payloads are still arriving, or while the result is being
sent, still leaves the peers blocked in their sends or receives until the process group's
timeout.

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
by their round trip (nothing moves), as with ``QuantizedTransport``.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.robust import AGGREGATIONS
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.coded import CodedPayload
from lightning_swarm.transport.contributions import (
    Contribution,
    MemoryContribution,
    Sink,
    aggregate_into,
    check_values,
    finish_sinks,
    open_sinks,
)
from lightning_swarm.transport.layout import PayloadLayout
from lightning_swarm.transport.spool import Spool, SpoolError
from lightning_swarm.transport.streams import (
    TAG_CHUNK,
    TAG_DESCRIPTION,
    TAG_DESCRIPTOR,
    TAG_RESULT,
    TAG_STATUS,
    IncomingPayload,
    Link,
)

log = logging.getLogger(__name__)

# FAILED: the spool could not be written or read. ERROR: anything else raised on the aggregator
# after the peers' payloads were in (a bug, a rule refusing its input); the aggregator re-raises
# its own exception, the peers raise SwarmRoundError pointing at its log.
APPLIED, SKIPPED, FAILED, ERROR = 0, 1, 2, 3
ACCEPTED, NON_FINITE, ABOVE_NORM, BAD_LAYOUT = 0, 1, 2, 3
_VERDICT_TEXT = {NON_FINITE: "non-finite values", ABOVE_NORM: "norm above max_norm"}


class SwarmRoundError(RuntimeError):
    """A swarm round failed on the aggregator (spool trouble or an error while validating or
    aggregating); anchors must stay unchanged."""


@dataclass
class RoundReport:
    """What this rank knows about the last round (the aggregator knows every verdict)."""

    round_index: int
    aggregator: int
    status: str = "applied"
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)


class SwarmTransport:
    """Rotating-aggregator transport; see the module docstring.

    Args:
        group: the peer group (one rank per island, ordered by island); ``None`` = default.
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
        device: where send/receive buffers live (``cpu`` for gloo, ``cuda`` for NCCL).
        codec: encode contributions with this codec (module docstring); ``None`` or a ``none``
            codec sends float32 as is. Every island must pass the same codec.
        spool: an existing ``Spool`` to use instead of creating one (tests inject faults).

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
    ) -> None:
        _check_options(num_islands, island_index, aggregation, min_contributions, chunk_bytes)
        if aggregation == "weighted_mean" and (
            island_weights is None or len(island_weights) != num_islands
        ):
            raise ValueError(
                f"aggregation='weighted_mean' needs island_weights with one weight per island "
                f"({num_islands}), got {island_weights!r}; e.g. each island's samples per step"
            )
        self.group, self.num_islands, self.island_index = group, num_islands, island_index
        self.offload, self.aggregation, self.trim_ratio = offload, aggregation, trim_ratio
        self.min_contributions, self.max_norm = min_contributions, max_norm
        self.island_weights = list(island_weights) if island_weights is not None else None
        self.chunk_bytes, self.device = chunk_bytes, torch.device(device)
        self.codec = codec if codec is not None and codec.name != "none" else None
        self._spool = spool
        if self._spool is None and offload and num_islands > 1:
            self._spool = Spool(spool_dir, cleanup_timeout_s=cleanup_timeout_s)
        self._ranks = _global_ranks(group, num_islands)
        self._link = Link(group, self.device)
        self._sequence = 0  # average() calls so far: names spool rounds uniquely
        self.last_round: RoundReport | None = None

    # -- public ----------------------------------------------------------------------------
    def aggregator_of(self, round_index: int) -> int:
        """The island that aggregates round ``round_index`` (round-robin)."""
        return round_index % self.num_islands

    def spool_bytes(self) -> int:
        """Bytes the spool currently holds on disk (0 without offload)."""
        return self._spool.disk_bytes if self._spool is not None else 0

    def peak_spool_bytes(self) -> int:
        return self._spool.peak_disk_bytes if self._spool is not None else 0

    @property
    def spool(self) -> Spool | None:
        return self._spool

    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        """Aggregate ``tensors`` across islands in place; collective over the peer group."""
        start = time.perf_counter()
        layout = PayloadLayout.from_tensors(tensors)
        coded = CodedPayload(layout, self.codec) if self.codec is not None else None
        targets = list(tensors.values())
        round_id, self._sequence = self._sequence, self._sequence + 1
        aggregator = self.aggregator_of(round_index)
        self.last_round = RoundReport(round_index, aggregator)
        if self.num_islands == 1:
            stats = RoundStats(num_contributions=1)
            if coded is not None:
                coded.roundtrip_into(targets)
        elif aggregator == self.island_index:
            stats = self._aggregate(layout, coded, targets, round_index, round_id)
        else:
            stats = self._contribute(layout, coded, targets, round_index)
        stats.wall_s = time.perf_counter() - start
        return stats

    def close(self) -> None:
        """Remove the spool (waits for leases up to the cleanup timeout). Idempotent."""
        if self._spool is not None:
            self._spool.close()

    # -- a peer's round --------------------------------------------------------------------
    def _contribute(
        self,
        layout: PayloadLayout,
        coded: CodedPayload | None,
        targets: list[Tensor],
        round_index: int,
    ) -> RoundStats:
        report = self.last_round
        assert report is not None
        dst = self._ranks[report.aggregator]
        # With a codec the encoded payload travels; the result comes back in float32 (layout).
        wire, sources = (coded.wire, coded.encode(targets)) if coded else (layout, targets)
        description = torch.frombuffer(bytearray(wire.to_json()), dtype=torch.uint8)
        head = torch.tensor([description.numel(), wire.data_bytes, self.chunk_bytes])
        works = [
            self._link.isend(head, dst, TAG_DESCRIPTOR),
            self._link.isend(description, dst, TAG_DESCRIPTION),
        ]
        sent = head.numel() * 8 + description.numel()
        sent += self._link.send_stream([dst], wire, sources, self.chunk_bytes, TAG_CHUNK)
        del sources
        for w in works:
            w.wait()
        status = torch.empty(4 + self.num_islands, dtype=torch.int64)
        self._link.irecv(status, dst, TAG_STATUS).wait()
        stats = RoundStats(bytes_sent=sent, bytes_received=status.numel() * 8)
        code, accepted, _, result_chunk = (int(v) for v in status[:4])
        verdict = int(status[4 + self.island_index])
        stats.num_contributions = accepted
        if verdict == BAD_LAYOUT:
            raise ValueError(
                f"swarm round {round_index}: this island's pseudo-gradient layout (names, shapes, "
                f"dtypes) differs from the aggregator's (island {report.aggregator}); its log "
                "names the first difference. Every island must train the same parameters with "
                "the same quantize and quantize_block_size."
            )
        if verdict != ACCEPTED:
            log.warning(
                "swarm round %d: the aggregator rejected this island's contribution (%s)",
                round_index,
                _VERDICT_TEXT.get(verdict, verdict),
            )
        if code == ERROR:
            report.status = "failed"
            raise SwarmRoundError(
                f"swarm round {round_index} failed on the aggregator (island "
                f"{report.aggregator}): it raised an error while validating or aggregating; "
                f"read island {report.aggregator}'s log for the cause. Anchors are unchanged."
            )
        if code == FAILED:
            report.status = "failed"
            raise SwarmRoundError(
                f"swarm round {round_index} failed on the aggregator (island "
                f"{report.aggregator}): it could not spool the contributions (disk full, "
                "unwritable spool_dir, or a truncated/corrupt spool file; its own error says "
                "which). Anchors are unchanged."
            )
        if code == SKIPPED:
            report.status = "skipped"
            stats.applied = False
            verdicts = status[4:].tolist()
            self._warn_skipped(round_index, [i for i, v in enumerate(verdicts) if v == ACCEPTED])
            return stats
        stats.bytes_received += self._link.recv_stream(
            dst, layout, targets, result_chunk, TAG_RESULT
        )
        return stats

    # -- the aggregator's round ------------------------------------------------------------
    def _aggregate(
        self,
        layout: PayloadLayout,
        coded: CodedPayload | None,
        targets: list[Tensor],
        round_index: int,
        round_id: int,
    ) -> RoundStats:
        report = self.last_round
        assert report is not None
        contributions: dict[int, Contribution] = {}
        stats = RoundStats()
        wire = coded.wire if coded else layout  # what peers send and the spool holds
        sinks: dict[int, Sink] = {}
        try:
            plans, stats.bytes_received = self._recv_descriptions(wire)
            accepted_layout = [p.island for p in plans if p.layout_problem is None]
            failure = open_sinks(
                sinks,
                [p.island for p in plans],
                accepted_layout,
                wire,
                self._spool,
                round_id,
                remap_bytes=self.chunk_bytes,
            )
            received, receive_failure = self._link.recv_into_sinks(plans, sinks, TAG_CHUNK)
            stats.bytes_received += received
            failure = finish_sinks(sinks, contributions, failure or receive_failure)
            verdicts = {p.island: BAD_LAYOUT for p in plans if p.layout_problem}
            for p in plans:
                if p.layout_problem:
                    self._log_rejection(round_index, p.island, p.layout_problem)
            code = FAILED
            if failure is None:
                code = self._combine(layout, coded, targets, contributions, verdicts)
            status = self._status(code, verdicts, layout)
            stats.bytes_sent = self._send_status(status)
            if code == APPLIED:
                receivers = [self._ranks[p.island] for p in plans if p.layout_problem is None]
                stats.bytes_sent += self._link.send_stream(
                    receivers, layout, targets, self.chunk_bytes, TAG_RESULT
                )
        except BaseException:
            # A dead peer (gloo error), Ctrl-C, anything: the writers still hold their leases,
            # and release_round below would wait cleanup_timeout_s for them. Abort them now.
            for sink in sinks.values():
                sink.abort()
            raise
        finally:
            for c in contributions.values():
                c.close()
            if self._spool is not None:
                self._spool.release_round(round_id)
        stats.num_contributions = int(status[1])
        return self._conclude(stats, code, failure, round_index)

    def _conclude(
        self, stats: RoundStats, code: int, failure: SpoolError | None, round_index: int
    ) -> RoundStats:
        report = self.last_round
        assert report is not None
        if failure is not None:
            report.status = "failed"
            raise SwarmRoundError(
                f"swarm round {round_index} failed on this aggregator (island "
                f"{self.island_index}): {failure}. Anchors are unchanged."
            ) from failure
        if code == SKIPPED:
            report.status = "skipped"
            stats.applied = False
            self._warn_skipped(round_index, report.accepted)
        return stats

    def _combine(
        self,
        layout: PayloadLayout,
        coded: CodedPayload | None,
        targets: list[Tensor],
        contributions: dict[int, Contribution],
        verdicts: dict[int, int],
    ) -> int:
        """Add the aggregator's own contribution, then validate and aggregate; a status code.

        Anything raised here is re-raised after every peer got an ``ERROR`` status (with the
        verdicts known so far): the peers wait for the status, and would otherwise block until
        the process group's timeout. The caller's ``finally`` removes the round's files.
        """
        report = self.last_round
        assert report is not None
        try:
            own = coded.encode(targets) if coded else targets  # the same round trip as peers'
            contributions[self.island_index] = MemoryContribution(self.island_index, own)
            block_numel = max(1, self.chunk_bytes // 4)
            if coded is not None:
                block_numel = coded.block_numel(self.chunk_bytes)
                for island, c in contributions.items():
                    contributions[island] = coded.decoded(c)
            return self._validate_and_aggregate(
                layout, targets, contributions, verdicts, block_numel
            )
        except Exception:
            report.status = "failed"
            log.exception(
                "swarm round %d failed on this aggregator (island %d); telling the peers",
                report.round_index,
                self.island_index,
            )
            self._send_status(self._status(ERROR, verdicts, layout))
            raise

    def _validate_and_aggregate(
        self,
        layout: PayloadLayout,
        targets: list[Tensor],
        contributions: dict[int, Contribution],
        verdicts: dict[int, int],
        block_numel: int,
    ) -> int:
        report = self.last_round
        assert report is not None
        accepted: list[Contribution] = []
        for island in sorted(contributions):
            c = contributions[island]
            problem = check_values(c, layout, max_norm=self.max_norm, block_numel=block_numel)
            if problem is None:
                verdicts[island] = ACCEPTED
                accepted.append(c)
            else:
                verdicts[island] = NON_FINITE if problem.startswith("non-finite") else ABOVE_NORM
                self._log_rejection(report.round_index, island, problem)
        report.accepted = [c.island for c in accepted]
        if len(accepted) < self.min_contributions or self._zero_weight(report.accepted):
            return SKIPPED
        weights = None
        if self.island_weights is not None:
            weights = [self.island_weights[c.island] for c in accepted]
        aggregate_into(
            targets,
            accepted,
            layout,
            rule=self.aggregation,
            weights=weights,
            trim_ratio=self.trim_ratio,
            block_numel=block_numel,
        )
        return APPLIED

    def _recv_descriptions(self, layout: PayloadLayout) -> tuple[list[IncomingPayload], int]:
        """Every peer's announced sizes and layout; a layout unlike ours is noted, not fatal."""
        peers = [i for i in range(self.num_islands) if i != self.island_index]
        heads = {i: torch.empty(3, dtype=torch.int64) for i in peers}
        link = self._link
        for w in [link.irecv(heads[i], self._ranks[i], TAG_DESCRIPTOR) for i in peers]:
            w.wait()
        blobs = {i: torch.empty(int(heads[i][0]), dtype=torch.uint8) for i in peers}
        for w in [link.irecv(blobs[i], self._ranks[i], TAG_DESCRIPTION) for i in peers]:
            w.wait()
        plans, received = [], 0
        for i in peers:
            description_len, data_bytes, chunk_bytes = (int(v) for v in heads[i])
            received += 24 + description_len
            problem = _layout_problem(layout, blobs[i])
            plans.append(
                IncomingPayload(i, self._ranks[i], data_bytes, max(1, chunk_bytes), problem)
            )
        return plans, received

    def _status(self, code: int, verdicts: dict[int, int], layout: PayloadLayout) -> Tensor:
        status = torch.zeros(4 + self.num_islands, dtype=torch.int64)
        status[0] = code
        accepted = sum(1 for v in verdicts.values() if v == ACCEPTED)
        status[1] = accepted if code in (APPLIED, SKIPPED) else 0
        status[2], status[3] = layout.data_bytes, self.chunk_bytes
        for island, verdict in verdicts.items():
            status[4 + island] = verdict
        return status

    def _send_status(self, status: Tensor) -> int:
        peers = [self._ranks[i] for i in range(self.num_islands) if i != self.island_index]
        for w in [self._link.isend(status, r, TAG_STATUS) for r in peers]:
            w.wait()
        return status.numel() * 8 * len(peers)

    def _log_rejection(self, round_index: int, island: int, problem: str) -> None:
        report = self.last_round
        assert report is not None
        report.rejected[island] = problem
        log.warning(
            "swarm round %d: contribution of island %d rejected: %s; aggregating without it",
            round_index,
            island,
            problem,
        )

    def _zero_weight(self, accepted: list[int]) -> bool:
        """``weighted_mean`` over accepted islands whose weights are all 0: nothing to average."""
        if self.aggregation != "weighted_mean" or self.island_weights is None:
            return False
        return sum(self.island_weights[i] for i in accepted) <= 0

    def _warn_skipped(self, round_index: int, accepted: list[int]) -> None:
        """The skip warning; every rank derives the cause from the same verdicts."""
        if len(accepted) < self.min_contributions:
            cause = (
                f"{len(accepted)} of {self.num_islands} contributions were accepted, fewer than "
                f"min_contributions={self.min_contributions}"
            )
        else:
            cause = (
                f"the accepted islands {accepted} have island_weights summing to 0, so "
                "weighted_mean has nothing to average"
            )
        warnings.warn(
            f"swarm round {round_index} skipped: {cause}; anchors are unchanged (see the "
            "aggregator's log for the rejected islands)",
            RuntimeWarning,
            stacklevel=4,
        )


def _layout_problem(layout: PayloadLayout, blob: Tensor) -> str | None:
    try:
        theirs = PayloadLayout.from_json(blob.numpy().tobytes())
    except ValueError as err:
        return f"unreadable payload description ({err})"
    difference = layout.difference(theirs)
    return None if difference is None else f"payload layout differs: {difference}"


def _global_ranks(group: dist.ProcessGroup | None, num_islands: int) -> list[int]:
    """Global rank of each island's member of the peer group (the group is ordered by island)."""
    if num_islands == 1 or group is None or group is dist.group.WORLD:
        return list(range(num_islands))
    return [dist.get_global_rank(group, i) for i in range(num_islands)]


def _check_options(
    num_islands: int, island_index: int, aggregation: str, min_contributions: int, chunk: int
) -> None:
    if not 0 <= island_index < num_islands:
        raise ValueError(f"island_index {island_index} outside 0..{num_islands - 1}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation={aggregation!r} is not known; choose one of {list(AGGREGATIONS)}"
        )
    if not 1 <= min_contributions <= num_islands:
        raise ValueError(
            f"min_contributions={min_contributions} must lie in 1..{num_islands} (the number of "
            "islands); a larger value would skip every round"
        )
    if chunk < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk}; e.g. 4 MiB per chunk")
