"""Aggregation rules over islands' contributions to ONE parameter (or one block of it).

Element-wise in a fixed order, so a rule on consecutive slices gives the bits of the whole tensor;
inputs are never modified. Even-count median and trimmed mean follow numpy and scipy."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_swarm.errors import SwarmConfigError

AGGREGATIONS = ("mean", "weighted_mean", "median", "trimmed_mean")


def check_aggregation(rule: object, *, option: str = "aggregation") -> None:
    """The one check of an aggregation name; ``option`` is how the caller's user spells it."""
    if rule not in AGGREGATIONS:
        raise SwarmConfigError(
            f"{option}={rule!r} is not known; choose one of {list(AGGREGATIONS)}."
        )


def check_weights(weights: object, *, option: str = "weights") -> list[float]:
    """The one check of ``weighted_mean`` weights (finite, >= 0, positive sum), as floats."""
    try:
        values = list(weights)  # type: ignore[call-overload]
    except TypeError:
        values = None
    if (
        not values
        or isinstance(weights, (str, bytes))
        or not all(is_number(w) and w >= 0 for w in values)
        or sum(values) <= 0
    ):
        raise SwarmConfigError(
            f"{option} must be a list of finite non-negative numbers that do not all equal 0, "
            f"got {weights!r}; e.g. [2, 1] when island 0 sees twice the samples of island 1."
        )
    return [float(w) for w in values]


def is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(tensors: Sequence[Tensor]) -> torch.dtype:
    """Refuse empty or mixed contributions; return the dtype to accumulate in."""
    if len(tensors) == 0:
        raise ValueError("cannot aggregate zero contributions; at least one island must count")
    first = tensors[0]
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"contributions differ in shape or dtype ({tuple(first.shape)} {first.dtype} vs "
                f"{tuple(t.shape)} {t.dtype}); every island must send the same layout"
            )
    return torch.float64 if first.dtype == torch.float64 else torch.float32


def mean(tensors: Sequence[Tensor]) -> Tensor:
    """Elementwise mean: ``((x_0 + x_1) + ...) / n``, summed in island order."""
    acc_dtype = _check(tensors)
    acc = tensors[0].to(acc_dtype, copy=True)
    for t in tensors[1:]:
        acc.add_(t.to(acc_dtype))
    acc.div_(len(tensors))
    return acc.to(tensors[0].dtype)


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``sum(w_i * x_i) / sum(w_i)``, summed in island order."""
    acc_dtype = _check(tensors)
    if len(weights) != len(tensors):
        raise ValueError(f"{len(weights)} weights for {len(tensors)} contributions")
    check_weights(weights)
    acc = tensors[0].to(acc_dtype).mul(weights[0])
    for t, w in zip(tensors[1:], weights[1:], strict=True):
        # A separate multiply and add, not add_(alpha=w): a fused multiply-add in the vectorised
        # body but not in the tail would make results depend on where a block starts.
        acc.add_(t.to(acc_dtype).mul(w))
    acc.div_(sum(weights))
    return acc.to(tensors[0].dtype)


# Up to this many contributions a sorting network of elementwise min / max beats torch.sort.
_NETWORK_MAX = 32


def _sorted_rows(tensors: Sequence[Tensor], acc_dtype: torch.dtype) -> list[Tensor]:
    """Row i holds every coordinate's i-th smallest value (an odd-even transposition sort: the
    values of ``torch.sort``)."""
    rows = [t.to(acc_dtype) for t in tensors]
    n = len(rows)
    if n > _NETWORK_MAX:
        return list(torch.sort(torch.stack(rows), dim=0).values)
    for round_index in range(n):
        for j in range(round_index % 2, n - 1, 2):
            low = torch.minimum(rows[j], rows[j + 1])
            rows[j + 1] = torch.maximum(rows[j], rows[j + 1])
            rows[j] = low
    return rows


def median(tensors: Sequence[Tensor]) -> Tensor:
    """Coordinate-wise median; the mean of the two middle values for an even count."""
    n = len(tensors)
    ordered = _sorted_rows(tensors, _check(tensors))
    middle = ordered[n // 2].clone() if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return middle.to(tensors[0].dtype)


def trimmed_count(n: int, trim_ratio: float) -> int:
    """How many values ``trimmed_mean`` drops at EACH end for ``n`` contributions."""
    return math.floor(trim_ratio * n)


def trimmed_mean(tensors: Sequence[Tensor], trim_ratio: float) -> Tensor:
    """Per coordinate: drop ``floor(trim_ratio * n)`` values at each end, average the rest."""
    acc_dtype = _check(tensors)
    if not 0.0 <= trim_ratio < 0.5:
        raise ValueError(f"trim_ratio must lie in [0, 0.5), got {trim_ratio}")
    n = len(tensors)
    k = trimmed_count(n, trim_ratio)
    ordered = _sorted_rows(tensors, acc_dtype)
    return mean(ordered[k : n - k]).to(tensors[0].dtype)  # the rows are in acc_dtype


def aggregate(
    rule: str,
    tensors: Sequence[Tensor],
    *,
    weights: Sequence[float] | None = None,
    trim_ratio: float = 0.0,
) -> Tensor:
    """Dispatch to one of ``AGGREGATIONS`` by name."""
    check_aggregation(rule)
    if rule == "mean":
        return mean(tensors)
    if rule == "weighted_mean":
        if weights is None:
            raise ValueError("aggregation 'weighted_mean' needs one weight per contribution")
        return weighted_mean(tensors, weights)
    if rule == "median":
        return median(tensors)
    return trimmed_mean(tensors, trim_ratio)
