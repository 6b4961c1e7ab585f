"""What every swarm aggregator shares, whatever its owner layout: options, rule, spool.

A round's payload is aggregated by its *owners*: one island per round in turn (``rotating``:
island ``round_index % num_islands`` owns the whole payload) or every island owning 1/n of every
tensor (``sharded``). ``SwarmAggregatorBase`` holds the validated options (``AggregationRule``),
the run-scoped spool, the round numbering that names a round's spool files, and the one-island
round. The transport owns its ``Spool`` (created here unless injected) and removes it in
``close``; a round's files live from its first write to the end of the round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.robust import check_aggregation, check_weights
from lightning_swarm.transport.aggregator.coded import CodedPayload
from lightning_swarm.transport.aggregator.contributions import (
    Contribution,
    MemoryContribution,
    aggregate_into,
)
from lightning_swarm.transport.aggregator.round_status import RoundReport
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.payload import PayloadLayout


@dataclass(frozen=True)
class AggregationRule:
    """The validated rule options of the swarm transport (see ``AggregatorTransport``)."""

    aggregation: str
    trim_ratio: float
    min_contributions: int
    max_norm: float | None
    island_weights: list[float] | None

    def zero_weight(self, accepted: list[int]) -> bool:
        """``weighted_mean`` over accepted islands whose weights are all 0: nothing to average."""
        if self.aggregation != "weighted_mean" or self.island_weights is None:
            return False
        return sum(self.island_weights[i] for i in accepted) <= 0

    def skips(self, accepted: list[int]) -> bool:
        """Whether a round with these accepted islands is skipped: fewer than
        ``min_contributions``, or ``zero_weight``."""
        return len(accepted) < self.min_contributions or self.zero_weight(accepted)

    def problem(self, finite: bool, norm: float, *, where: str = "", over: str = "") -> str | None:
        """Why a contribution must not count (not every value ``finite``, or its L2 ``norm``
        above ``max_norm``), or ``None``. ``where`` names what held a non-finite value and
        ``over`` what the norm spans, for the message."""
        if not finite:
            return f"non-finite values (NaN or Inf){where}"
        if self.max_norm is not None and norm > self.max_norm:
            return f"L2 norm {norm:.6g}{over} exceeds max_norm={self.max_norm:g}"
        return None

    def aggregate(
        self,
        targets: Sequence[Tensor],
        contributions: Mapping[int, Contribution],
        accepted: list[int],
        layout: PayloadLayout,
        block_numel: int,
    ) -> None:
        """Overwrite ``targets`` with the rule over the ``accepted`` islands' contributions,
        in island order, block by block (``contributions.aggregate_into``)."""
        weights = None
        if self.island_weights is not None:
            weights = [self.island_weights[i] for i in accepted]
        aggregate_into(
            targets,
            [contributions[i] for i in accepted],
            layout,
            rule=self.aggregation,
            weights=weights,
            trim_ratio=self.trim_ratio,
            block_numel=block_numel,
        )


def join_own(
    contributions: dict[int, Contribution],
    island: int,
    own: list[Tensor],
    coded: CodedPayload | None,
    chunk_bytes: int,
) -> int:
    """Add this island's contribution (``own``, its float tensors: read, not copied) to
    ``contributions``. With a codec it is encoded first and every contribution is then read
    back decoded, so the owner's own takes the peers' round trip. Returns the elements per
    block of validation and aggregation."""
    contributions[island] = MemoryContribution(island, coded.encode(own) if coded else own)
    if coded is None:
        return max(1, chunk_bytes // 4)
    for i, c in contributions.items():
        contributions[i] = coded.decoded(c)
    return coded.block_numel(chunk_bytes)


class SwarmAggregatorBase:
    """Options, spool and bookkeeping of a swarm aggregator; the owner layout is the
    subclass's. Arguments as ``AggregatorTransport``'s.

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
        offload: bool,
        spool_dir: str | None,
        aggregation: str,
        trim_ratio: float,
        min_contributions: int,
        max_norm: float | None,
        island_weights: Sequence[float] | None,
        chunk_bytes: int,
        cleanup_timeout_s: float,
        codec: Codec | None,
        spool: Spool | None,
    ) -> None:
        _check_topology(num_islands, island_index, min_contributions, chunk_bytes)
        check_aggregation(aggregation)
        weights = None
        if island_weights is not None:
            weights = check_weights(island_weights, option="island_weights")
        if aggregation == "weighted_mean" and (weights is None or len(weights) != num_islands):
            raise ValueError(
                f"aggregation='weighted_mean' needs island_weights with one weight per island "
                f"({num_islands}), got {island_weights!r}; e.g. each island's samples per step"
            )
        self.group, self.num_islands, self.island_index = group, num_islands, island_index
        self.offload, self.chunk_bytes, self.codec = offload, chunk_bytes, codec
        self.rule = AggregationRule(aggregation, trim_ratio, min_contributions, max_norm, weights)
        self._spool = spool
        if self._spool is None and offload and num_islands > 1:
            self._spool = Spool(spool_dir, cleanup_timeout_s=cleanup_timeout_s)
        # Payloads, buffers and the spool live on the CPU, whatever the accelerator.
        self.device = torch.device("cpu")
        self._sequence = 0  # rounds so far: names spool rounds uniquely
        self.last_round: RoundReport | None = None

    @property
    def spool(self) -> Spool | None:
        return self._spool

    def spool_bytes(self) -> int:
        """Bytes the spool currently holds on disk (0 without offload)."""
        return self._spool.disk_bytes if self._spool is not None else 0

    def peak_spool_bytes(self) -> int:
        return self._spool.peak_disk_bytes if self._spool is not None else 0

    def close(self) -> None:
        """Remove the spool (waits for leases up to the cleanup timeout). Idempotent."""
        if self._spool is not None:
            self._spool.close()

    def _begin(self, report: RoundReport) -> int:
        """Record ``report`` as the last round; the new round's spool id."""
        self.last_round = report
        round_id = self._sequence
        self._sequence += 1
        return round_id

    def _alone(
        self, report: RoundReport, coded: CodedPayload | None, targets: list[Tensor]
    ) -> None:
        """The round of a single island: nothing moves; with a codec the tensors become their
        round trip (what the others would have seen), as on every transport with a codec."""
        report.accepted = [0]
        if coded is not None:
            coded.roundtrip_into(targets)


def _check_topology(
    num_islands: int, island_index: int, min_contributions: int, chunk: int
) -> None:
    if not 0 <= island_index < num_islands:
        raise ValueError(f"island_index {island_index} outside 0..{num_islands - 1}")
    if not 1 <= min_contributions <= num_islands:
        raise ValueError(
            f"min_contributions={min_contributions} must lie in 1..{num_islands} (the number of "
            "islands); a larger value would skip every round"
        )
    if chunk < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk}; e.g. 4 MiB per chunk")
