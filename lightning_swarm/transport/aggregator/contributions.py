"""Where a peer's payload lands (a *sink*: a ``spool.SpoolWriter``, ``MemorySink`` with offload
off, ``DiscardSink`` for a refused peer) and how it is read back (a *contribution*). ``measure``
and ``aggregate_into`` read one block at a time: memory is contributions x one block, never
contributions x model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lightning_swarm.algorithm.robust import aggregate
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadLayout, TensorSpec


class Contribution(Protocol):
    def read_into(self, spec: TensorSpec, start: int, out: Tensor) -> None: ...

    def close(self) -> None: ...


class Sink(Protocol):
    def write(self, data_offset: int, chunk: Tensor) -> None: ...

    def finish(self) -> Contribution | None: ...

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


class DiscardSink:
    def write(self, data_offset: int, chunk: Tensor) -> None:
        pass

    def finish(self) -> None:
        return None

    def abort(self) -> None:
        pass


def open_sinks(
    sinks: dict[int, Sink],
    islands: list[int],
    accepted_layout: list[int],
    layout: PayloadLayout,
    spool: Spool | None,
    round_id: int,
    *,
    remap_bytes: int,
) -> SpoolError | None:
    """Add one sink per peer island to ``sinks``: a spool file (``spool`` given) or memory for
    peers whose layout was accepted, a discard sink otherwise. After a spool error (e.g. no room
    for the preallocation) every later peer gets a discard sink and the error is returned.
    Sinks are added as they open, so a caller interrupted here can still abort them all."""
    failure: SpoolError | None = None
    for island in islands:
        if island not in accepted_layout or failure is not None:
            sinks[island] = DiscardSink()
        elif spool is None:
            sinks[island] = MemorySink(layout)
        else:
            try:
                sinks[island] = spool.writer(round_id, island, layout, remap_bytes=remap_bytes)
            except SpoolError as err:
                failure = err
                sinks[island] = DiscardSink()
    return failure


def finish_sinks(
    sinks: dict[int, Sink], contributions: dict[int, Contribution], failure: SpoolError | None
) -> SpoolError | None:
    """Turn every sink into a contribution (added to ``contributions``); the first spool error
    wins, and after one the remaining sinks are aborted."""
    for island, sink in sinks.items():
        if failure is not None:
            sink.abort()
            continue
        try:
            finished = sink.finish()
        except SpoolError as err:
            failure = err
            continue
        if finished is not None:
            contributions[island] = finished
    return failure


def all_finite(block: Tensor) -> bool:
    """Whether every value of the floating ``block`` is finite: a finite sum proves it (NaN and
    inf survive every addition); only a non-finite sum pays for the elementwise check."""
    if math.isfinite(float(block.sum())):
        return True
    return bool(torch.isfinite(block).all())


def _blocks(spec: TensorSpec, block_numel: int) -> list[tuple[int, int]]:
    return [(s, min(block_numel, spec.numel - s)) for s in range(0, spec.numel, block_numel)]


@dataclass(frozen=True)
class Measure:
    """One pass over a contribution: every floating value finite, the float64 sum of their
    squares (0.0 when not asked for or not finite), the first tensor holding a non-finite."""

    finite: bool
    sum_sq: float
    bad_tensor: str | None = None


def measure(
    contribution: Contribution, layout: PayloadLayout, *, block_numel: int, sum_sq: bool = True
) -> Measure:
    """The one validation pass over ``contribution``, block by block (``sum_sq=False`` without
    ``max_norm``: the float64 squares cost half a pass)."""
    total = 0.0
    for spec in layout.specs:
        if not spec.dtype.is_floating_point:
            continue
        scratch = torch.empty(min(block_numel, spec.numel), dtype=spec.dtype)
        for start, n in _blocks(spec, block_numel):
            block = scratch[:n]
            contribution.read_into(spec, start, block)
            if not all_finite(block):
                return Measure(False, 0.0, spec.name)
            if sum_sq:
                total += float(block.double().square().sum())
    return Measure(True, total)


def aggregate_into(
    targets: Sequence[Tensor],
    contributions: Sequence[Contribution],
    layout: PayloadLayout,
    *,
    rule: str,
    weights: Sequence[float] | None,
    trim_ratio: float,
    block_numel: int,
) -> None:
    """Overwrite ``targets`` (in layout order) with the aggregate of ``contributions`` (in
    island order). A target may itself be a contribution (the owner's own tensors): each block
    is read from every contribution before it is overwritten."""
    for spec, target in zip(layout.specs, targets, strict=True):
        flat = target.view(-1)
        scratch = torch.empty((len(contributions), min(block_numel, spec.numel)), dtype=spec.dtype)
        for start, n in _blocks(spec, block_numel):
            blocks = [scratch[i, :n] for i in range(len(contributions))]
            for contribution, block in zip(contributions, blocks, strict=True):
                contribution.read_into(spec, start, block)
            result = aggregate(rule, blocks, weights=weights, trim_ratio=trim_ratio)
            flat[start : start + n].copy_(result)
