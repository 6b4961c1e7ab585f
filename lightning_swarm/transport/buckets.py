"""The one packer: how every exchange cuts flat tensors into buckets, and buckets into shares.

A bucket is a list of ``Piece``s back to back in its flat buffer. Plans depend on sizes only, so
every island computes the same plan without a message; every piece starts on a ``block_size``
boundary of its tensor (so it encodes as the whole tensor would); every element lies in exactly
one piece, in order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + length)`` of flat tensor ``tensor_index``."""

    tensor_index: int
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def check_bucket(bucket_numel: int, block_size: int = 1) -> None:
    """Raise ``ValueError`` unless a bucket of ``bucket_numel`` holds at least one block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if bucket_numel < block_size:
        raise ValueError(
            f"bucket_numel={bucket_numel} is smaller than one codec block ({block_size} "
            "elements); raise bucket_mb or lower block_size."
        )


def plan_buckets(
    numels: Sequence[int], bucket_numel: int, block_size: int = 1
) -> list[list[Piece]]:
    """Pack tensors of ``numels`` elements, in order, into non-empty buckets of at most
    ``bucket_numel`` (``[]`` without elements); ``ValueError`` where ``check_bucket`` refuses.
    A bucket that cannot take another whole block is closed under-filled (with ``block_size``
    1, every bucket but the last is full)."""
    check_bucket(bucket_numel, block_size)
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    fill = 0
    for index, numel in enumerate(numels):
        pos = 0
        while pos < numel:
            space = bucket_numel - fill
            remaining = numel - pos
            # A tensor's tail fits whole; otherwise take only whole blocks, so that the next
            # piece of this tensor starts on a block boundary too.
            take = remaining if remaining <= space else (space // block_size) * block_size
            if take == 0:  # not even one block fits: close the bucket under-filled
                buckets.append(current)
                current, fill = [], 0
                continue
            current.append(Piece(index, pos, take))
            fill += take
            pos += take
            if fill == bucket_numel:
                buckets.append(current)
                current, fill = [], 0
    if current:
        buckets.append(current)
    return buckets


def plan_shares(bucket: Sequence[Piece], num_islands: int, block_size: int) -> list[list[Piece]]:
    """Cut ``bucket`` into ``num_islands`` shares of whole blocks, in bucket order: share j
    holds blocks ``[j * U // n, (j + 1) * U // n)`` of the bucket's U blocks (so shares differ
    by at most one block and may be empty). ``ValueError`` if ``num_islands < 1``."""
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


def numel_of(pieces: Sequence[Piece]) -> int:
    return sum(p.length for p in pieces)


def placed(pieces: Sequence[Piece]) -> Iterator[tuple[int, Piece]]:
    """Each piece with its offset in the flat buffer that holds ``pieces`` back to back."""
    offset = 0
    for piece in pieces:
        yield offset, piece
        offset += piece.length
