"""Where a peer's payload lands (a *sink*: a ``spool.SpoolWriter``, a ``MemorySink`` with
offload off, ``None`` to drop a refused peer's chunks) and how it is read back (a
*contribution*), one block at a time: memory is contributions x one block, never x model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadLayout, TensorSpec


class Contribution(Protocol):
    def read_into(self, spec: TensorSpec, start: int, out: Tensor) -> None: ...

    def close(self) -> None: ...


class Sink(Protocol):
    def write(self, data_offset: int, chunk: Tensor) -> None: ...

    def finish(self) -> Contribution: ...

    def abort(self) -> None: ...


class MemoryContribution:
    """A payload held in memory as flat per-tensor views, in layout order (no copy)."""

    def __init__(self, views: Sequence[Tensor]) -> None:
        self._views = [v.detach().reshape(-1) for v in views]

    def read_into(self, spec: TensorSpec, start: int, out: Tensor) -> None:
        out.copy_(self._views[spec.index][start : start + out.numel()])

    def close(self) -> None:
        self._views = []


class MemorySink:
    def __init__(self, layout: PayloadLayout) -> None:
        self.layout = layout
        self.buffer = torch.empty(layout.data_bytes, dtype=torch.uint8)

    def write(self, data_offset: int, chunk: Tensor) -> None:
        self.buffer[data_offset : data_offset + chunk.numel()].copy_(chunk)

    def finish(self) -> Contribution:
        b, specs = self.buffer, self.layout.specs
        return MemoryContribution([b[s.offset : s.offset + s.nbytes].view(s.dtype) for s in specs])

    def abort(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


def open_sinks(
    sinks: dict[int, Sink | None],
    islands: list[int],
    accepted_layout: list[int],
    layout: PayloadLayout,
    spool: Spool | None,
    round_id: int,
    *,
    remap_bytes: int,
) -> SpoolError | None:
    """Add one sink per peer island to ``sinks``: a spool file (``spool`` given) or memory for
    peers whose layout was accepted, ``None`` otherwise and for every peer after a spool error
    (e.g. no room for the preallocation), which is returned. Sinks are added as they open, so
    a caller interrupted here can still abort them all."""
    failure: SpoolError | None = None
    for island in islands:
        if island not in accepted_layout or failure is not None:
            sinks[island] = None
        elif spool is None:
            sinks[island] = MemorySink(layout)
        else:
            try:
                sinks[island] = spool.writer(round_id, island, layout, remap_bytes=remap_bytes)
            except SpoolError as err:
                failure = err
                sinks[island] = None
    return failure


def finish_sinks(
    sinks: dict[int, Sink | None],
    contributions: dict[int, Contribution],
    failure: SpoolError | None,
) -> SpoolError | None:
    """Turn every sink into a contribution (added to ``contributions``); the first spool error
    wins, and after one the remaining sinks are aborted."""
    for island, sink in sinks.items():
        if sink is None:
            continue
        if failure is not None:
            sink.abort()
            continue
        try:
            finished = sink.finish()
        except SpoolError as err:
            failure = err
            continue
        contributions[island] = finished
    return failure


def all_finite(block: Tensor) -> bool:
    """Whether every value of the floating ``block`` is finite: a finite sum proves it (NaN and
    inf survive every addition); only a non-finite sum pays for the elementwise check."""
    if math.isfinite(float(block.sum())):
        return True
    return bool(torch.isfinite(block).all())


def blocks(spec: TensorSpec, block_numel: int) -> list[tuple[int, int]]:
    return [(s, min(block_numel, spec.numel - s)) for s in range(0, spec.numel, block_numel)]


def measure(
    contribution: Contribution, layout: PayloadLayout, *, block_numel: int, sum_sq: bool = True
) -> tuple[bool, float, str | None]:
    """The one validation pass over ``contribution``, block by block: whether every floating
    value is finite, the float64 sum of their squares (0.0 with ``sum_sq=False``, which saves
    half a pass without ``max_norm``, or once not finite) and the first non-finite tensor."""
    total = 0.0
    for spec in layout.specs:
        if not spec.dtype.is_floating_point:
            continue
        scratch = torch.empty(min(block_numel, spec.numel), dtype=spec.dtype)
        for start, n in blocks(spec, block_numel):
            block = scratch[:n]
            contribution.read_into(spec, start, block)
            if not all_finite(block):
                return False, 0.0, spec.name
            if sum_sq:
                total += float(block.double().square().sum())
    return True, total, None
