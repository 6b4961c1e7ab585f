"""Noticing that this process was away: stopped (SIGSTOP), or starved of the CPU for seconds.

A stopped process's monotonic clock runs on, so on SIGCONT every timeout has expired and the swarm
went on without it; the island must ask again rather than give up. ``SuspensionWatch``'s daemon
thread ticks every ``tick_s`` and records a tick ``gap_s`` late. The thread runs until ``close``
(idempotent) and holds no tensors.
"""

from __future__ import annotations

import threading
import time

SUSPENDED_AFTER_S = 5.0
"""A tick this much later than due means the process was away (not merely busy)."""


class SuspensionWatch:
    """Records the gaps in this process's life (see the module docstring)."""

    def __init__(self, tick_s: float = 0.5, gap_s: float = SUSPENDED_AFTER_S) -> None:
        self.tick_s, self.gap_s = tick_s, gap_s
        self._gaps: list[tuple[float, float]] = []  # (monotonic end, seconds away)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-suspension", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if now - last - self.tick_s > self.gap_s:
                with self._lock:
                    self._gaps.append((now, now - last - self.tick_s))
            last = now

    def away_since(self, since: float) -> float:
        """Seconds this process was away in gaps that ended after monotonic time ``since``."""
        with self._lock:
            return sum(away for end, away in self._gaps if end > since)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
