"""Which part of a round's payload each island aggregates (owns) in a swarm round.

Pure planning (torch only). The caller's tensors, in layout order, are cut into ``num_islands``
*shards* with ``transport.pieces.plan_shares`` over whole tensors: shard j holds a contiguous
run of elements ``[j * U // n, (j + 1) * U // n)`` of the U alignment units, so shards are
balanced to within one unit and may be empty. A unit is ``align`` elements (the codec's block,
made even for int4: ``CodedPayload.align``; 1 without a codec), so every shard piece starts on a
codec block of its tensor: encoding a piece on its own quantizes it exactly as encoding the
whole tensor would, and error feedback upstream stays exact.

A shard is itself a payload: ``Shard.layout`` names each piece ``"<tensor>[start:stop]"`` as a
flat tensor of the piece's dtype, so the spool, the codec's wire layout, validation and the
aggregation rules run on it unchanged. ``Shard.views`` are the caller's elements of the shard as
flat views (no copy): aggregation writes through them, and the result of another island's shard
is received straight into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from lightning_swarm.transport.payload import PayloadLayout
from lightning_swarm.transport.pieces import Piece, plan_shares


@dataclass(frozen=True)
class Shard:
    """One island's share of a round's payload."""

    island: int
    pieces: tuple[Piece, ...]
    layout: PayloadLayout

    def views(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Flat views of the shard's elements of ``tensors`` (in the full layout's order)."""
        return [tensors[p.tensor_index].view(-1)[p.start : p.start + p.length] for p in self.pieces]


def plan_shards(layout: PayloadLayout, num_islands: int, align: int) -> list[Shard]:
    """Cut the payload of ``layout`` into ``num_islands`` shards on multiples of ``align``.

    Raises:
        ValueError: ``num_islands < 1`` or ``align < 1``.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    whole = [Piece(spec.index, 0, spec.numel) for spec in layout.specs]
    shards = []
    for island, pieces in enumerate(plan_shares(whole, num_islands, align)):
        entries = []
        for p in pieces:
            spec = layout.specs[p.tensor_index]
            entries.append(
                (f"{spec.name}[{p.start}:{p.start + p.length}]", (p.length,), spec.dtype)
            )
        shards.append(Shard(island, tuple(pieces), PayloadLayout(entries)))
    return shards


def whole_shards(layout: PayloadLayout, num_islands: int, owner: int) -> list[Shard]:
    """The whole payload to island ``owner`` (its own names and shapes, so its spool files
    are the payload's), empty shards to the others."""
    whole = tuple(Piece(spec.index, 0, spec.numel) for spec in layout.specs)
    empty = PayloadLayout([])
    return [
        Shard(j, whole, layout) if j == owner else Shard(j, (), empty) for j in range(num_islands)
    ]
