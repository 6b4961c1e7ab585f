"""Learning-rate schedules over DiLoCo rounds, as Lightning callbacks for the quality sweep.

The strategy has no schedule for the outer optimizer, and the demo model's inner schedule is a
warm-up then constant. These callbacks add both from the outside, through public surfaces only:
``SwarmStrategy.outer_syncs`` (each ``OuterSync`` exposes its ``outer_optimizer`` and the number
of rounds it has applied) and the inner optimizers Lightning holds.

Both set learning rates in ``on_train_batch_start``, i.e. before the inner step whose end may
run the next outer round, so round ``k`` (0-based) always uses ``factor(k)``. The inner factor
multiplies whatever the module's own scheduler set for this step (``LambdaLR`` writes an
absolute value every step, so the product is recomputed, never compounded). Base outer rates
are read once, at the first batch, and kept here for the whole fit.

A round is ``sync_every`` inner steps; the total is ``max_steps // sync_every``. The same round
arithmetic works for DDP and no-sync runs, which is how their baselines get the same inner
schedule. Shapes (``kind``):
- ``cosine``: 1 at round 0 down to ``final`` at the last round (half a cosine);
- ``linear``: straight line from 1 to ``final``;
- ``warmup``: from ``final`` up to 1 over the first ``warmup_rounds`` rounds, then 1.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_swarm.algorithm.outer_schedule import MomentumSchedule, total_rounds
from lightning_swarm.strategy import SwarmStrategy

KINDS = ("cosine", "linear", "warmup")


def round_factor(kind: str, rnd: int, total: int, final: float, warmup_rounds: int = 0) -> float:
    """The multiplier of round ``rnd`` (0-based) out of ``total`` rounds."""
    if kind not in KINDS:
        raise ValueError(f"schedule kind {kind!r} is not known; use one of {list(KINDS)}.")
    if kind == "warmup":
        if warmup_rounds < 1:
            raise ValueError(f"warmup needs warmup_rounds >= 1, got {warmup_rounds}.")
        return final + (1.0 - final) * min(1.0, rnd / warmup_rounds)
    progress = min(1.0, rnd / max(1, total - 1))
    if kind == "linear":
        return 1.0 + (final - 1.0) * progress
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _RoundSchedule(Callback):
    def __init__(
        self, sync_every: int, kind: str = "cosine", final: float = 0.1, warmup_rounds: int = 0
    ) -> None:
        round_factor(kind, 0, 1, final, warmup_rounds)  # rejects a bad kind before training
        self.sync_every = sync_every
        self.kind, self.final, self.warmup_rounds = kind, final, warmup_rounds

    def factor(self, trainer: pl.Trainer, rnd: int) -> float:
        total = max(1, int(trainer.max_steps) // self.sync_every)
        return round_factor(self.kind, rnd, total, self.final, self.warmup_rounds)


class OuterLrSchedule(_RoundSchedule):
    """Scale every outer optimizer's learning rate by the schedule's factor of the next round."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._base: dict[int, float] = {}

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SwarmStrategy):
            raise TypeError("OuterLrSchedule needs SwarmStrategy (it schedules the outer lr).")
        for outer in strategy.outer_syncs:
            scale = self.factor(trainer, outer.outer_steps)
            for group in outer.outer_optimizer.param_groups:
                base = self._base.setdefault(id(group), float(group["lr"]))
                group["lr"] = base * scale


class InnerLrSchedule(_RoundSchedule):
    """Scale the inner learning rate by the factor of the round the step belongs to."""

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        scale = self.factor(trainer, trainer.global_step // self.sync_every)
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, lr in zip(
                scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
            ):
                group["lr"] = lr * scale


def inner_lr_ratio(trainer: pl.Trainer) -> float:
    """The first inner optimizer's current lr over its base lr (``initial_lr``, which every
    torch scheduler records; 1 without a scheduler): 1 at the peak of a schedule."""
    group = trainer.optimizers[0].param_groups[0]
    base = float(group.get("initial_lr", group["lr"]))
    return float(group["lr"]) / base if base > 0 else 1.0


class OuterStepSchedule(Callback):
    """Candidate outer steps of issue 40, set before each round from the outside.

    ``lr_by_inner``: each outer lr is its base times ``inner_lr_ratio`` at the round (the
    inner step that ends the round), so the outer step decays with the inner schedule.
    ``momentum_warmup_rounds``: each outer momentum ramps linearly from 0 (round 0) to its
    base over that many rounds, so no momentum is built on the first, large pseudo-gradients.
    ``momentum_by_inner``: each outer momentum is also multiplied by ``inner_lr_ratio``, so
    momentum fades as the inner schedule decays (and the outer step becomes a plain step).
    ``momentum_shares`` (warm-up, cool-down): the library's ``MomentumSchedule`` over the
    run's rounds (``max_steps`` over ``sync_every``), on top of the options above.
    Base values are the outer optimizer's own, read at the first batch.
    """

    def __init__(
        self,
        lr_by_inner: bool = False,
        momentum_warmup_rounds: int = 0,
        momentum_by_inner: bool = False,
        momentum_shares: tuple[float, float] | None = None,
    ) -> None:
        if momentum_warmup_rounds < 0:
            raise ValueError(f"momentum_warmup_rounds must be >= 0, got {momentum_warmup_rounds}.")
        self.lr_by_inner = lr_by_inner
        self.momentum_warmup_rounds = momentum_warmup_rounds
        self.momentum_by_inner = momentum_by_inner
        self.shares = None
        if momentum_shares is not None:
            warmup, cooldown = momentum_shares
            self.shares = MomentumSchedule(warmup=warmup, cooldown=cooldown)
        self._base: dict[int, tuple[float, float]] = {}

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SwarmStrategy):
            raise TypeError("OuterStepSchedule needs SwarmStrategy (it sets the outer step).")
        ratio = inner_lr_ratio(trainer)
        lr_scale = ratio if self.lr_by_inner else 1.0
        for outer in strategy.outer_syncs:
            warm = self.momentum_warmup_rounds
            momentum_scale = min(1.0, outer.outer_steps / warm) if warm else 1.0
            momentum_scale *= ratio if self.momentum_by_inner else 1.0
            if self.shares is not None:
                rounds = total_rounds(trainer.max_steps, outer.sync_every)
                momentum_scale *= self.shares.factor(outer.outer_steps, rounds)
            for group in outer.outer_optimizer.param_groups:
                lr, momentum = self._base.setdefault(
                    id(group), (float(group["lr"]), float(group.get("momentum", 0.0)))
                )
                group["lr"] = lr * lr_scale
                if "momentum" in group:
                    group["momentum"] = momentum * momentum_scale
