"""Checkpoints of a fit on a time budget, taken at rounds (Lightning glue).

Under ``sync_every_s`` the islands step at their own pace, so ``trainer.global_step`` differs
between them, and a ``ModelCheckpoint(every_n_train_steps=N)`` left to itself would ask each
island for a save at a different round, while a save is collective over every rank. The strategy
moves that trigger to the rounds: ``N`` counts the swarm's steps the way ``max_steps`` does under
a budget (the most inner steps any island has taken, agreed in each round's own message), and
every such checkpoint callback saves right after the first round at which that count reached the
next multiple of ``N``. Every rank reads the count from the round's agreement, so the saves cost
no message of their own and land on the same round everywhere. A save right after a round also
holds each island's own loop state and budget (``resume``): a resume puts every island back at
its own ``global_step`` and data position.

Kept as they are: ``save_top_k``, ``monitor`` (a monitored value must be logged by every island
in ``training_step``: a save skips top-k, on every rank, when some island lacks it), ``save_last``
and the file names, which come from global rank 0 (island 0's step count). Refused:
``every_n_epochs``, ``train_time_interval`` and ``save_last="link"``, which fire at each
island's own epoch ends or clock.

The Lightning private names read here (``ModelCheckpoint``'s trigger fields and save methods) are
read nowhere else; ``tests/test_budget_resume.py`` checks that each still exists.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_swarm.errors import SwarmConfigError


def check_round_saves(trainer: pl.Trainer, seconds: float) -> list[ModelCheckpoint]:
    """The trainer's ``ModelCheckpoint`` callbacks that save during the fit, each checked to be
    one a budgeted fit can run at rounds.

    Raises:
        SwarmConfigError: a checkpoint saves at epoch ends or on a clock, or links its last
            checkpoint; the message names the setting and the alternative.
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


class RoundSaves(pl.Callback):
    """Runs each step-triggered ``ModelCheckpoint`` of a budgeted fit at rounds (see the
    module docstring).

    Args:
        trainer: the fitting trainer.
        seconds: the budget (for messages).

    Lifetime: built at the strategy's setup (which checks the callbacks, ``check_round_saves``),
    ``install`` right after it, ``start`` before the first step, ``after_round`` after each
    round, ``restore`` when the fit ends (idempotent): the checkpoints get their own trigger
    back and this callback leaves ``trainer.callbacks``.

    Raises:
        SwarmConfigError: as ``check_round_saves``.
    """

    def __init__(self, trainer: pl.Trainer, seconds: float) -> None:
        self._trainer = trainer
        self._checkpoints = check_round_saves(trainer, seconds)
        self._every = {id(c): c._every_n_train_steps for c in self._checkpoints}
        self._due: list[ModelCheckpoint] = []
        self._last = 0  # the swarm's step count at the last round

    @property
    def checkpoints(self) -> list[ModelCheckpoint]:
        """The checkpoint callbacks whose saves move to rounds."""
        return list(self._checkpoints)

    def install(self) -> None:
        """Take over the checkpoints' step trigger; join ``trainer.callbacks`` right before the
        first checkpoint callback (Lightning runs those last, so this runs just before them)."""
        if not self._checkpoints:
            return
        for checkpoint in self._checkpoints:
            checkpoint._every_n_train_steps = 0  # its own per-island trigger never fires
        callbacks: list[pl.Callback] = self._trainer.callbacks  # type: ignore[attr-defined]
        first = next(i for i, c in enumerate(callbacks) if c in self._checkpoints)
        callbacks.insert(first, self)

    def start(self, swarm_steps: int) -> None:
        """Before the first step: the swarm's step count at the last round (0 for a fresh fit;
        a resumed one's, the same on every rank)."""
        self._last = swarm_steps

    def after_round(self, swarm_steps: int) -> None:
        """After a round at which the most inner steps of any island was ``swarm_steps`` (the
        same on every rank): marks the checkpoints whose next multiple of
        ``every_n_train_steps`` was reached since the last round."""
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
            if checkpoint.monitor is None or _everywhere(trainer, checkpoint.monitor in candidates):
                checkpoint._save_topk_checkpoint(trainer, candidates)
            else:
                rank_zero_warn(
                    f"ModelCheckpoint(monitor={checkpoint.monitor!r}): some island has not logged "
                    "it at this round, so no top-k checkpoint was saved here; under "
                    "sync_every_s log the monitored value in training_step on every island."
                )
            checkpoint._save_last_checkpoint(trainer, candidates)

    def restore(self) -> None:
        """Give the checkpoints their own trigger back and leave ``trainer.callbacks`` (a no-op
        when ``install`` never ran: each trigger is then still its own)."""
        for checkpoint in self._checkpoints:
            checkpoint._every_n_train_steps = self._every[id(checkpoint)]
        callbacks: list[pl.Callback] = self._trainer.callbacks  # type: ignore[attr-defined]
        if self in callbacks:
            callbacks.remove(self)


def _everywhere(trainer: pl.Trainer, local: bool) -> bool:
    """Whether ``local`` holds on every rank (collective over the world; at a save, where every
    rank is anyway)."""
    return bool(trainer.strategy.reduce_boolean_decision(local, all=True))
