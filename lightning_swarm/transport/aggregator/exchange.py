"""The two exchanges of a swarm round, in chunks over ``all_to_all_single``.

``scatter`` sends part j of every payload to island j, step k moving chunk k of each payload
into the owner's sinks (a spool error turns a sink into a discard sink and is returned, so no
peer blocks); ``gather`` sends every owner's result part to every island, into its tensors.
Every island runs the same steps with split sizes that follow from the agreed layouts; a refused
island sends and receives nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.transport.aggregator.contributions import DiscardSink, Sink
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadLayout, pack_chunk, unpack_chunk


def chunk_size(layout: PayloadLayout, k: int, chunk_bytes: int) -> int:
    """Bytes of chunk ``k`` of ``layout`` (0 past its end)."""
    return max(0, min(chunk_bytes, layout.data_bytes - k * chunk_bytes))


class Exchange:
    """Chunked all-to-all scatter and gather over the peer group (group rank = island index)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        island_index: int,
        num_islands: int,
        chunk_bytes: int,
        silent: frozenset[int] = frozenset(),
    ) -> None:
        self.group, self.me, self.n = group, island_index, num_islands
        self.chunk_bytes, self.silent = chunk_bytes, silent

    def _talks(self, peer: int) -> bool:
        """Whether this island exchanges chunks with ``peer``."""
        return peer != self.me and peer not in self.silent and self.me not in self.silent

    def scatter(
        self,
        sources: list[list[Tensor]],
        wires: list[PayloadLayout],
        sinks: dict[int, Sink],
        stats: RoundStats,
        steps: int,
    ) -> SpoolError | None:
        """Send ``sources[j]`` (uint8 views in ``wires[j]``'s order) to island j; write what
        each peer i sends for this island's part (``wires[me]``) into ``sinks[i]``."""
        failure: SpoolError | None = None
        for k, chunks in self.scatter_steps(sources, wires, stats, steps):
            for i, chunk in chunks.items():
                try:
                    sinks[i].write(k * self.chunk_bytes, chunk)
                except SpoolError as err:
                    failure = failure or err
                    sinks[i] = DiscardSink()
        return failure

    def scatter_steps(
        self, sources: list[list[Tensor]], wires: list[PayloadLayout], stats: RoundStats, steps: int
    ) -> Iterator[tuple[int, dict[int, Tensor]]]:
        """The scatter, step by step: yields ``(k, {peer: chunk k of its contribution to this
        island's part})`` (uint8 views of the receive buffer, valid until the next step; no
        entries past the part's end). The caller must run the generator to its end, or the
        other islands wait in the step it left."""
        size_in = [chunk_size(wires[self.me], k, self.chunk_bytes) for k in range(steps)]
        # One send and one receive buffer for the whole exchange: buffers allocated per step
        # would pile up in the allocator.
        send_buf, recv_buf = self._buffers()
        for k in range(steps):
            send_sizes = [
                chunk_size(wires[j], k, self.chunk_bytes) if self._talks(j) else 0
                for j in range(self.n)
            ]
            offset = 0
            for j, size in enumerate(send_sizes):
                if size:
                    pack_chunk(sources[j], wires[j], k, self.chunk_bytes, send_buf[offset:])
                offset += size
            recv_sizes = [size_in[k] if self._talks(i) else 0 for i in range(self.n)]
            yield k, self._all_to_all(send_buf, recv_buf, send_sizes, recv_sizes, stats)

    def gather(
        self, views: list[list[Tensor]], layouts: list[PayloadLayout], stats: RoundStats, steps: int
    ) -> None:
        """Send this island's result (``views[me]``, uint8, in ``layouts[me]``'s order) to every
        island, and unpack every other island's into ``views[i]``."""
        me = self.me
        receivers = sum(self._talks(j) for j in range(self.n))
        send_buf, recv_buf = self._buffers()
        for k in range(steps):
            size_out = chunk_size(layouts[me], k, self.chunk_bytes)
            if size_out and receivers:
                pack_chunk(views[me], layouts[me], k, self.chunk_bytes, send_buf)
                for copy in range(1, receivers):  # the same chunk for every receiving island
                    send_buf[copy * size_out : (copy + 1) * size_out].copy_(send_buf[:size_out])
            send_sizes = [size_out if self._talks(j) else 0 for j in range(self.n)]
            recv_sizes = [
                chunk_size(layouts[i], k, self.chunk_bytes) if self._talks(i) else 0
                for i in range(self.n)
            ]
            received = self._all_to_all(send_buf, recv_buf, send_sizes, recv_sizes, stats)
            for i, piece in received.items():
                unpack_chunk(piece, layouts[i], k, self.chunk_bytes, views[i])

    def _buffers(self) -> tuple[Tensor, Tensor]:
        """A send and a receive buffer of one chunk per peer, for one exchange."""
        size = (self.n - 1) * self.chunk_bytes
        return torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)

    def _all_to_all(
        self,
        send_buf: Tensor,
        recv_buf: Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        stats: RoundStats,
    ) -> dict[int, Tensor]:
        """One step; returns ``{island: what it sent here}`` (views of ``recv_buf``) for every
        island that sent something."""
        received = recv_buf[: sum(recv_sizes)]
        dist.all_to_all_single(
            received,
            send_buf[: sum(send_sizes)],
            output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes,
            group=self.group,
        )
        stats.bytes_sent += sum(send_sizes)
        stats.bytes_received += sum(recv_sizes)
        chunks: dict[int, Tensor] = {}
        offset = 0
        for i, size in enumerate(recv_sizes):
            if size:
                chunks[i] = received[offset : offset + size]
            offset += size
        return chunks
