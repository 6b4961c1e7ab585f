"""Aggregation rules over one parameter's per-island tensors (pure torch, no communication)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_swarm.algorithm.robust import (
    aggregate,
    check_weights,
    mean,
    median,
    trimmed_count,
    trimmed_mean,
    weighted_mean,
)


def _islands(n: int, shape: tuple[int, ...] = (5, 7), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def test_mean_and_weighted_mean_by_hand() -> None:
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([5.0, 1.0])]
    assert torch.equal(mean(xs), torch.tensor([3.0, 3.0]))
    # (2*1 + 1*3 + 1*5) / 4 = 2.5 ; (2*2 + 6 + 1) / 4 = 2.75
    assert torch.equal(weighted_mean(xs, [2.0, 1.0, 1.0]), torch.tensor([2.5, 2.75]))
    # a zero weight drops an island entirely
    assert torch.equal(weighted_mean(xs, [0.0, 1.0, 1.0]), mean(xs[1:]))


def test_median_odd_and_even_match_numpy() -> None:
    for n in (3, 4, 5, 8):
        xs = _islands(n, seed=n)
        expected = np.median(np.stack([x.numpy() for x in xs]), axis=0)
        got = median(xs)
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)
    # the even case averages the two middle values (torch.median would take the lower one)
    pair = [torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([2.0]), torch.tensor([9.0])]
    assert torch.equal(median(pair), torch.tensor([3.0]))


def _reference_trimmed(xs: list[torch.Tensor], ratio: float) -> np.ndarray:
    a = np.sort(np.stack([x.numpy().astype(np.float64) for x in xs]), axis=0)
    k = int(np.floor(ratio * len(xs)))
    return a[k : len(xs) - k].mean(axis=0)


@pytest.mark.parametrize(("n", "ratio"), [(4, 0.25), (5, 0.2), (8, 0.3), (3, 0.1)])
def test_trimmed_mean_matches_reference(n: int, ratio: float) -> None:
    xs = _islands(n, seed=10 + n)
    got = trimmed_mean(xs, ratio).double().numpy()
    np.testing.assert_allclose(got, _reference_trimmed(xs, ratio), rtol=1e-6, atol=1e-6)
    assert trimmed_count(n, ratio) == int(np.floor(ratio * n))


def test_trimmed_mean_drops_an_outlier() -> None:
    xs = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0]), torch.tensor([1e9])]
    assert torch.equal(trimmed_mean(xs, 0.25), torch.tensor([2.5]))
    assert trimmed_mean(xs, 0.0).item() > 1e8  # no trimming: the outlier dominates


@pytest.mark.parametrize("rule", ["mean", "weighted_mean", "median", "trimmed_mean"])
def test_blocks_give_bitwise_the_whole_tensor_result(rule: str) -> None:
    xs = [x.reshape(-1) for x in _islands(5, shape=(1031,), seed=3)]
    kw = {"weights": [1.0, 2.0, 0.5, 3.0, 1.5], "trim_ratio": 0.2}
    whole = aggregate(rule, xs, **kw)  # type: ignore[arg-type]
    for block in (1, 7, 64, 1000):
        parts = [
            aggregate(rule, [x[s : s + block] for x in xs], **kw)  # type: ignore[arg-type]
            for s in range(0, 1031, block)
        ]
        assert torch.equal(torch.cat(parts), whole), f"{rule} differs with block {block}"


def _sorted_reference(xs: list[torch.Tensor], rule: str) -> torch.Tensor:
    """The order statistics through torch.sort, as the rules computed them before the network."""
    ordered = torch.sort(torch.stack([x.float() for x in xs]), dim=0).values
    n = len(xs)
    if rule == "median":
        middle = ordered[n // 2].clone() if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        return middle.to(xs[0].dtype)
    k = trimmed_count(n, 0.2)
    acc = ordered[k].clone()
    for row in ordered[k + 1 : n - k]:
        acc.add_(row)
    return acc.div_(n - 2 * k).to(xs[0].dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 11, 16, 33])  # 33: past the network
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_order_statistics_equal_a_full_sort_bitwise(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    # few distinct values, so ties are common; and wide ones, so sums round
    xs = [
        (
            torch.randint(-3, 4, (257,), generator=g)
            * 10.0 ** torch.randint(-3, 4, (257,), generator=g)
        ).to(dtype)
        for _ in range(n)
    ]
    for rule in ("median", "trimmed_mean"):
        got = aggregate(rule, xs, trim_ratio=0.2)
        assert torch.equal(got, _sorted_reference(xs, rule)), (rule, n, dtype)


def test_low_precision_is_accumulated_in_float32() -> None:
    xs = [torch.full((4,), 256.0, dtype=torch.bfloat16)] + [
        torch.full((4,), 1.0, dtype=torch.bfloat16) for _ in range(3)
    ]
    got = mean(xs)
    assert got.dtype == torch.bfloat16
    # float32 accumulation: (256 + 3) / 4 = 64.75 -> bf16 64.5 or 65; bf16 accumulation would
    # lose every +1 (256 + 1 == 256 in bf16) and give exactly 64.
    assert got[0].item() != 64.0
    assert got[0].item() == torch.tensor(64.75).to(torch.bfloat16).item()


def test_bad_inputs_name_the_problem() -> None:
    xs = _islands(3)
    with pytest.raises(ValueError, match="zero contributions"):
        mean([])
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        mean([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"trim_ratio must lie in \[0, 0.5\)"):
        trimmed_mean(xs, 0.5)
    with pytest.raises(ValueError, match="3 contributions"):
        weighted_mean(xs, [1.0, 1.0])
    with pytest.raises(ValueError, match="non-negative"):
        weighted_mean(xs, [1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="do not all equal 0"):
        weighted_mean(xs, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="non-negative"):
        weighted_mean(xs, [1.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="needs one weight per contribution"):
        aggregate("weighted_mean", xs)
    with pytest.raises(ValueError, match=r"aggregation='mode' is not known; choose one of"):
        aggregate("mode", xs)
    with pytest.raises(ValueError, match=r"swarm.island_weights must be a list .* got 5"):
        check_weights(5, option="swarm.island_weights")


def test_inputs_are_not_modified() -> None:
    xs = _islands(4)
    before = [x.clone() for x in xs]
    for rule in ("mean", "median", "trimmed_mean"):
        aggregate(rule, xs, trim_ratio=0.25)
    weighted_mean(xs, [1.0, 2.0, 3.0, 4.0])
    assert all(torch.equal(a, b) for a, b in zip(xs, before, strict=True))
