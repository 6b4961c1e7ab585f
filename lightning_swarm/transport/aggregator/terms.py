"""What the islands of a swarm round agree on, the same on every rank: who owns which part, the
rule, the chunks (``RoundTerms``). A model-sharded island's peer groups take every decision
together (``island_all``, ``agree_island``: every rank calls them once per round)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.model_layout import hash63
from lightning_swarm.algorithm.robust import AGGREGATIONS, aggregate
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.transport.aggregator.contributions import Contribution, blocks
from lightning_swarm.transport.agree import agree, flags_over
from lightning_swarm.transport.base import RoundStats, Work, checked_work
from lightning_swarm.transport.buckets import Piece, plan_shares
from lightning_swarm.transport.payload import PayloadMap

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Part:
    """The part of a round's payload that one island owns: itself a payload whose ``layout``
    names each piece ``"<tensor>[start:stop]"`` (or the whole payload's names)."""

    pieces: tuple[Piece, ...]
    layout: PayloadMap

    def views(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Flat views of the part's elements of ``tensors`` (in the full layout's order)."""
        return [tensors[p.tensor_index].view(-1)[p.start : p.stop] for p in self.pieces]


def plan_parts(layout: PayloadMap, num_islands: int, align: int) -> list[Part]:
    """Cut the payload into ``num_islands`` contiguous parts of whole ``align`` units (balanced
    within one unit, possibly empty), every piece starting on a codec block so that encoding a
    piece equals encoding the whole tensor. Raises ``ValueError`` unless both are >= 1."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    whole = [Piece(spec.index, 0, spec.numel) for spec in layout.specs]
    parts = []
    for pieces in plan_shares(whole, num_islands, align):
        entries = []
        for p in pieces:
            spec = layout.specs[p.tensor_index]
            entries.append((f"{spec.name}[{p.start}:{p.stop}]", (p.length,), spec.dtype))
        parts.append(Part(tuple(pieces), PayloadMap(entries)))
    return parts


def whole_part(layout: PayloadMap, num_islands: int, owner: int) -> list[Part]:
    """The whole payload to island ``owner`` (its names and shapes, so its spool files are the
    payload's), empty parts to the others."""
    whole = tuple(Piece(spec.index, 0, spec.numel) for spec in layout.specs)
    empty = PayloadMap([])
    return [Part(whole, layout) if j == owner else Part((), empty) for j in range(num_islands)]


@dataclass(frozen=True)
class AggregationRule:
    """The validated rule options of a swarm round (see ``SwarmAggregator``)."""

    aggregation: str
    trim_ratio: float
    min_contributions: int
    max_norm: float | None
    island_weights: list[float] | None

    def skips(self, accepted: list[int]) -> bool:
        """Whether a round with these accepted islands is skipped: fewer than
        ``min_contributions``, or ``weighted_mean`` over weights that are all 0."""
        if len(accepted) < self.min_contributions:
            return True
        weights = self.island_weights if self.aggregation == "weighted_mean" else None
        return weights is not None and sum(weights[i] for i in accepted) <= 0

    def weights_of(self, accepted: list[int], work: Sequence[float] | None) -> list[float] | None:
        """The weights of the mean over the ``accepted`` islands (``None``: unweighted). When
        their ``work`` (inner steps this round, under a time budget) differs, ``mean`` weighs
        each by its steps and ``weighted_mean`` by ``island_weights[i]`` times them; otherwise
        the rule is as configured, bit for bit. Order statistics take no weights."""
        if self.aggregation not in ("mean", "weighted_mean"):
            return None
        configured = None
        if self.aggregation == "weighted_mean":
            assert self.island_weights is not None
            configured = [self.island_weights[i] for i in accepted]
        if work is None or len({work[i] for i in accepted}) <= 1:
            return configured
        steps = [work[i] for i in accepted]
        if configured is None:
            return steps
        return [c * w for c, w in zip(configured, steps, strict=True)]

    def problem(self, finite: bool, norm: float, *, where: str = "", over: str = "") -> str | None:
        """Why a contribution must not count (not ``finite``, or its L2 ``norm`` above
        ``max_norm``), or ``None``; ``where`` and ``over`` qualify the message."""
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
        layout: PayloadMap,
        block_numel: int,
        work: Sequence[float] | None = None,
    ) -> None:
        """Overwrite ``targets`` (in layout order) with the rule over the ``accepted`` islands'
        contributions, in island order, block by block; ``work`` as in ``weights_of``. A target
        may itself be a contribution (the owner's own): each block is read from every
        contribution before it is overwritten."""
        weights = self.weights_of(accepted, work)
        rule = "weighted_mean" if weights is not None else self.aggregation
        sources = [contributions[i] for i in accepted]
        for spec, target in zip(layout.specs, targets, strict=True):
            flat = target.view(-1)
            scratch = torch.empty((len(sources), min(block_numel, spec.numel)), dtype=spec.dtype)
            for start, n in blocks(spec, block_numel):
                rows = [scratch[i, :n] for i in range(len(sources))]
                for contribution, row in zip(sources, rows, strict=True):
                    contribution.read_into(spec, start, row)
                result = aggregate(rule, rows, weights=weights, trim_ratio=self.trim_ratio)
                flat[start : start + n].copy_(result)


