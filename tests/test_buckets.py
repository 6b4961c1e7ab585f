"""The one bucket packer: exact plans by hand, and the in-place bucketed mean around it."""

from __future__ import annotations

import pytest
import torch

from lightning_swarm.transport.buckets import (
    Piece,
    numel_of,
    placed,
    plan_buckets,
)


def test_under_filled_last_bucket() -> None:
    # 3 + 12 + 1 = 16 elements in buckets of 5: three full buckets, then one of a single element.
    assert plan_buckets([3, 12, 1], 5) == [
        [Piece(0, 0, 3), Piece(1, 0, 2)],
        [Piece(1, 2, 5)],
        [Piece(1, 7, 5)],
        [Piece(2, 0, 1)],
    ]


def test_a_tensor_larger_than_a_bucket_spans_several_and_its_tail_shares_one() -> None:
    plan = plan_buckets([11, 2], 4)
    assert plan == [
        [Piece(0, 0, 4)],
        [Piece(0, 4, 4)],
        [Piece(0, 8, 3), Piece(1, 0, 1)],  # the tail of tensor 0, then tensor 1 is split
        [Piece(1, 1, 1)],
    ]
    # the offsets advance by what was packed, not by a full bucket
    assert [list(placed(b)) for b in plan][2] == [(0, Piece(0, 8, 3)), (3, Piece(1, 0, 1))]
    assert [numel_of(b) for b in plan] == [4, 4, 4, 1]


def test_many_small_tensors_share_one_bucket_and_empty_ones_vanish() -> None:
    plan = plan_buckets([1, 0, 2, 3, 0, 1], 100)
    assert plan == [[Piece(0, 0, 1), Piece(2, 0, 2), Piece(3, 0, 3), Piece(5, 0, 1)]]
    assert [at for at, _ in placed(plan[0])] == [0, 1, 3, 6]


def test_block_alignment_closes_a_bucket_that_cannot_take_a_whole_block() -> None:
    # Buckets of 8, blocks of 4: tensor 0 (6) leaves 2 free, less than a block of tensor 1,
    # so the bucket closes under-filled; tensor 1's tail (1 element) then needs no whole block.
    assert plan_buckets([6, 9], 8, block_size=4) == [
        [Piece(0, 0, 6)],
        [Piece(1, 0, 8)],
        [Piece(1, 8, 1)],
    ]
    # Buckets of 10: the 4 free elements beside tensor 0 take exactly one block of tensor 1.
    assert plan_buckets([6, 9, 3], 10, block_size=4) == [
        [Piece(0, 0, 6), Piece(1, 0, 4)],
        [Piece(1, 4, 5), Piece(2, 0, 3)],
    ]
    # 407 elements in buckets of 256 with blocks of 32: one full bucket, then 151 left; the next
    # tensor starts beside it and takes whole blocks only (96 of the 105 free), leaving 9 empty.
    plan = plan_buckets([407, 300], 256, block_size=32)
    assert plan[0] == [Piece(0, 0, 256)]
    assert plan[1] == [Piece(0, 256, 151), Piece(1, 0, 96)]
    assert plan[2] == [Piece(1, 96, 204)]
    assert all(p.start % 32 == 0 for b in plan for p in b)


def test_every_element_once_on_block_boundaries() -> None:
    numels = [407, 300, 5, 0, 1000]
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for bucket in plan_buckets(numels, 256, 32):
        assert 0 < numel_of(bucket) <= 256
        for p in bucket:
            assert p.start % 32 == 0
            seen[p.tensor_index][p.start : p.stop] += 1
    assert all(bool((s == 1).all()) for s in seen)


def test_empty_input_has_no_bucket() -> None:
    assert plan_buckets([], 8) == []
    assert plan_buckets([0, 0], 8, block_size=4) == []


@pytest.mark.parametrize(
    ("bucket_numel", "block_size", "message"),
    [
        (0, 1, "bucket_numel must be >= 1, got 0"),
        (
            16,
            32,
            r"bucket_numel=16 is smaller than one codec block \(32 elements\); raise bucket_mb",
        ),
        (8, 0, "block_size must be >= 1, got 0"),
    ],
)
def test_bad_buckets_are_refused(bucket_numel: int, block_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_buckets([10], bucket_numel, block_size)
