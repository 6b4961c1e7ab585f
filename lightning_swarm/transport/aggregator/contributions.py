"""A peer's contribution: where its payload lands (a *sink*: a ``spool.SpoolWriter``, a
``MemorySink`` with offload off, ``None`` to drop a refused peer's chunks), its encoding under a
codec (``CodedPayload``), and how it is read back, one block at a time: memory is contributions
x one block, never x model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec, Encoded
from lightning_swarm.transport.payload import PayloadMap, TensorSpec


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
    def __init__(self, layout: PayloadMap) -> None:
        self.layout = layout
        self.buffer = torch.empty(layout.data_bytes, dtype=torch.uint8)

    def write(self, data_offset: int, chunk: Tensor) -> None:
        self.buffer[data_offset : data_offset + chunk.numel()].copy_(chunk)

    def finish(self) -> Contribution:
        b, specs = self.buffer, self.layout.specs
        return MemoryContribution([b[s.offset : s.offset + s.nbytes].view(s.dtype) for s in specs])

    def abort(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


def all_finite(block: Tensor) -> bool:
    """Whether every value of the floating ``block`` is finite: a finite sum proves it (NaN and
    inf survive every addition); only a non-finite sum pays for the elementwise check."""
    if math.isfinite(float(block.sum())):
        return True
    return bool(torch.isfinite(block).all())


def blocks(spec: TensorSpec, block_numel: int) -> list[tuple[int, int]]:
    return [(s, min(block_numel, spec.numel - s)) for s in range(0, spec.numel, block_numel)]


def measure(
    contribution: Contribution, layout: PayloadMap, block_numel: int, sum_sq: bool
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


DATA_SUFFIX, SCALES_SUFFIX = "#data", "#scales"
_BLOCK_CODECS = ("int8", "int4")


class CodedPayload:
    """The wire layout of one float layout under one codec, and the verbs between the two:
    ``<name>#scales`` for every tensor (int8 / int4; first, which keeps every tensor aligned to
    its element size), then ``<name>#data`` for every tensor, flat in the codec's dtype. Blocks
    start on ``align`` (the codec block, made even for int4), so a block decodes bit for bit as
    in a whole-tensor decode. Raises ``ValueError`` unless ``layout`` is float32 only."""

    def __init__(self, layout: PayloadMap, codec: Codec) -> None:
        for spec in layout.specs:
            if spec.dtype != torch.float32:
                raise ValueError(
                    f"quantize={codec.name!r} encodes float32 pseudo-gradients; tensor "
                    f"{spec.name!r} is {spec.dtype}. Keep pseudo-gradients in float32 or set "
                    "quantize='none'."
                )
        self.layout, self.codec = layout, codec
        self.blocked = codec.name in _BLOCK_CODECS
        data_dtype = codec.encode(torch.zeros(1)).data.dtype
        entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        if self.blocked:
            for spec in layout.specs:
                num_blocks = -(-spec.numel // codec.block_size)
                entries.append((spec.name + SCALES_SUFFIX, (num_blocks,), torch.float32))
        for spec in layout.specs:
            entries.append((spec.name + DATA_SUFFIX, (self._data_numel(spec.numel),), data_dtype))
        self.wire = PayloadMap(entries)
        assert self.wire.data_bytes == sum(codec.encoded_nbytes(s.numel) for s in layout.specs)
        pair = 2 if codec.name == "int4" else 1
        self.align = codec.block_size * pair // math.gcd(codec.block_size, pair)

    def _data_numel(self, numel: int) -> int:
        return (numel + 1) // 2 if self.codec.name == "int4" else numel

    def block_numel(self, block_bytes: int) -> int:
        """Elements per validation / aggregation block: about ``block_bytes`` of float32,
        a multiple of ``align`` (at least one ``align``)."""
        return max(1, block_bytes // 4 // self.align) * self.align

    def encode(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The wire tensors of ``tensors`` (float layout order), in wire layout order."""
        data: list[Tensor] = []
        scales: list[Tensor] = []
        for t in tensors:
            encoded = encode_marked(self.codec, t.detach().reshape(-1))
            data.append(encoded.data)
            scales.append(encoded.scales)
        return scales + data if self.blocked else data

    @torch.no_grad()
    def roundtrip_into(self, tensors: Sequence[Tensor]) -> None:
        """Overwrite each tensor with ``decode(encode(tensor))`` (what the others would see)."""
        for t in tensors:
            flat = t.detach().reshape(-1)
            flat.copy_(self.codec.decode(encode_marked(self.codec, flat)))


class DecodedContribution:
    """``inner`` (holding ``payload``'s wire layout) read back as decoded float32 blocks, one
    block at a time: memory stays contributions x one block."""

    def __init__(self, payload: CodedPayload, inner: Contribution) -> None:
        self.payload, self.inner = payload, inner

    def read_into(self, spec: TensorSpec, start: int, out: Tensor) -> None:
        """Decode float elements ``[start, start + out.numel())`` of ``spec`` into ``out``."""
        payload, codec = self.payload, self.payload.codec
        assert start % payload.align == 0, "decoded blocks must start on a codec block"
        n, wire = out.numel(), payload.wire.specs
        # The wire holds every tensor's scales (block codecs) and then every tensor's data.
        data_spec = wire[spec.index + (len(payload.layout.specs) if payload.blocked else 0)]
        lo = start // 2 if codec.name == "int4" else start
        data = torch.empty(payload._data_numel(n), dtype=data_spec.dtype)
        self.inner.read_into(data_spec, lo, data)
        scales = torch.empty(0, dtype=torch.float32)
        if payload.blocked:
            scales = torch.empty(-(-n // codec.block_size), dtype=torch.float32)
            self.inner.read_into(wire[spec.index], start // codec.block_size, scales)
        decoded = codec.decode(Encoded(codec.name, n, codec.block_size, data, scales))
        out.copy_(decoded.view_as(out))

    def close(self) -> None:
        self.inner.close()


def encode_marked(codec: Codec, flat: Tensor) -> Encoded:
    """``codec.encode(flat)``, except that non-finite values (and, for bf16, values beyond its
    range) decode non-finite instead of raising: validation rejects them like uncoded ones
    instead of one island raising alone."""
    if codec.name == "bf16":
        bad = ~torch.isfinite(flat.to(torch.bfloat16))
    else:
        bad = ~torch.isfinite(flat)
    if not bool(bad.any()):
        return codec.encode(flat)
    encoded = codec.encode(torch.where(bad, torch.zeros_like(flat), flat))
    if codec.name in _BLOCK_CODECS:
        blocks = bad.nonzero().reshape(-1) // codec.block_size
        encoded.scales[blocks] = float("nan")
    else:
        encoded.data[bad] = float("nan")
    return encoded