@dataclass(frozen=True)
class RoundTerms:
    """One round's terms, the same on every rank (``mismatched``: island -> why it is left out;
    ``work``, ``swarm_steps``: under a time budget, ``checks.checked_work``'s)."""

    rule: AggregationRule
    chunk_bytes: int
    scatter_steps: int  # chunks of the longest contribution
    gather_steps: int  # chunks of the longest result part
    mismatched: dict[int, str] = field(default_factory=dict)
    work: list[float] | None = None
    swarm_steps: int | None = None


def all_gather_rows(row: Tensor, group: dist.ProcessGroup | None, stats: RoundStats) -> Tensor:
    """Every island's ``row`` stacked in island order, in one all-to-all step (a ring would
    take n - 1 message times); its bytes are counted in ``stats``."""
    n = dist.get_world_size(group)
    rows = torch.empty((n, row.numel()), dtype=row.dtype)
    source = row.reshape(1, -1).expand(n, -1).contiguous()
    dist.all_to_all_single(rows, source, group=group)
    moved = (n - 1) * row.numel() * row.element_size()
    stats.bytes_sent += moved
    stats.bytes_received += moved
    return rows


def agree_island(
    measures: Mapping[int, tuple[bool, float]] | None, num_islands: int, group: dist.ProcessGroup
) -> tuple[bool, list[bool], list[float]]:
    """Combine this rank's ``measures`` (island -> finite, sum of squares; ``None``: this
    rank's peer group failed before validating; a missing island counts as not finite) with
    the island's other model shards' (collective over ``group``). Returns whether every peer
    group validated, and per island whether it is finite everywhere and its norm."""
    flags, sums = [0.0] * num_islands, [0.0] * num_islands
    for island, (finite, sum_sq) in (measures or {}).items():
        flags[island], sums[island] = float(finite), sum_sq
    size = dist.get_world_size(group)
    agreed = agree(measures is not None, gather=flags_over(group, size, _CPU), values=flags + sums)
    totals = agreed.sums
    everywhere = [t == size for t in totals[:num_islands]]
    return agreed.all_ok, everywhere, [math.sqrt(t) for t in totals[num_islands:]]


def island_all(flags: list[bool], group: dist.ProcessGroup | None) -> list[bool]:
    """Each of ``flags`` ANDed over the island's ranks (collective over ``group``; ``None``,
    one rank per island: ``flags``), so no model shard of an island moves unless all do."""
    if group is None:
        return flags
    size = dist.get_world_size(group)
    agreed = agree(gather=flags_over(group, size, _CPU), values=[float(f) for f in flags])
    return [total == size for total in agreed.sums]


def elsewhere_message(round_index: int, what: str) -> str:
    """What a rank raises when another peer group of its model-sharded island failed."""
    return (
        f"swarm round {round_index}: {what} in another shard's peer group of this model-sharded "
        "island (its ranks' logs say why). Anchors are unchanged."
    )


def agree_parts(
    group: dist.ProcessGroup | None,
    parts: list[Part],
    wires: list[PayloadMap],
    codec: Codec | None,
    rule: AggregationRule,
    chunk_bytes: int,
    round_index: int,
    island_group: dist.ProcessGroup | None,
    stats: RoundStats,
    work: Work | None = None,
    model: int = 0,
) -> RoundTerms:
    """Several owners: raise ``SwarmConfigError`` on every rank unless every island cut the
    same parts of the same slices (``model``: ``RoundRequest.layout``) and runs the same rule
    in the same chunks. ``work`` (a time-budgeted round) rides in the same row; a bad one
    raises ``BadWorkError`` on every rank."""
    blob = b"".join(p.layout.to_json() for p in parts)
    blob += f"{codec!r} {rule!r} {chunk_bytes}".encode()
    row = [*_hash_columns(model, blob)]
    row += [] if work is None else [float(work.steps), float(work.inner_steps)]
    table = all_gather_rows(torch.tensor(row, dtype=torch.float64), group, stats)
    hashes = [tuple(r) for r in table[:, :2].tolist()]
    odd = [i for i, h in enumerate(hashes) if h != hashes[0]]
    (same,) = island_all([not odd], island_group)
    if not same and not odd:
        raise SwarmConfigError(elsewhere_message(round_index, "the layout or swarm options differ"))
    if odd:
        raise SwarmConfigError(
            f"swarm round: the pseudo-gradient layout (names, shapes, dtypes), codec or "
            f"swarm options of island(s) {odd} differs from island 0's; every island must "
            "train the same parameters with the same quantize, quantize_block_size and "
            "swarm options (aggregation, trim_ratio, min_contributions, max_norm, "
            "island_weights, chunk_mb)."
        )
    scatter = max(w.num_chunks(chunk_bytes) for w in wires)
    gather = max(p.layout.num_chunks(chunk_bytes) for p in parts)
    terms = RoundTerms(rule, chunk_bytes, scatter, gather)
    return terms if work is None else _with_work(terms, table[:, 2:])


