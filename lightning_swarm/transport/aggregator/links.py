"""Chunked point-to-point streams of one payload over a process group.

A payload (see ``layout``) travels as its byte stream cut into ``chunk_bytes`` chunks, with two
chunks in flight per stream: while one is on the wire the next is packed (sender) or the last
one is unpacked or written (receiver). Buffers live on ``device`` (CPU for gloo, the GPU for
NCCL) and are allocated per call, so nothing stays resident between rounds.

``Link.recv_into_sinks`` receives from several peers at once, each into its own sink (see
``contributions``): memory is two chunks per peer whatever the payload size. A sink that fails
(a spool error) is swapped for a discard sink, and the peer's remaining chunks are still
received so that its sends complete and the process group stays usable.

Ranks are global ranks, as ``torch.distributed`` point-to-point ops expect. Tags keep message
kinds apart on gloo; within a kind, messages between two ranks match in posting order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.transport.aggregator.contributions import DiscardSink, Sink
from lightning_swarm.transport.aggregator.round_status import Descriptor
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadLayout, byte_view, pack_chunk, unpack_chunk

TAG_DESCRIPTOR, TAG_DESCRIPTION, TAG_CHUNK, TAG_STATUS, TAG_RESULT = 51, 52, 53, 54, 55


@dataclass
class IncomingPayload:
    """What a peer announced it will send: ``data_bytes`` in chunks of ``chunk_bytes``."""

    island: int
    rank: int
    data_bytes: int
    chunk_bytes: int
    layout_problem: str | None = None

    @property
    def num_chunks(self) -> int:
        return -(-self.data_bytes // self.chunk_bytes)

    def chunk_size(self, k: int) -> int:
        return min(self.chunk_bytes, self.data_bytes - k * self.chunk_bytes)


class Link:
    """Point-to-point sends and receives over ``group`` with buffers on ``device``."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device

    def isend(self, tensor: Tensor, dst: int, tag: int) -> dist.Work:
        work = dist.isend(tensor, dst=dst, group=self.group, tag=tag)
        assert work is not None, "this rank is not a member of the peer group"
        return work

    def irecv(self, tensor: Tensor, src: int, tag: int) -> dist.Work:
        work = dist.irecv(tensor, src=src, group=self.group, tag=tag)
        assert work is not None, "this rank is not a member of the peer group"
        return work

    def send_description(self, dst: int, wire: PayloadLayout, chunk_bytes: int) -> int:
        """Announce a payload of layout ``wire`` to ``dst``; return the bytes sent."""
        description = torch.frombuffer(bytearray(wire.to_json()), dtype=torch.uint8)
        head = Descriptor(description.numel(), wire.data_bytes, chunk_bytes).to_tensor()
        works = [
            self.isend(head, dst, TAG_DESCRIPTOR),
            self.isend(description, dst, TAG_DESCRIPTION),
        ]
        for w in works:
            w.wait()
        return Descriptor.NBYTES + description.numel()

    def recv_descriptions(
        self, ranks: dict[int, int], layout: PayloadLayout
    ) -> tuple[list[IncomingPayload], int]:
        """Every peer's announcement (``ranks``: island -> global rank), and the bytes taken.

        A peer whose layout differs from ``layout`` is noted in its plan, not fatal.
        """
        heads = {i: Descriptor.empty() for i in ranks}
        for w in [self.irecv(heads[i], ranks[i], TAG_DESCRIPTOR) for i in ranks]:
            w.wait()
        descriptors = {i: Descriptor.from_tensor(heads[i]) for i in ranks}
        blobs = {
            i: torch.empty(d.description_len, dtype=torch.uint8) for i, d in descriptors.items()
        }
        for w in [self.irecv(blobs[i], ranks[i], TAG_DESCRIPTION) for i in ranks]:
            w.wait()
        plans, received = [], 0
        for i, d in descriptors.items():
            received += Descriptor.NBYTES + d.description_len
            problem = _layout_problem(layout, blobs[i])
            plans.append(IncomingPayload(i, ranks[i], d.data_bytes, max(1, d.chunk_bytes), problem))
        return plans, received

    def _buffers(self, chunk_bytes: int, data_bytes: int) -> list[Tensor]:
        size = min(chunk_bytes, max(data_bytes, 1))
        return [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def send_stream(
        self,
        dsts: list[int],
        layout: PayloadLayout,
        sources: list[Tensor],
        chunk_bytes: int,
        tag: int,
    ) -> int:
        """Send the payload of ``sources`` to every rank in ``dsts``; return bytes sent."""
        views = [byte_view(t) for t in sources]
        buffers = self._buffers(chunk_bytes, layout.data_bytes)
        inflight: list[list[dist.Work]] = [[], []]
        sent = 0
        for k in range(layout.num_chunks(chunk_bytes)):
            slot = k % 2
            for w in inflight[slot]:  # the buffer is reused only once its sends completed
                w.wait()
            n = pack_chunk(views, layout, k, chunk_bytes, buffers[slot])
            inflight[slot] = [self.isend(buffers[slot][:n], dst, tag) for dst in dsts]
            sent += n * len(dsts)
        for works in inflight:
            for w in works:
                w.wait()
        return sent

    def recv_stream(
        self, src: int, layout: PayloadLayout, targets: list[Tensor], chunk_bytes: int, tag: int
    ) -> int:
        """Receive a payload from ``src`` into ``targets`` (same layout); return bytes received."""
        views = [byte_view(t) for t in targets]
        buffers = self._buffers(chunk_bytes, layout.data_bytes)
        incoming = IncomingPayload(-1, src, layout.data_bytes, chunk_bytes)
        pending = deque(
            self._post(incoming, k, buffers, tag) for k in range(min(2, incoming.num_chunks))
        )
        while pending:
            k, work, chunk = pending.popleft()
            work.wait()
            unpack_chunk(chunk, layout, k, chunk_bytes, views)
            if k + 2 < incoming.num_chunks:
                pending.append(self._post(incoming, k + 2, buffers, tag))
        return layout.data_bytes

    def recv_into_sinks(
        self, incoming: list[IncomingPayload], sinks: dict[int, Sink], tag: int
    ) -> tuple[int, SpoolError | None]:
        """Receive every peer's chunks concurrently, each into ``sinks[island]``.

        Returns the bytes received and the first spool error met (``None`` if all went well).
        After an error every sink is aborted, but every chunk is still received.
        """
        failure: SpoolError | None = None
        buffers = {p.island: self._buffers(p.chunk_bytes, p.data_bytes) for p in incoming}
        queues = {
            p.island: deque(
                self._post(p, k, buffers[p.island], tag) for k in range(min(2, p.num_chunks))
            )
            for p in incoming
        }
        by_island = {p.island: p for p in incoming}
        received = 0
        while any(queues.values()):
            for island, queue in queues.items():
                if not queue:
                    continue
                p = by_island[island]
                k, work, chunk = queue.popleft()
                work.wait()
                received += chunk.numel()
                try:
                    sinks[island].write(k * p.chunk_bytes, chunk)
                except SpoolError as err:
                    failure = failure or err
                    sinks[island] = DiscardSink()  # the writer already removed its file
                if k + 2 < p.num_chunks:
                    queue.append(self._post(p, k + 2, buffers[island], tag))
        if failure is not None:
            for sink in sinks.values():
                sink.abort()
        return received, failure

    def _post(
        self, p: IncomingPayload, k: int, buffers: list[Tensor], tag: int
    ) -> tuple[int, dist.Work, Tensor]:
        chunk = buffers[k % 2][: p.chunk_size(k)]
        return k, self.irecv(chunk, p.rank, tag), chunk


def _layout_problem(layout: PayloadLayout, blob: Tensor) -> str | None:
    try:
        theirs = PayloadLayout.from_json(blob.numpy().tobytes())
    except ValueError as err:
        return f"unreadable payload description ({err})"
    difference = layout.difference(theirs)
    return None if difference is None else f"payload layout differs: {difference}"
