"""Which part of a round's payload each island owns (pure planning, torch only).

``plan_parts`` cuts the tensors, in layout order, into ``num_islands`` contiguous runs of
alignment units (``transport.buckets.plan_shares``): balanced within one unit, possibly empty,
every piece starting on a codec block so that encoding a piece equals encoding the whole tensor.
``whole_part`` gives the whole payload to one owner. A ``Part`` is itself a payload (``layout``
names each piece ``"<tensor>[start:stop]"``), and its ``views`` are flat views of the caller's
elements, written in place by the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from lightning_swarm.transport.buckets import Piece, plan_shares
from lightning_swarm.transport.payload import PayloadLayout


@dataclass(frozen=True)
class Part:
    """The part of a round's payload that island ``island`` owns."""

    island: int
    pieces: tuple[Piece, ...]
    layout: PayloadLayout

    def views(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Flat views of the part's elements of ``tensors`` (in the full layout's order)."""
        return [tensors[p.tensor_index].view(-1)[p.start : p.stop] for p in self.pieces]


def plan_parts(layout: PayloadLayout, num_islands: int, align: int) -> list[Part]:
    """Cut the payload of ``layout`` into ``num_islands`` parts on multiples of ``align``.

    Raises:
        ValueError: ``num_islands < 1`` or ``align < 1``.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    whole = [Piece(spec.index, 0, spec.numel) for spec in layout.specs]
    parts = []
    for island, pieces in enumerate(plan_shares(whole, num_islands, align)):
        entries = []
        for p in pieces:
            spec = layout.specs[p.tensor_index]
            entries.append((f"{spec.name}[{p.start}:{p.stop}]", (p.length,), spec.dtype))
        parts.append(Part(island, tuple(pieces), PayloadLayout(entries)))
    return parts


def whole_part(layout: PayloadLayout, num_islands: int, owner: int) -> list[Part]:
    """The whole payload to island ``owner`` (its own names and shapes, so its spool files
    are the payload's), empty parts to the others."""
    whole = tuple(Piece(spec.index, 0, spec.numel) for spec in layout.specs)
    empty = PayloadLayout([])
    return [
        Part(j, whole, layout) if j == owner else Part(j, (), empty) for j in range(num_islands)
    ]
