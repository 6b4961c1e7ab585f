"""The bucket packer: how every exchange cuts a sequence of flat tensors into buckets.

A bucket is a list of ``Piece``s (runs of consecutive elements of one tensor) back to back in
its flat buffer; a tensor larger than a bucket is split, small tensors share one. Invariants
every caller relies on for bitwise reproducibility:
- The plan depends on element counts, ``bucket_numel`` and ``block_size`` only, so every island
  computes the same plan without a message.
- Every piece starts at a multiple of ``block_size`` inside its tensor, so it encodes exactly as
  the whole tensor would; a bucket that cannot take another whole block is closed under-filled.
- Every element appears in exactly one piece, in tensor order; no bucket is empty; empty tensors
  contribute no piece.
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
    """Pack tensors of ``numels`` elements, in order, into buckets of at most ``bucket_numel``.

    Args:
        numels: element count of each flat tensor (zero allowed).
        bucket_numel: most elements one bucket holds.
        block_size: pieces start at multiples of it inside their tensor (a codec's block size;
            1 for raw float32, which packs every bucket but the last full).

    Returns:
        The buckets, each a non-empty list of pieces lying back to back; ``[]`` when there is
        no element.

    Raises:
        ValueError: ``block_size < 1``, ``bucket_numel < 1``, or ``bucket_numel`` smaller than
            one block.
    """
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


def numel_of(pieces: Sequence[Piece]) -> int:
    """Elements in ``pieces`` (a bucket's fill)."""
    return sum(p.length for p in pieces)


def placed(pieces: Sequence[Piece]) -> Iterator[tuple[int, Piece]]:
    """Each piece with its offset in the flat buffer that holds ``pieces`` back to back."""
    offset = 0
    for piece in pieces:
        yield offset, piece
        offset += piece.length
