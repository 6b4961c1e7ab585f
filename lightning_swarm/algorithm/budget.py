"""Rounds on a time budget (``sync_every_s``): when an island joins, and the weight it brings.

Under a budget an island trains for ``seconds`` of its own wall time after it left the last
round, then joins the next one after the inner step during which the budget ran out (checked
after every step, so at most one step late). Nothing is exchanged to decide it: each island
reads its own clock. The island's weight in the round is the inner steps it took since the
last round (``work``); the transport turns the weights into a weighted mean (``scale_of``).
Pure Python; the clock is injected so tests drive it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_swarm.errors import SwarmConfigError

Clock = Callable[[], float]
"""Seconds on a monotonic clock (``time.monotonic`` by default)."""

IslandDecision = Callable[[bool], bool]
"""Collective over an island's ranks: every rank gets the island's first rank's verdict."""


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
    """One island's time budget between two rounds (see the module docstring).

    Args:
        seconds: the budget, in seconds of this island's wall time.
        clock: the time source; every rank reads its own.
        island_decision: with several ranks in the island, makes the island's first rank's
            verdict everyone's (their clocks differ); ``None`` for an island of one rank.

    A fresh budget starts when the first step is counted (``spent``), not at construction, so
    setup is not charged to the first round; a loaded one continues from the moment it is
    loaded, or from ``continue_now`` (the strategy calls it right before the first step, so the
    rest of a resume's setup is not charged either). A save stops the clock (``pause`` ..
    ``unpause``); a save right after a round stores, and continues, the budget as if the island
    had just left that round.
    """

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
        self._paused = False  # a save is under way (``pause``)
        self._loaded = False  # loaded, and no step counted since (``continue_now``)
        self.round_started_step = 0  # the inner step the island left the last round after
        # The most inner steps any island had taken at the last round (None before one).
        self.swarm_steps: int | None = None

    def elapsed_s(self) -> float:
        """Seconds of this budget spent so far (0 before the first step)."""
        if self._started_at is None:
            return self._carried_s
        return self._carried_s + self.clock() - self._started_at

    def spent(self) -> bool:
        """After an inner step: whether the island joins a round now. Collective over the
        island when it has several ranks (every rank calls it after the same step)."""
        if self._started_at is None:
            self._started_at = self.clock()
        self._loaded = False
        verdict = self.elapsed_s() >= self.seconds
        if self.island_decision is not None:
            verdict = self.island_decision(verdict)
        return verdict

    def work(self, inner_steps: int) -> int:
        """The island's weight in a round joined after ``inner_steps``: steps since the last."""
        return inner_steps - self.round_started_step

    def restart(self, inner_steps: int) -> None:
        """The island left a round after ``inner_steps``: a new budget starts now."""
        self._started_at = self.clock()
        self._carried_s = 0.0
        self.round_started_step = inner_steps

    def pause(self, inner_steps: int) -> None:
        """A save begins after ``inner_steps``: the clock stops until ``unpause``, so the save's
        own time is not charged. When no inner step was taken since the island left the last
        round, the time since is dropped too: the budget is saved, and goes on, as if the
        island had just left that round. A budget not started yet stays so."""
        if self._started_at is None:
            return
        at_round = inner_steps == self.round_started_step
        self._carried_s = 0.0 if at_round else self.elapsed_s()
        self._started_at = None
        self._paused = True

    def unpause(self) -> None:
        """The save is over: the clock runs again from now."""
        if self._paused:
            self._started_at = self.clock()
            self._paused = False

    def continue_now(self) -> None:
        """A budget loaded by a resume, before its first step: its clock runs from now, not
        from the load (what happened in between is setup). No effect otherwise."""
        if self._loaded:
            self._started_at = self.clock()

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to continue this budget: the time spent and where it began."""
        return {
            "elapsed_s": self.elapsed_s(),
            "round_started_step": self.round_started_step,
            "swarm_steps": self.swarm_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved budget from now."""
        self._carried_s = float(state["elapsed_s"])
        self._started_at = self.clock()
        self._paused = False
        self._loaded = True
        self.round_started_step = int(state["round_started_step"])
        steps = state.get("swarm_steps")
        self.swarm_steps = None if steps is None else int(steps)


def scale_of(weights: Sequence[float], own: int) -> float:
    """The factor island ``own`` multiplies its pseudo-gradient by before a plain mean over
    ``len(weights)`` islands, so that the mean is ``sum_i w_i * delta_i / sum_i w_i``:
    ``n * w_own / W``. Exactly 1.0 when every weight is equal (the plain mean, bit for bit)
    and when every weight is 0 (nobody stepped: nothing to weigh).
    """
    n, total = len(weights), sum(weights)
    if total <= 0 or all(w == weights[0] for w in weights):
        return 1.0
    return n * weights[own] / total