def agree_owner(
    group: dist.ProcessGroup | None,
    island_index: int,
    owner: int,
    layout: PayloadMap,
    wire: PayloadMap,
    codec: Codec | None,
    rule: AggregationRule,
    chunk_bytes: int,
    stats: RoundStats,
    work: Work | None = None,
    model: int = 0,
) -> RoundTerms:
    """One owner: its rule and chunk size rule the round. An island whose slices (``model``:
    ``RoundRequest.layout``), wire layout or codec differ is *mismatched*: it moves nothing,
    its contribution is rejected, and it alone raises after the round's collectives; the
    owner's log names the first difference."""
    description = wire.to_json()
    n = dist.get_world_size(group)
    weights = rule.island_weights if rule.island_weights and len(rule.island_weights) == n else None
    row = [
        *_hash_columns(model, description + layout.to_json() + repr(codec).encode()),
        float(chunk_bytes),
        float(wire.num_chunks(chunk_bytes)),
        float(layout.num_chunks(chunk_bytes)),
        float(len(description)),
        float(AGGREGATIONS.index(rule.aggregation)),
        rule.trim_ratio,
        float(rule.min_contributions),
        math.nan if rule.max_norm is None else rule.max_norm,
    ] + (list(weights) if weights is not None else [math.nan] * n)
    row += [float(work.steps), float(work.inner_steps)] if work is not None else []
    table = all_gather_rows(torch.tensor(row, dtype=torch.float64), group, stats)
    theirs = [float(v) for v in table[owner]][1:]  # after the hash's first half: as before
    if island_index != owner:  # the owner's rule, read back from its row
        rule = AggregationRule(
            AGGREGATIONS[int(theirs[5])],
            theirs[6],
            int(theirs[7]),
            None if math.isnan(theirs[8]) else theirs[8],
            None if math.isnan(theirs[9]) else theirs[9 : 9 + n],
        )
    owners_hash = table[owner, :2].tolist()
    odd = [i for i in range(n) if table[i, :2].tolist() != owners_hash]
    mismatched = {i: "payload layout differs from the aggregator's" for i in odd}
    if odd:
        _name_differences(group, island_index, owner, wire, table[:, 1:], odd, mismatched, stats)
    terms = RoundTerms(rule, int(theirs[1]), int(theirs[2]), int(theirs[3]), mismatched)
    return terms if work is None else _with_work(terms, table[:, 10 + n :])


def _hash_columns(model: int, blob: bytes) -> tuple[float, float]:
    """``hash63`` of the slices' fingerprint and ``blob``, in two halves a float64 carries
    exactly (a row of ``all_gather_rows``)."""
    digest = hash63(model.to_bytes(8, "little") + blob)
    return float(digest >> 32), float(digest & 0xFFFFFFFF)


def _with_work(terms: RoundTerms, columns: Tensor) -> RoundTerms:
    pairs = [(float(steps), float(inner)) for steps, inner in columns.tolist()]
    weights, swarm_steps = checked_work(pairs)
    return replace(terms, work=weights, swarm_steps=swarm_steps)


def _name_differences(
    group: dist.ProcessGroup | None,
    island_index: int,
    owner: int,
    wire: PayloadMap,
    table: Tensor,
    odd: list[int],
    mismatched: dict[int, str],
    stats: RoundStats,
) -> None:
    """The mismatched islands send their descriptions to the owner, which names the first
    difference of each in ``mismatched`` (collective over ``group``)."""
    n = table.shape[0]
    lengths = [int(table[i, 4]) if i in odd else 0 for i in range(n)]
    send = [lengths[island_index] if j == owner and island_index in odd else 0 for j in range(n)]
    recv = lengths if island_index == owner else [0] * n
    blob = bytearray(wire.to_json()) if sum(send) else bytearray()
    out = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    received = torch.empty(sum(recv), dtype=torch.uint8)
    dist.all_to_all_single(received, out, recv, send, group=group)
    stats.bytes_sent += sum(send)
    stats.bytes_received += sum(recv)
    if island_index != owner:
        return
    for i, piece in zip(odd, received.split([lengths[i] for i in odd]), strict=True):
        try:
            difference = wire.difference(PayloadMap.from_json(piece.numpy().tobytes()))
        except ValueError as err:
            mismatched[i] = f"unreadable payload description ({err})"
            continue
        mismatched[i] = f"payload layout differs: {difference or 'the codec differs'}"
