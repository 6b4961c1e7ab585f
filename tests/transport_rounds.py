"""One transport round over named tensors, for tests and benchmarks, and a base for stand-ins.

``average`` drives a transport through its bucket contract (``transport.base.Transport``) the
way the round engine's held round does: the tensors back to back in one float32 buffer, planned
on the transport's buckets and blocks, every bucket started, waited for, then ``agree``; the
mean is copied back into the caller's tensors. ``average_flat`` is that round alone, on a buffer
the caller already holds (as the engine holds its own), so a benchmark can leave the copy in and
out of the buffer outside what it measures. ``NamedRound`` is a base for stand-in transports
scripted as one call per round over named tensors (``average_named``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor

from lightning_swarm.algorithm.diloco import max_abs
from lightning_swarm.transport.base import (
    Bucket,
    Done,
    Handle,
    Opening,
    RoundRequest,
    RoundStats,
    Transport,
    Work,
)
from lightning_swarm.transport.buckets import numel_of, plan_buckets


def average(
    transport: Transport,
    tensors: Mapping[str, Tensor],
    *,
    round_index: int,
    work: Work | None = None,
    layout: int = 0,
) -> RoundStats:
    """Overwrite ``tensors`` (contiguous float32, the same names and shapes on every rank) with
    their mean over ``transport``'s islands; collective as the transport's round is. ``work``
    (a time-budgeted round) and ``layout`` (``RoundRequest.layout``) go to ``open``, and the
    tensors are scaled as its ``Opening`` says, as the round engine does.

    Raises:
        ValueError: a tensor is not contiguous float32 (the contract moves float32 buckets).
        Whatever the transport raises (e.g. ``NonFinitePseudoGradientError`` at ``open``).
    """
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"a round moves contiguous float32 tensors; {name!r} is {t.dtype}")
    start = time.perf_counter()
    values = list(tensors.values())
    flat = torch.cat([t.reshape(-1) for t in values]) if values else torch.empty(0)
    shapes = {n: t.shape for n, t in tensors.items()}
    stats = average_flat(transport, flat, shapes, round_index=round_index, work=work, layout=layout)
    offset = 0
    for t in values:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return replace(stats, wall_s=time.perf_counter() - start)


def average_flat(
    transport: Transport,
    flat: Tensor,
    shapes: Mapping[str, torch.Size],
    *,
    round_index: int,
    work: Work | None = None,
    layout: int = 0,
) -> RoundStats:
    """Overwrite ``flat`` (contiguous float32: the tensors of ``shapes``, in order, back to back)
    with its mean over ``transport``'s islands, as ``average`` does, without copying it: the
    round allocates only what the transport does (the finite flag is one ``aminmax``, as the
    round engine's). ``wall_s`` is this round's.

    Raises:
        ValueError: ``flat`` is not contiguous float32, or not as long as ``shapes`` together.
        Whatever the transport raises.
    """
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        raise ValueError(f"a round moves a contiguous float32 buffer; got {flat.dtype}")
    sizes = [shape.numel() for shape in shapes.values()]
    if sum(sizes) != flat.numel():
        raise ValueError(f"shapes hold {sum(sizes)} elements, the buffer {flat.numel()}")
    start = time.perf_counter()
    finite = flat.numel() == 0 or bool(torch.isfinite(max_abs([flat])).item())
    request = RoundRequest(round_index, finite, dict(shapes), work=work, layout=layout)
    opening = transport.open(request)
    if opening.scale != 1.0:
        flat.mul_(opening.scale)
    plan = plan_buckets(sizes, transport.bucket_numel, transport.block_size)
    handles: list[Handle] = []
    offset = 0
    for bucket in plan:
        numel = numel_of(bucket)
        runs = tuple(p.length for p in bucket)
        handles.append(transport.start(Bucket(flat[offset : offset + numel], runs)))
        offset += numel
    sent = sum(handle.wait() for handle in handles)
    stats = transport.agree()
    return replace(
        stats,
        bytes_sent=stats.bytes_sent + sent,
        bytes_received=stats.bytes_received + sent,
        wall_s=time.perf_counter() - start,
    )


class NamedRound:
    """A stand-in transport scripted per round: ``average_named`` gets the round's tensors by
    name (views of the engine's buffer; overwrite them with the "mean") at ``agree`` and
    returns the verdict. Not pipelined: every bucket arrives before ``agree``."""

    pipelined = False
    heals = False
    every_rank_in_round = False
    block_size = 1
    bucket_numel = 1 << 30

    def open(self, request: RoundRequest) -> Opening:
        self._round_index, self._names = request.round_index, dict(request.names)
        self._flats: list[Tensor] = []
        return Opening()

    def start(self, bucket: Bucket) -> Handle:
        self._flats.append(bucket.flat)
        return Done()

    def agree(self) -> RoundStats:
        assert len(self._flats) <= 1, "a stand-in round has one bucket"
        flat = self._flats[0] if self._flats else torch.empty(0)
        named, offset = {}, 0
        for name, shape in self._names.items():
            named[name] = flat[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        return self.average_named(named, round_index=self._round_index)

    def average_named(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        """Overwrite ``tensors`` with this stand-in's "mean"; the default leaves them."""
        return RoundStats()

    def close(self) -> None:
        pass
