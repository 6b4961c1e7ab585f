"""What the islands of a swarm round agree on before any payload moves: layout, rule, chunks.

Every island sends one row (over ``all_to_all_single``; its bytes are counted), so every rank
holds the same ``RoundTerms``:
- several owners (``agree_shards``): a CRC of the island's shard layouts, codec and options; an
  island that differs from island 0 makes every rank raise ``ValueError`` naming it (ANDed over
  a model-sharded island).
- one owner (``agree_owner``): the owner's rule and chunk size rule the round. An island whose
  wire layout or codec differs is *mismatched*: it moves nothing, its contribution is rejected,
  and it alone raises ``ValueError`` after the round's collectives; it sends the owner its
  layout's description, so that the owner's log names the first difference.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.robust import AGGREGATIONS
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.transport.aggregator.island_verdicts import elsewhere_message, island_all
from lightning_swarm.transport.aggregator.owners import AggregationRule
from lightning_swarm.transport.aggregator.shards import Shard
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.payload import PayloadLayout


@dataclass(frozen=True)
class RoundTerms:
    """One round's terms, the same on every rank (``mismatched``: island -> why it is left
    out, the first difference on the owner)."""

    rule: AggregationRule
    chunk_bytes: int
    scatter_steps: int  # chunks of the longest contribution stream
    gather_steps: int  # chunks of the longest result stream
    mismatched: dict[int, str] = field(default_factory=dict)


def all_gather_rows(row: Tensor, group: dist.ProcessGroup | None, stats: RoundStats) -> Tensor:
    """Every island's ``row`` (one small tensor each) stacked in island order: one all-to-all
    step, where a ring all-gather would take n - 1 message times in sequence."""
    n = dist.get_world_size(group)
    rows = torch.empty((n, row.numel()), dtype=row.dtype)
    source = row.reshape(1, -1).expand(n, -1).contiguous()
    dist.all_to_all_single(rows, source, group=group)
    moved = (n - 1) * row.numel() * row.element_size()
    stats.bytes_sent += moved
    stats.bytes_received += moved
    return rows


def agree_shards(
    group: dist.ProcessGroup | None,
    shards: list[Shard],
    wires: list[PayloadLayout],
    codec: Codec | None,
    rule: AggregationRule,
    chunk_bytes: int,
    round_index: int,
    island_group: dist.ProcessGroup | None,
    stats: RoundStats,
) -> RoundTerms:
    """Several owners: raise ``ValueError`` on every rank unless every island cut the same
    shards and runs the same rule in the same chunks."""
    blob = b"".join(s.layout.to_json() for s in shards)
    blob += f"{codec!r} {rule!r} {chunk_bytes}".encode()
    crcs = all_gather_rows(torch.tensor([zlib.crc32(blob)], dtype=torch.int64), group, stats)
    odd = [i for i, c in enumerate(crcs) if int(c) != int(crcs[0])]
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
    gather = max(s.layout.num_chunks(chunk_bytes) for s in shards)
    return RoundTerms(rule, chunk_bytes, scatter, gather)


def agree_owner(
    group: dist.ProcessGroup | None,
    island_index: int,
    owner: int,
    layout: PayloadLayout,
    wire: PayloadLayout,
    codec: Codec | None,
    rule: AggregationRule,
    chunk_bytes: int,
    stats: RoundStats,
) -> RoundTerms:
    """One owner: the owner's rule and chunk size for every island, and the mismatched
    islands (see the module docstring)."""
    description = wire.to_json()
    n = dist.get_world_size(group)
    weights = rule.island_weights if rule.island_weights and len(rule.island_weights) == n else None
    row = [
        float(zlib.crc32(description + layout.to_json() + repr(codec).encode())),
        float(chunk_bytes),
        float(wire.num_chunks(chunk_bytes)),
        float(layout.num_chunks(chunk_bytes)),
        float(len(description)),
        float(AGGREGATIONS.index(rule.aggregation)),
        rule.trim_ratio,
        float(rule.min_contributions),
        math.nan if rule.max_norm is None else rule.max_norm,
    ] + (list(weights) if weights is not None else [math.nan] * n)
    table = all_gather_rows(torch.tensor(row, dtype=torch.float64), group, stats)
    theirs = [float(v) for v in table[owner]]
    if island_index != owner:  # the owner's rule, read back from its row
        rule = AggregationRule(
            AGGREGATIONS[int(theirs[5])],
            theirs[6],
            int(theirs[7]),
            None if math.isnan(theirs[8]) else theirs[8],
            None if math.isnan(theirs[9]) else theirs[9:],
        )
    odd = [i for i in range(n) if float(table[i, 0]) != theirs[0]]
    mismatched = {i: "payload layout differs from the aggregator's" for i in odd}
    if odd:
        _name_differences(group, island_index, owner, wire, table, odd, mismatched, stats)
    return RoundTerms(rule, int(theirs[1]), int(theirs[2]), int(theirs[3]), mismatched)


def _name_differences(
    group: dist.ProcessGroup | None,
    island_index: int,
    owner: int,
    wire: PayloadLayout,
    table: Tensor,
    odd: list[int],
    mismatched: dict[int, str],
    stats: RoundStats,
) -> None:
    """The mismatched islands send their descriptions to the owner, which fills
    ``mismatched`` with the first difference of each (a collective over ``group``)."""
    n = table.shape[0]
    lengths = [int(table[i, 4]) if i in odd else 0 for i in range(n)]
    send = [lengths[island_index] if j == owner and island_index in odd else 0 for j in range(n)]
    recv = lengths if island_index == owner else [0] * n
    out = torch.empty(sum(send), dtype=torch.uint8)
    if sum(send):
        out.copy_(torch.frombuffer(bytearray(wire.to_json()), dtype=torch.uint8))
    received = torch.empty(sum(recv), dtype=torch.uint8)
    dist.all_to_all_single(received, out, recv, send, group=group)
    stats.bytes_sent += sum(send)
    stats.bytes_received += sum(recv)
    if island_index != owner:
        return
    offset = 0
    for i in odd:
        blob = received[offset : offset + lengths[i]].numpy().tobytes()
        offset += lengths[i]
        try:
            difference = wire.difference(PayloadLayout.from_json(blob))
        except ValueError as err:
            mismatched[i] = f"unreadable payload description ({err})"
            continue
        mismatched[i] = f"payload layout differs: {difference or 'the codec differs'}"
