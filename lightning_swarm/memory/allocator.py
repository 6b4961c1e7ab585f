"""Allocator byte counters, told apart as gauges or running totals.

A gauge's ``freed`` moves; a running total's never does while ``current`` climbs (read as a gauge
it shows a leak that is not there). Works on flat snapshot dicts, so recorded snapshots test it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

_PARTS = ("current", "freed", "peak", "allocated")
_SPLIT_POOLS = (".small_pool", ".large_pool")


class CounterKind(Enum):
    GAUGE = "gauge"
    RUNNING_TOTAL = "running_total"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Counter:
    """One allocator statistic at one moment (bytes)."""

    current: int
    freed: int
    peak: int
    allocated: int | None = None


def byte_counters(snapshot: Mapping[str, Any]) -> dict[str, Counter]:
    """The byte statistics (``current``, ``freed``, ``peak``) of a flat allocator snapshot, by
    stem; ``.all`` is dropped from the stem, the split pools are skipped."""
    stems: dict[str, dict[str, int]] = {}
    for key, value in snapshot.items():
        stem, _, part = key.rpartition(".")
        if part not in _PARTS or "bytes" not in stem or not isinstance(value, int | float):
            continue
        if stem.endswith(_SPLIT_POOLS):
            continue
        stems.setdefault(stem.removesuffix(".all"), {})[part] = int(value)
    return {
        stem: Counter(
            current=parts["current"],
            freed=parts["freed"],
            peak=parts["peak"],
            allocated=parts.get("allocated"),
        )
        for stem, parts in sorted(stems.items())
        if {"current", "freed", "peak"} <= parts.keys()
    }


class CounterClassifier:
    """Tells gauges from running totals across successive snapshots of one allocator."""

    def __init__(self) -> None:
        self._first_freed: dict[str, int] = {}
        self._kinds: dict[str, CounterKind] = {}

    def update(self, counters: Mapping[str, Counter]) -> dict[str, CounterKind]:
        """Feed one snapshot's counters; return every counter's kind so far."""
        for stem, counter in counters.items():
            first = self._first_freed.setdefault(stem, counter.freed)
            if self._kinds.get(stem) is CounterKind.GAUGE:
                continue  # once freed has moved, the counter is a gauge for good
            if counter.freed != first or counter.freed > 0:
                self._kinds[stem] = CounterKind.GAUGE
            elif counter.current > 0:
                self._kinds[stem] = CounterKind.RUNNING_TOTAL
            else:
                self._kinds[stem] = CounterKind.UNKNOWN
        return dict(self._kinds)


def counter_metrics(
    prefix: str, counters: Mapping[str, Counter], kinds: Mapping[str, CounterKind]
) -> dict[str, float]:
    """Flatten counters to ``{prefix/stem/current|freed|peak: bytes}`` plus ``/gauge``: 1.0 for a
    gauge, 0.0 for a running total, absent while unclassified."""
    out: dict[str, float] = {}
    for stem, counter in counters.items():
        for part in ("current", "freed", "peak"):
            out[f"{prefix}/{stem}/{part}"] = float(getattr(counter, part))
        kind = kinds.get(stem, CounterKind.UNKNOWN)
        if kind is not CounterKind.UNKNOWN:
            out[f"{prefix}/{stem}/gauge"] = 1.0 if kind is CounterKind.GAUGE else 0.0
    return out
