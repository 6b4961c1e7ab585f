"""When does ``Trainer.fit`` end? Read from Lightning's loop state (Lightning glue).

The end-of-fit round must run after the last inner step and before Lightning's final checkpoints.
Every input here is identical on every rank, so every rank reaches the same answer and runs the
same collectives. Ends it cannot foresee (``EarlyStopping``, ``max_time``) are caught by the
strategy's ``on_train_end``: the returned module holds the global model, that step's checkpoints
do not.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_swarm.errors import SwarmConfigError


def fit_ends_after_step(trainer: pl.Trainer, *, steps_pending: int) -> bool:
    """True when no inner optimizer step follows the one just taken in this fit.

    Args:
        trainer: the fitting trainer.
        steps_pending: optimizer steps taken but not yet in ``trainer.global_step`` (1 inside
            ``optimizer_step`` under automatic optimization, 0 after ``training_step`` under
            manual optimization, whose steps are counted as they happen).
    """
    steps = trainer.global_step + steps_pending
    if trainer.max_steps != -1 and steps >= trainer.max_steps:
        return True
    epoch_loop = trainer.fit_loop.epoch_loop
    last_batch = (
        trainer.is_last_batch
        or epoch_loop.batch_progress.current.ready >= trainer.num_training_batches
    )
    max_epochs = trainer.max_epochs
    if last_batch and max_epochs not in (None, -1) and trainer.current_epoch + 1 >= max_epochs:
        return True
    # Lightning stops after this batch when should_stop is set and min_epochs / min_steps are met.
    return trainer.should_stop and bool(getattr(trainer.fit_loop, "_can_stop_early", True))


class BudgetStop:
    """The end of a fit whose rounds run on a time budget (``sync_every_s``).

    ``Trainer(max_steps)`` is per process, and under a budget islands step at their own pace:
    each would stop on its own, at a different round, holding its own model. So the strategy
    lifts Lightning's own step limit for the fit (``install``, at setup; ``restore`` puts it
    back when the fit ends) and ends the fit on every island at the first round where some
    island had taken ``max_steps`` inner steps (``after_round``): every island then holds the
    round's global model. ``max_epochs`` is refused: epochs also end at each island's pace.
    The rule holds across a resume: the count it reads is restored with each island's budget,
    and ``after_round`` at the start of a resumed fit ends one whose count was already reached.
    (Checkpoints during such a fit are taken at rounds: ``round_saves``.)

    Raises:
        SwarmConfigError: without ``max_steps`` or with ``max_epochs``.
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

    def install(self) -> None:
        """Lift Lightning's per-process step limit (the swarm's rule replaces it)."""
        self._trainer.fit_loop.epoch_loop.max_steps = -1

    def after_round(self, reached: bool) -> None:
        """After a round (or before the first step of a resumed fit): ``reached`` (the same on
        every rank) ends the fit after this batch (before any, at the start)."""
        if reached:
            self._trainer.should_stop = True

    def restore(self) -> None:
        """Give Lightning its ``max_steps`` back (the fit ended). Idempotent."""
        self._trainer.fit_loop.epoch_loop.max_steps = self.max_steps
