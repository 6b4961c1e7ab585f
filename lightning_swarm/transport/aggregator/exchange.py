"""A swarm round's two chunked ``all_to_all_single`` exchanges (every island runs the same
steps, with split sizes from the agreed layouts), and the fold of the scatter (``PartFold``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.transport.aggregator.contributions import all_finite
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.payload import PayloadMap, byte_view, pack_chunk, unpack_chunk


@dataclass
class Exchange:
    """Chunked all-to-all scatter and gather over the peer group (group rank = island index
    ``me`` of ``n``), their bytes counted in ``stats``; ``silent`` islands move nothing."""

    group: dist.ProcessGroup | None
    me: int
    n: int
    chunk_bytes: int
    silent: frozenset[int]
    stats: RoundStats

    def scatter(
        self,
        sources: list[list[Tensor]],
        wires: list[PayloadMap],
        steps: int,
        into: list[PayloadMap] | None = None,
    ) -> Iterator[tuple[int, dict[int, Tensor]]]:
        """Send ``sources[j]`` (uint8 views in ``wires[j]``'s order) to island j, yielding
        ``(k, {peer i: chunk k of what it sent here, in into[i]'s order})`` (default: this
        island's wire), uint8 views valid until the next step. Run it to its end, or the other
        islands wait in the step it left."""
        into = into or [wires[self.me]] * self.n
        # One send and one receive buffer for the whole exchange: buffers allocated per step
        # would pile up in the allocator.
        send_buf = torch.empty((self.n - 1) * self.chunk_bytes, dtype=torch.uint8)
        recv_buf = torch.empty_like(send_buf)
        for k in range(steps):
            send_sizes = [self._size(wires[j], k, j) for j in range(self.n)]
            offset = 0
            for j, size in enumerate(send_sizes):
                if size:
                    pack_chunk(sources[j], wires[j], k, self.chunk_bytes, send_buf[offset:])
                offset += size
            recv_sizes = [self._size(into[i], k, i) for i in range(self.n)]
            received = recv_buf[: sum(recv_sizes)]
            dist.all_to_all_single(
                received,
                send_buf[: sum(send_sizes)],
                output_split_sizes=recv_sizes,
                input_split_sizes=send_sizes,
                group=self.group,
            )
            self.stats.bytes_sent += sum(send_sizes)
            self.stats.bytes_received += sum(recv_sizes)
            pieces = received.split(recv_sizes)
            yield k, {i: piece for i, piece in enumerate(pieces) if recv_sizes[i]}

    def gather(self, views: list[list[Tensor]], layouts: list[PayloadMap], steps: int) -> None:
        """Send this island's result (``views[me]``, uint8, in ``layouts[me]``'s order) to every
        island, and unpack every other island's into ``views[i]``."""
        mine = [layouts[self.me]] * self.n
        for k, received in self.scatter([views[self.me]] * self.n, mine, steps, layouts):
            for i, piece in received.items():
                unpack_chunk(piece, layouts[i], k, self.chunk_bytes, views[i])

    def _size(self, layout: PayloadMap, k: int, peer: int) -> int:
        """Bytes of chunk ``k`` of ``layout`` this island exchanges with ``peer``."""
        if peer == self.me or peer in self.silent or self.me in self.silent:
            return 0
        return max(0, min(self.chunk_bytes, layout.data_bytes - k * self.chunk_bytes))


def folds(layout: PayloadMap, aggregation: str, max_norm: float | None, chunk_bytes: int) -> bool:
    """Whether a round can be summed as it arrives (``PartFold``): a running-sum rule, no
    ``max_norm`` (it needs each island's norm), float32 only, chunks of whole elements (the
    caller rules out codecs). Pass the whole layout, which every island agreed on, not a part's:
    every island must take the same way."""
    return (
        aggregation in ("mean", "weighted_mean")
        and max_norm is None
        and chunk_bytes % 4 == 0
        and all(spec.dtype == torch.float32 for spec in layout.specs)
    )


class PartFold:
    """The running (weighted: one weight per island) sum of every island's contribution to this
    island's part. Chunk k of every island (its own from ``own``, flat views of the part, read,
    never written until ``write_into``) is added in island order with ``robust``'s operations,
    so the mean is bitwise the spooled path's when every island is accepted. A non-finite sum
    cannot name the island: the caller judges the round again through the spool."""

    def __init__(
        self,
        layout: PayloadMap,
        own: Sequence[Tensor],
        island_index: int,
        num_islands: int,
        chunk_bytes: int,
        weights: Sequence[float] | None,
    ) -> None:
        assert chunk_bytes % 4 == 0 and all(s.dtype == torch.float32 for s in layout.specs)
        self.layout, self.own = layout, [byte_view(t) for t in own]
        self.me, self.n, self.chunk_bytes = island_index, num_islands, chunk_bytes
        self.weights = list(weights) if weights is not None else None
        self.acc = torch.empty(layout.data_bytes // 4, dtype=torch.float32)
        chunk = min(chunk_bytes, layout.data_bytes)
        self._own_chunk = torch.empty(chunk, dtype=torch.uint8)
        self._scratch = torch.empty(chunk // 4 if weights is not None else 0, dtype=torch.float32)

    def add(self, k: int, chunks: Mapping[int, Tensor]) -> None:
        """Add chunk ``k`` of every island (``chunks``: each peer's, uint8); none past the
        part's end."""
        if not chunks:
            return
        base = k * self.chunk_bytes // 4
        for island in range(self.n):
            if island == self.me:
                size = pack_chunk(self.own, self.layout, k, self.chunk_bytes, self._own_chunk)
                src = self._own_chunk[:size].view(torch.float32)
            else:
                src = chunks[island].view(torch.float32)
            if self.weights is not None:  # a separate multiply and add, as weighted_mean does
                src = torch.mul(src, self.weights[island], out=self._scratch[: src.numel()])
            dst = self.acc[base : base + src.numel()]
            if island == 0:
                dst.copy_(src)
            else:
                dst.add_(src)

    def finish(self) -> bool:
        """Divide the sum into the mean; whether every value is finite."""
        self.acc.div_(self.n if self.weights is None else sum(self.weights))
        return all_finite(self.acc)

    def write_into(self, targets: Sequence[Tensor]) -> None:
        """Copy the mean into ``targets`` (flat float32 views in ``layout`` order)."""
        for spec, target in zip(self.layout.specs, targets, strict=True):
            start = spec.offset // 4
            target.copy_(self.acc[start : start + spec.numel])
