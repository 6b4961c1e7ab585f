"""Rounds on a time budget (``sync_every_s``): when an island joins, and the weight it brings.

An island joins after the inner step during which ``seconds`` of its own wall time since the last
round ran out (no exchange decides it), weighted by the inner steps it took since."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_swarm.errors import SwarmConfigError

Clock = Callable[[], float]  # seconds on a monotonic clock
IslandDecision = Callable[[bool], bool]  # every rank of an island gets its first rank's verdict


def check_budget(seconds: object) -> None:
    """Raise ``SwarmConfigError`` unless ``seconds`` is ``None`` or a finite number > 0."""
    if seconds is None:
        return
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise SwarmConfigError(
            f"sync_every_s must be a number of seconds > 0, got {seconds!r}; e.g. "
            "sync_every_s=30.0 (or leave it unset to sync every sync_every inner steps)."
        )


class RoundBudget:
    """One island's time budget between two rounds. ``island_decision`` is needed with several
    ranks per island (their clocks differ). Setup is never charged: a fresh budget starts at the
    first ``spent``, a loaded one at ``continue_now``; a save stops the clock (``pause`` ..
    ``unpause``). ``max_inner_steps`` (the fit's ``max_steps``) cuts a budget short: an island
    that reaches it joins a round at once, so no island trains past it."""

    def __init__(
        self,
        seconds: float,
        *,
        clock: Clock = time.monotonic,
        island_decision: IslandDecision | None = None,
    ) -> None:
        check_budget(seconds)
        self.seconds = float(seconds)
        self.clock = clock
        self.island_decision = island_decision
        self._started_at: float | None = None
        self._carried_s = 0.0  # spent before a resume or a save, in this budget
        self._paused = False
        self._loaded = False  # loaded, and no step counted since
        self.round_started_step = 0  # the inner step the island left the last round after
        self.swarm_steps: int | None = None  # the most steps any island had at the last round
        self.max_inner_steps: int | None = None

    def elapsed_s(self) -> float:
        if self._started_at is None:
            return self._carried_s
        return self._carried_s + self.clock() - self._started_at

    def spent(self, inner_steps: int = 0) -> bool:
        """After inner step ``inner_steps``: whether the island joins a round now (collective
        over the island's ranks)."""
        if self._started_at is None:
            self._started_at = self.clock()
        self._loaded = False
        cap = self.max_inner_steps
        verdict = self.elapsed_s() >= self.seconds or (cap is not None and inner_steps >= cap)
        return verdict if self.island_decision is None else self.island_decision(verdict)

    def work(self, inner_steps: int) -> int:
        """The island's weight in a round joined after ``inner_steps``: steps since the last."""
        return inner_steps - self.round_started_step

    def restart(self, inner_steps: int) -> None:
        """The island left a round after ``inner_steps``: a new budget starts now."""
        self._started_at = self.clock()
        self._carried_s = 0.0
        self.round_started_step = inner_steps

    def pause(self, inner_steps: int) -> None:
        """A save begins after ``inner_steps``: the clock stops until ``unpause``. Right after a
        round, the time since is dropped too, as if the island had just left it."""
        if self._started_at is None:
            return
        self._carried_s = 0.0 if inner_steps == self.round_started_step else self.elapsed_s()
        self._started_at = None
        self._paused = True

    def unpause(self) -> None:
        if self._paused:
            self._started_at = self.clock()
            self._paused = False

    def continue_now(self) -> None:
        """A budget loaded by a resume, before its first step: its clock runs from now."""
        if self._loaded:
            self._started_at = self.clock()

    def state_dict(self) -> dict[str, Any]:
        return {
            "elapsed_s": self.elapsed_s(),
            "round_started_step": self.round_started_step,
            "swarm_steps": self.swarm_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._carried_s = float(state["elapsed_s"])
        self._started_at = self.clock()
        self._paused = False
        self._loaded = True
        self.round_started_step = int(state["round_started_step"])
        steps = state.get("swarm_steps")
        self.swarm_steps = None if steps is None else int(steps)


def scale_of(weights: Sequence[float], own: int) -> float:
    """The factor ``n * w_own / W`` island ``own`` multiplies its pseudo-gradient by, so that a
    plain mean is the weighted one; exactly 1.0 when the weights are equal or all 0."""
    n, total = len(weights), sum(weights)
    if total <= 0 or all(w == weights[0] for w in weights):
        return 1.0
    return n * weights[own] / total
