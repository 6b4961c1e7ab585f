"""Host-memory samples on two cadences, allocator counters, and the end-of-run summary.

Keys are ``"<source>/<field>_bytes"``; what cannot be measured is absent, never zero. A counter
whose ``freed`` never moves is a running total: read as a gauge it shows a phantom leak."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lightning_swarm.memory.procfs import ProcReader

RSS_KEYS = ("status/VmRSS_bytes", "psutil/rss_bytes")
PEAK_RSS_KEYS = ("status/VmHWM_bytes", "rusage/ru_maxrss_bytes")
ANON_KEY = "status/RssAnon_bytes"


class HostSampler:
    """Samples this process's and node's memory from ``reader`` (``ProcReader("/nonexistent")``
    plays a machine without /proc); ``psutil_module``: the stand-in's psutil, ``None`` for the
    installed one, if any."""

    def __init__(self, reader: ProcReader | None = None, psutil_module: Any = None) -> None:
        self.reader = reader if reader is not None else ProcReader()
        if psutil_module is None:
            with contextlib.suppress(ImportError):
                import psutil

                psutil_module = psutil
        self._psutil = psutil_module
        self._process: Any = None

    def sample_fast(self) -> dict[str, int]:
        """Constant-cost readings: status and meminfo, or the stand-in for either."""
        process = {f"status/{k}_bytes": v for k, v in (self.reader.status() or {}).items()}
        node = {f"meminfo/{k}_bytes": v for k, v in (self.reader.meminfo() or {}).items()}
        return {**(process or self._standin_process()), **(node or self._standin_node())}

    def sample_slow(self) -> dict[str, float]:
        """Page-walking readings (smaps_rollup) and the seconds the read took."""
        start = time.perf_counter()
        rollup = self.reader.smaps_rollup()
        elapsed = time.perf_counter() - start
        if not rollup:
            return {}
        out: dict[str, float] = {f"smaps_rollup/{k}_bytes": float(v) for k, v in rollup.items()}
        out["smaps_rollup/read_s"] = elapsed
        return out

    def _standin_process(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self._psutil is not None:
            try:
                if self._process is None:
                    self._process = self._psutil.Process()
                out["psutil/rss_bytes"] = int(self._process.memory_info().rss)
            except Exception:  # psutil reads /proc too on Linux; it may fail the same way
                pass
        peak = _rusage_maxrss_bytes()
        if peak is not None:
            out["rusage/ru_maxrss_bytes"] = peak
        return out

    def _standin_node(self) -> dict[str, int]:
        if self._psutil is None:
            return {}
        try:
            return {"psutil/available_bytes": int(self._psutil.virtual_memory().available)}
        except Exception:
            return {}


def _rusage_maxrss_bytes() -> int | None:
    """Peak RSS from getrusage (a syscall, no /proc); None where the module is missing."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux and the BSDs report KiB, macOS reports bytes.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


class RunSummary:
    """Peak RSS, peak anonymous memory and anonymous-memory slope over one run."""

    def __init__(self) -> None:
        self.peak_rss: int | None = None
        self.peak_anon: int | None = None
        self.num_samples = 0
        # Exact integer sums for least squares of anon (y) against step (x).
        self._n = self._sx = self._sy = self._sxy = self._sxx = 0

    def update(self, step: int, sample: Mapping[str, float]) -> None:
        """Fold one fast sample taken at ``step`` (an integer optimizer step)."""
        self.num_samples += 1
        for key in (*RSS_KEYS, *PEAK_RSS_KEYS):
            if key in sample:
                self.peak_rss = max(self.peak_rss or 0, int(sample[key]))
        if ANON_KEY in sample:
            anon = int(sample[ANON_KEY])
            self.peak_anon = max(self.peak_anon or 0, anon)
            self._n += 1
            self._sx += step
            self._sy += anon
            self._sxy += step * anon
            self._sxx += step * step

    def anon_slope(self) -> float | None:
        """Least-squares bytes per step of anonymous memory; None with < 2 distinct steps."""
        denom = self._n * self._sxx - self._sx * self._sx
        if self._n < 2 or denom == 0:
            return None
        return (self._n * self._sxy - self._sx * self._sy) / denom

    def metrics(self) -> dict[str, float]:
        """``summary/...`` values that could be measured (absent otherwise)."""
        values = {
            "num_samples": self.num_samples,
            "peak_rss_bytes": self.peak_rss,
            "peak_anon_bytes": self.peak_anon,
            "anon_slope_bytes_per_step": self.anon_slope(),
        }
        return {f"summary/{k}": float(v) for k, v in values.items() if v is not None}


_PARTS = ("current", "freed", "peak")
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


def byte_counters(snapshot: Mapping[str, Any]) -> dict[str, Counter]:
    """The byte statistics (``current``, ``freed``, ``peak``) of a flat allocator snapshot, by
    stem; ``.all`` is dropped from the stem, the split pools are skipped."""
    stems: dict[str, dict[str, int]] = {}
    for key, value in snapshot.items():
        stem, _, part = key.rpartition(".")
        wanted = part in _PARTS and "bytes" in stem and not stem.endswith(_SPLIT_POOLS)
        if wanted and isinstance(value, int | float):
            stems.setdefault(stem.removesuffix(".all"), {})[part] = int(value)
    return {
        stem: Counter(**parts) for stem, parts in sorted(stems.items()) if len(parts) == len(_PARTS)
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
