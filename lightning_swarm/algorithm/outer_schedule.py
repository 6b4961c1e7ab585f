"""The outer momentum schedule: how much of the outer optimizer's momentum each round uses.

A run from scratch starts with large, fast-changing pseudo-gradients; momentum built on them
keeps pushing the anchors for rounds after they stopped pointing anywhere useful. And at the
end of a run whose inner learning rate has annealed, the islands barely move between rounds,
so a full momentum buffer moves the anchors with nothing left to correct it; over thousands of
steps a sustained momentum also loses to plain averaging. The schedule ramps the momentum up
from 0 over the first ``warmup`` share of the rounds and back down to 0 over the last
``cooldown`` share (by default half and half: a triangle peaking mid-run), so the first round
and the last one are plain steps toward the islands' average.

The factor is a pure function of (round index, total rounds): a resume that restores the round
counter restores the momentum bit for bit, and every island computes the same value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_swarm.algorithm.robust import is_number
from lightning_swarm.errors import SwarmConfigError


@dataclass(frozen=True, kw_only=True)
class MomentumSchedule:
    """Shares of the run's rounds over which outer momentum ramps up and down.

    Args:
        warmup: share of the rounds (0 to 1) over which momentum rises linearly from 0 (round
            0) to the outer optimizer's own; 0 starts at full momentum.
        cooldown: share of the rounds at the end over which momentum falls linearly to 0 at
            the last round; 0 keeps full momentum to the end.

    Raises:
        SwarmConfigError: a share outside [0, 1], or shares summing above 1.
    """

    warmup: float = 0.5
    cooldown: float = 0.5

    def __post_init__(self) -> None:
        for name, value in (("warmup", self.warmup), ("cooldown", self.cooldown)):
            if not is_number(value) or not 0.0 <= value <= 1.0:
                raise SwarmConfigError(
                    f"outer_momentum_{name}={value!r} must be a share of the run's rounds from 0 "
                    f"to 1 (0 turns the ramp off), e.g. outer_momentum_{name}="
                    f"0.5."
                )
        if self.warmup + self.cooldown > 1.0:
            raise SwarmConfigError(
                f"outer_momentum_warmup={self.warmup} and outer_momentum_cooldown="
                f"{self.cooldown} overlap (their sum is above 1); lower one of them."
            )

    @property
    def flat(self) -> bool:
        """No ramp at all: the momentum is left as the outer optimizer holds it."""
        return self.warmup == 0 and self.cooldown == 0

    def factor(self, round_index: int, total_rounds: int | None) -> float:
        """The multiplier of the outer momentum at 0-based ``round_index`` of ``total_rounds``
        (``None``: the length is unknown; momentum stays at its full value, no ramps)."""
        if total_rounds is None or total_rounds < 1:
            return 1.0
        factor = 1.0
        if self.warmup > 0:
            factor = min(factor, round_index / math.ceil(self.warmup * total_rounds))
        if self.cooldown > 0:
            left = total_rounds - 1 - round_index
            factor = min(factor, max(0.0, left / math.ceil(self.cooldown * total_rounds)))
        return max(0.0, min(1.0, factor))


NO_MOMENTUM_SCHEDULE = MomentumSchedule(warmup=0.0, cooldown=0.0)
"""The momentum the outer optimizer was built with, at every round."""


def base_momentum(optimizer: torch.optim.Optimizer) -> list[float | None]:
    """Each param group's momentum as built (None where the optimizer has none, e.g. Adam):
    what ``MomentumSchedule.factor`` scales."""
    return [
        float(group["momentum"]) if isinstance(group.get("momentum"), (int, float)) else None
        for group in optimizer.param_groups
    ]


def total_rounds(total_steps: int | float | None, sync_every: int) -> int | None:
    """Rounds in a run of ``total_steps`` inner steps (the last, partial one included); None
    when the length is unknown or unbounded."""
    if total_steps is None or not math.isfinite(total_steps) or total_steps <= 0:
        return None
    return max(1, math.ceil(int(total_steps) / sync_every))
