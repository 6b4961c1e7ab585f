"""The mean of a round with several owners, summed as chunks arrive (``mean``, ``weighted_mean``).

Each scatter step brings chunk k of every contribution; the owner adds them and its own in
island order into a float32 accumulator of its part, with the rule's operations in its order
(``algorithm.robust``), so the result is bitwise the spooled path's whenever every island is
accepted. A non-finite sum cannot name the island, so the caller judges the round again through
the spool. Memory: one float32 part, plus one chunk for weighted means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.transport.aggregator.contributions import all_finite
from lightning_swarm.transport.aggregator.exchange import Exchange
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.payload import PayloadLayout

FOLDED_RULES = ("mean", "weighted_mean")


def folds(
    layout: PayloadLayout, aggregation: str, max_norm: float | None, chunk_bytes: int
) -> bool:
    """Whether a round of ``layout`` can be summed as it arrives: a running-sum rule, no
    ``max_norm`` (that needs each island's norm), float32 tensors only and chunks of whole
    elements (the caller also rules out codecs). Pass the round's whole layout, which every
    island agreed on, not a part's: every island must take the same way."""
    return (
        aggregation in FOLDED_RULES
        and max_norm is None
        and chunk_bytes % 4 == 0
        and all(spec.dtype == torch.float32 for spec in layout.specs)
    )


class PartFold:
    """The running (weighted) sum of every island's contribution to one part.

    Args:
        layout: the part's layout (float32 tensors; ``folds`` said yes).
        own: this island's flat views of the part, in ``layout`` order; read, never written
            until ``write_into``.
        island_index: this island; its contribution enters the sum at its place.
        num_islands: every island is summed.
        chunk_bytes: bytes per chunk of the scatter.
        weights: one weight per island for ``weighted_mean``; ``None`` for ``mean``.
    """

    def __init__(
        self,
        layout: PayloadLayout,
        own: Sequence[Tensor],
        island_index: int,
        num_islands: int,
        chunk_bytes: int,
        weights: Sequence[float] | None,
    ) -> None:
        assert chunk_bytes % 4 == 0 and all(s.dtype == torch.float32 for s in layout.specs)
        self.layout, self.own = layout, list(own)
        self.me, self.n, self.chunk_bytes = island_index, num_islands, chunk_bytes
        self.weights = list(weights) if weights is not None else None
        self.acc = torch.empty(layout.data_bytes // 4, dtype=torch.float32)
        scratch = min(chunk_bytes, layout.data_bytes) // 4 if weights is not None else 0
        self._scratch = torch.empty(scratch, dtype=torch.float32)

    def add(self, k: int, chunks: Mapping[int, Tensor]) -> None:
        """Add chunk ``k`` of every island: ``chunks`` maps each peer to its chunk (uint8);
        this island's own comes from ``own``. A step past the part's end has no chunks."""
        if not chunks:
            return
        base = k * self.chunk_bytes // 4
        for island in range(self.n):
            if island == self.me:
                for p in self.layout.chunk_pieces(k, self.chunk_bytes):
                    lo, count = base + p.chunk_start // 4, p.length // 4
                    src = self.own[p.index][p.tensor_start // 4 : p.tensor_start // 4 + count]
                    self._fold(island, self.acc[lo : lo + count], src)
            else:
                src = chunks[island].view(torch.float32)
                self._fold(island, self.acc[base : base + src.numel()], src)

    def _fold(self, island: int, dst: Tensor, src: Tensor) -> None:
        if self.weights is None:
            if island == 0:
                dst.copy_(src)
            else:
                dst.add_(src)
            return
        if island == 0:
            torch.mul(src, self.weights[0], out=dst)
        else:
            # Multiply, then add, as weighted_mean does: add_(alpha=w) may fuse the two.
            term = self._scratch[: src.numel()]
            torch.mul(src, self.weights[island], out=term)
            dst.add_(term)

    def collect(
        self,
        exchange: Exchange,
        sources: list[list[Tensor]],
        wires: list[PayloadLayout],
        stats: RoundStats,
        steps: int,
    ) -> tuple[bool, Exception | None]:
        """Run the scatter (``exchange.scatter_steps``), adding every step's chunks, then divide.

        Returns whether the mean is finite, and the exception the sum raised, if any: the
        scatter still runs to its end then, so that no peer blocks in a step this island left.
        """
        error: Exception | None = None
        for k, chunks in exchange.scatter_steps(sources, wires, stats, steps):
            if error is None:
                try:
                    with record_function(labels.AGGREGATE):
                        self.add(k, chunks)
                except Exception as err:
                    error = err
        if error is not None:
            return False, error
        try:
            with record_function(labels.AGGREGATE):
                return self.finish(), None
        except Exception as err:
            return False, err

    def finish(self) -> bool:
        """Divide the sum into the mean; whether every value is finite (so every island's
        part was)."""
        self.acc.div_(self.n if self.weights is None else sum(self.weights))
        return all_finite(self.acc)

    def write_into(self, targets: Sequence[Tensor]) -> None:
        """Copy the mean into ``targets`` (flat views in ``layout`` order)."""
        for spec, target in zip(self.layout.specs, targets, strict=True):
            start = spec.offset // 4
            target.copy_(self.acc[start : start + spec.numel])
