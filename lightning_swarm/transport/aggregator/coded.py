"""Quantized swarm payloads: encodings travel and are spooled; owners aggregate their decoding.
The *wire layout* follows from the float layout and the codec alone."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec, Encoded
from lightning_swarm.transport.aggregator.contributions import Contribution
from lightning_swarm.transport.payload import PayloadLayout, TensorSpec

DATA_SUFFIX, SCALES_SUFFIX = "#data", "#scales"
_BLOCK_CODECS = ("int8", "int4")


class CodedPayload:
    """The wire layout of one float layout under one codec, and the verbs between the two:
    ``<name>#scales`` for every tensor (int8 / int4; first, which keeps every tensor aligned to
    its element size), then ``<name>#data`` for every tensor, flat in the codec's dtype. Blocks
    start on ``align`` (the codec block, made even for int4), so a block decodes bit for bit as
    in a whole-tensor decode.

    Raises:
        ValueError: a tensor of ``layout`` is not float32 (codecs encode float32).
    """

    def __init__(self, layout: PayloadLayout, codec: Codec) -> None:
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
        self.wire = PayloadLayout(entries)
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
