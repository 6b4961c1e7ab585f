"""The map of one round's payload: its tensors' names, shapes and dtypes, in order, and where
their bytes sit (a payload's byte format, like a safetensors header; which slice of the model a
rank holds is ``algorithm.model_layout``'s, not this).

A payload is its tensors' raw bytes in map order: the wire's chunks, and the data section of
a safetensors file whose header is known ahead (every tensor declared flat), so chunk ``k`` lands
at a fixed offset. Peer descriptions are untrusted: ``from_json`` raises ``ValueError``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_swarm.transport.buckets import placed, plan_buckets

# safetensors dtype codes for the dtypes a payload may carry.
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a payload: its place in the payload's bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # its first byte in the payload
    index: int  # position in the layout

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ChunkPiece:
    """Bytes ``[tensor_start, tensor_start + length)`` of tensor ``index`` sit at
    ``chunk_start`` in the chunk."""

    index: int
    tensor_start: int
    chunk_start: int
    length: int


class PayloadMap:
    """Ordered tensor specs; equal maps describe byte-compatible payloads."""

    def __init__(self, entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        specs: list[TensorSpec] = []
        offset = 0
        for index, (name, shape, dtype) in enumerate(entries):
            spec = TensorSpec(name, tuple(shape), dtype, offset, index)
            specs.append(spec)
            offset += spec.nbytes
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.data_bytes = offset
        self._chunks: dict[int, list[list[ChunkPiece]]] = {}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor]) -> PayloadMap:
        """The layout of ``tensors`` in mapping order; ``ValueError`` unless each is contiguous
        with a dtype that can travel."""
        entries = []
        for name, t in tensors.items():
            if t.dtype not in DTYPE_CODES:
                raise ValueError(
                    f"tensor {name!r} has dtype {t.dtype}, which the swarm transport cannot "
                    f"send; use one of {sorted(str(d) for d in DTYPE_CODES)}"
                )
            if not t.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous; pass .contiguous() tensors")
            entries.append((name, tuple(t.shape), t.dtype))
        return cls(entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PayloadMap) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        return tuple((s.name, s.shape, DTYPE_CODES[s.dtype]) for s in self.specs)

    def to_json(self) -> bytes:
        """Deterministic description (names, shapes, dtype codes) sent ahead of a payload."""
        return json.dumps(self.key(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, blob: bytes) -> PayloadMap:
        """Parse a peer's description; ``ValueError`` unless it is JSON of the expected form."""
        try:
            items = json.loads(blob.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"payload description is not valid JSON ({err})") from err
        if not isinstance(items, list):
            raise ValueError("payload description must be a JSON list of [name, shape, dtype]")
        entries = []
        for item in items:
            ok = (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[0], str)
                and isinstance(item[1], list)
                and all(isinstance(d, int) and d >= 0 for d in item[1])
                and item[2] in CODE_DTYPES
            )
            if not ok:
                raise ValueError(f"malformed payload description entry {str(item)[:200]}")
            entries.append((item[0], tuple(item[1]), CODE_DTYPES[item[2]]))
        return cls(entries)

    def difference(self, other: PayloadMap) -> str | None:
        """Human-readable first difference between ``other`` (a peer's) and this layout."""
        if self == other:
            return None
        mine = {s.name: s for s in self.specs}
        theirs = {s.name: s for s in other.specs}
        missing = [n for n in mine if n not in theirs]
        extra = [n for n in theirs if n not in mine]
        if missing or extra:
            return f"names differ (missing {missing[:3]}, unexpected {extra[:3]})"
        for s in self.specs:
            o = theirs[s.name]
            if (o.shape, o.dtype) != (s.shape, s.dtype):
                return (
                    f"tensor {s.name!r} is {list(o.shape)} {o.dtype}, expected "
                    f"{list(s.shape)} {s.dtype}"
                )
        return "tensor order differs"

    def safetensors_header(
        self, metadata: Mapping[str, str] | None = None, *, flat: bool = True
    ) -> bytes:
        """The first bytes of a safetensors file of this payload: 8-byte little-endian length
        + padded JSON, every tensor at its payload offset, declared flat (a spool file) or in
        its own shape (``flat=False``: an exported model)."""
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        for s in self.specs:
            header[s.name] = {
                "dtype": DTYPE_CODES[s.dtype],
                "shape": [s.numel] if flat else list(s.shape),
                "data_offsets": [s.offset, s.offset + s.nbytes],
            }
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        return struct.pack("<Q", len(blob)) + blob

    def num_chunks(self, chunk_bytes: int) -> int:
        return -(-self.data_bytes // chunk_bytes)

    def chunk_pieces(self, k: int, chunk_bytes: int) -> list[ChunkPiece]:
        """Which tensor bytes make up chunk ``k`` of the payload (the one packer's plan of the
        tensors' bytes, kept per ``chunk_bytes``)."""
        if chunk_bytes not in self._chunks:
            plan = plan_buckets([s.nbytes for s in self.specs], chunk_bytes)
            self._chunks[chunk_bytes] = [
                [ChunkPiece(p.tensor_index, p.start, at, p.length) for at, p in placed(chunk)]
                for chunk in plan
            ]
        chunks = self._chunks[chunk_bytes]
        return chunks[k] if k < len(chunks) else []


def byte_view(t: Tensor) -> Tensor:
    """A flat uint8 view of a contiguous tensor's storage (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def pack_chunk(
    sources: Sequence[Tensor], layout: PayloadMap, k: int, chunk_bytes: int, out: Tensor
) -> int:
    """Copy chunk ``k`` of the payload ``sources`` (uint8 views) into ``out``; return its size."""
    size = 0
    for p in layout.chunk_pieces(k, chunk_bytes):
        out[p.chunk_start : p.chunk_start + p.length].copy_(
            sources[p.index][p.tensor_start : p.tensor_start + p.length]
        )
        size = p.chunk_start + p.length
    return size


def unpack_chunk(
    chunk: Tensor, layout: PayloadMap, k: int, chunk_bytes: int, targets: Sequence[Tensor]
) -> None:
    """Copy chunk ``k`` (uint8) back into ``targets`` (uint8 views), the inverse of pack."""
    for p in layout.chunk_pieces(k, chunk_bytes):
        targets[p.index][p.tensor_start : p.tensor_start + p.length].copy_(
            chunk[p.chunk_start : p.chunk_start + p.length]
        )
