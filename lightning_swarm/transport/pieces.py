"""Where a quantized exchange cuts a bucket: owners' shares, and their encoded bytes.

Pure planning and codec arithmetic (no torch.distributed); the coded means (``coded_mean.py``)
call it with the caller's flat float32 tensors and move the bytes themselves. Invariants:
- Every ``Piece`` starts on a codec block of its tensor (``plan_buckets(..., block_size)``), and
  blocks start at element 0, so encoding piece by piece, and writing results back piece by
  piece, agrees bit for bit with ``codec.roundtrip`` of the whole tensor (as error feedback needs).
- ``plan_shares`` cuts a bucket into ``num_islands`` shares of whole blocks.
- A payload's size (``encoded_nbytes``) follows from piece lengths alone, so every island knows
  every share's size without a message and no header travels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.buckets import Piece, check_bucket


def check_coded_options(num_islands: int, codec: Codec, bucket_numel: int) -> None:
    """The options every coded transport needs: islands, and a bucket of whole codec blocks."""
    if num_islands < 1:
        raise ValueError(f"num_islands must be >= 1, got {num_islands}")
    check_bucket(bucket_numel, codec.block_size)


def plan_shares(bucket: Sequence[Piece], num_islands: int, block_size: int) -> list[list[Piece]]:
    """Cut ``bucket`` into ``num_islands`` shares of whole blocks, in bucket order.

    Every piece of ``bucket`` must start on a block boundary of its tensor (as
    ``plan_buckets`` makes them); so does every piece of every share. Concatenated in
    share order, the shares cover the bucket's elements exactly once, in the bucket's order.
    Share j holds blocks ``[j * U // n, (j + 1) * U // n)`` of the bucket's U blocks, so shares
    differ by at most one block (in elements too: only a tensor's last block can be partial)
    and may be empty.

    Raises:
        ValueError: ``num_islands < 1``.
    """
    if num_islands < 1:
        raise ValueError(f"num_islands must be >= 1, got {num_islands}")
    num_blocks = [-(-p.length // block_size) for p in bucket]
    total = sum(num_blocks)
    shares: list[list[Piece]] = []
    for island in range(num_islands):
        lo, hi = island * total // num_islands, (island + 1) * total // num_islands
        share: list[Piece] = []
        first = 0  # index of the current piece's first block among the bucket's blocks
        for piece, count in zip(bucket, num_blocks, strict=True):
            a, b = max(lo, first), min(hi, first + count)
            if a < b:
                start = (a - first) * block_size
                stop = min(piece.length, (b - first) * block_size)
                share.append(Piece(piece.tensor_index, piece.start + start, stop - start))
            first += count
        shares.append(share)
    return shares


def encoded_nbytes(codec: Codec, pieces: Sequence[Piece]) -> int:
    """Bytes of the payload of ``pieces`` (each piece encoded on its own)."""
    return sum(codec.encoded_nbytes(p.length) for p in pieces)


def piece_view(flats: Sequence[Tensor], piece: Piece) -> Tensor:
    """The elements of ``piece`` as a view of its flat tensor."""
    return flats[piece.tensor_index][piece.start : piece.stop]


def encode_flat(codec: Codec, values: Tensor, pieces: Sequence[Piece]) -> Tensor:
    """The payload (uint8) of ``pieces`` whose values lie back to back in the flat ``values``.

    Each piece is encoded on its own, so the bytes equal those of ``encode_pieces`` over tensors
    holding ``values`` at the pieces' places.
    """
    parts = []
    offset = 0
    for p in pieces:
        parts.append(codec.to_bytes(codec.encode(values[offset : offset + p.length])))
        offset += p.length
    return _joined(parts, torch.uint8, values.device)


def encode_pieces(
    codec: Codec, flats: Sequence[Tensor], pieces: Sequence[Piece], device: torch.device
) -> Tensor:
    """The payload (uint8, on ``device``) of ``pieces`` of the caller's flat tensors."""
    parts = [codec.to_bytes(codec.encode(piece_view(flats, p).to(device))) for p in pieces]
    return _joined(parts, torch.uint8, device)


def decode_flat(codec: Codec, payload: Tensor, pieces: Sequence[Piece]) -> Tensor:
    """Decode the payload of ``pieces`` into one new flat float32 tensor, pieces back to back."""
    parts = []
    offset = 0
    for p in pieces:
        size = codec.encoded_nbytes(p.length)
        parts.append(codec.decode(codec.from_bytes(payload[offset : offset + size], p.length)))
        offset += size
    if offset != payload.numel():
        raise ValueError(
            f"a payload of {payload.numel()} bytes does not hold pieces of {offset} bytes; "
            "islands disagree on the layout (same model, quantize and block_size everywhere?)."
        )
    return _joined(parts, torch.float32, payload.device)


def _joined(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``parts`` back to back (the one part itself, uncopied); empty of ``dtype`` if none."""
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def write_flat(flats: Sequence[Tensor], pieces: Sequence[Piece], values: Tensor) -> None:
    """Copy ``values`` (pieces back to back) into the pieces' places in ``flats``."""
    offset = 0
    for p in pieces:
        piece_view(flats, p).copy_(values[offset : offset + p.length])
        offset += p.length
