"""A fit on a time budget (``sync_every_s``): it ends and checkpoints at rounds (Lightning glue).

Islands step at their own pace, so ``Trainer(max_steps)`` and ``ModelCheckpoint(
every_n_train_steps=N)`` left to themselves would fire at a different round on each island, while
a save is collective and the fit must end holding one global model. ``BudgetFit`` moves both to
the rounds, counting the swarm's steps (the most inner steps any island had taken, the same on
every rank) so that every island stops and saves at the same round. The Lightning private names
read here are read nowhere else; ``tests/test_budget_resume.py`` checks that each still exists.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_swarm.errors import SwarmConfigError


def check_round_saves(trainer: pl.Trainer, seconds: float) -> list[ModelCheckpoint]:
    """The trainer's ``ModelCheckpoint`` callbacks that save during the fit.

    Raises:
        SwarmConfigError: a checkpoint saves at epoch ends or on a clock, or links its last
            checkpoint (each island would do so at a different round).
    """
    during: list[ModelCheckpoint] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback._every_n_epochs or callback._train_time_interval is not None:
            given = (
                f"every_n_epochs={callback._every_n_epochs}"
                if callback._every_n_epochs
                else f"train_time_interval={callback._train_time_interval}"
            )
            raise SwarmConfigError(
                f"sync_every_s={seconds} cannot run ModelCheckpoint({given}): each island "
                "reaches its epoch ends and its clock at a different round, and a save is "
                "collective. Pass ModelCheckpoint(every_n_train_steps=N) instead: under a "
                "budget it saves right after the first round at which some island reached each "
                "multiple of N steps (counted like max_steps); Trainer(enable_checkpointing="
                "False) for no checkpoints during the fit."
            )
        if callback.save_last == "link":
            raise SwarmConfigError(
                f"sync_every_s={seconds} cannot run ModelCheckpoint(save_last='link'): it links "
                "the last checkpoint at each island's own epoch ends, a collective the other "
                "islands do not join; pass save_last=True."
            )
        if callback._every_n_train_steps:
            during.append(callback)
    return during


class BudgetFit(pl.Callback):
    """Ends a budgeted fit, and runs its step-triggered checkpoints, at rounds.

    The fit ends on every island at the first round where the swarm's step count reached
    ``max_steps``; each step-triggered checkpoint saves right after the first round at which
    that count reached its next multiple of ``every_n_train_steps``. ``save_top_k``,
    ``monitor`` (which every island must log in ``training_step``), ``save_last`` and file
    names (global rank 0's) are kept.

    Lifetime: built at the strategy's setup, ``install`` right after it, ``start`` before the
    first step, ``after_round`` after each round, ``restore`` when the fit ends (idempotent):
    Lightning gets ``max_steps`` and the checkpoints' triggers back, and this callback leaves
    ``trainer.callbacks``.

    Raises:
        SwarmConfigError: without ``max_steps``, with ``max_epochs``, or as
            ``check_round_saves``.
    """

    def __init__(self, trainer: pl.Trainer, seconds: float) -> None:
        self._trainer = trainer
        self.max_steps = trainer.max_steps
        if self.max_steps == -1:
            raise SwarmConfigError(
                f"sync_every_s={seconds} ends the fit at the first round where some island "
                "reached Trainer(max_steps=...), but max_steps is not set; pass "
                "Trainer(max_steps=N)."
            )
        if trainer.max_epochs not in (None, -1):
            raise SwarmConfigError(
                f"sync_every_s={seconds} cannot end a fit by Trainer(max_epochs="
                f"{trainer.max_epochs}): islands step at their own pace, so their epochs end at "
                "different rounds; pass max_steps only (max_epochs=-1)."
            )
        self._checkpoints = check_round_saves(trainer, seconds)
        self._every = {id(c): c._every_n_train_steps for c in self._checkpoints}
        self._due: list[ModelCheckpoint] = []
        self._last = 0  # the swarm's step count at the last round

    @property
    def checkpoints(self) -> list[ModelCheckpoint]:
        """The checkpoint callbacks whose saves move to rounds."""
        return list(self._checkpoints)

    def install(self) -> None:
        """Lift Lightning's per-process step limit and the checkpoints' step trigger; join
        ``trainer.callbacks`` right before the first checkpoint (so this runs just before it)."""
        self._trainer.fit_loop.epoch_loop.max_steps = -1
        if not self._checkpoints:
            return
        for checkpoint in self._checkpoints:
            checkpoint._every_n_train_steps = 0
        callbacks: list[pl.Callback] = self._trainer.callbacks  # type: ignore[attr-defined]
        first = next(i for i, c in enumerate(callbacks) if c in self._checkpoints)
        callbacks.insert(first, self)

    def start(self, swarm_steps: int) -> None:
        """Before the first step: the swarm's step count at the last round (0 for a fresh fit);
        a resumed fit whose count already reached ``max_steps`` ends before taking a step."""
        self._last = swarm_steps
        if swarm_steps >= self.max_steps:
            self._trainer.should_stop = True

    def after_round(self, swarm_steps: int) -> None:
        """After a round at which the swarm's step count was ``swarm_steps``: end the fit after
        this batch if it reached ``max_steps``, and mark the checkpoints now due."""
        if swarm_steps >= self.max_steps:
            self._trainer.should_stop = True
        last, every = self._last, self._every
        self._due = [
            c for c in self._checkpoints if swarm_steps // every[id(c)] > last // every[id(c)]
        ]
        self._last = swarm_steps

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        due, self._due = self._due, []
        for checkpoint in due:
            if checkpoint._should_skip_saving_checkpoint(trainer):
                continue
            candidates = checkpoint._monitor_candidates(trainer)
            # Collective over the world (every rank is at this save): a top-k save needs the
            # monitored value on every island.
            logged = checkpoint.monitor is None or trainer.strategy.reduce_boolean_decision(
                checkpoint.monitor in candidates
            )
            if logged:
                checkpoint._save_topk_checkpoint(trainer, candidates)
            else:
                rank_zero_warn(
                    f"ModelCheckpoint(monitor={checkpoint.monitor!r}): some island has not logged "
                    "it at this round, so no top-k checkpoint was saved here; under "
                    "sync_every_s log the monitored value in training_step on every island."
                )
            checkpoint._save_last_checkpoint(trainer, candidates)

    def restore(self) -> None:
        """Give Lightning its ``max_steps`` and the checkpoints their trigger back; leave
        ``trainer.callbacks``. Idempotent."""
        self._trainer.fit_loop.epoch_loop.max_steps = self.max_steps
        for checkpoint in self._checkpoints:
            checkpoint._every_n_train_steps = self._every[id(checkpoint)]
        callbacks: list[pl.Callback] = self._trainer.callbacks  # type: ignore[attr-defined]
        if self in callbacks:
            callbacks.remove(self)
