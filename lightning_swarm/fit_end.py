"""When does ``Trainer.fit`` end? Read from Lightning's loop state (Lightning glue).

The end-of-fit round must run after the last inner step and before Lightning's final checkpoints.
Every input here is identical on every rank, so every rank reaches the same answer and runs the
same collectives. Ends it cannot foresee (``EarlyStopping``, ``max_time``) are caught by the
strategy's ``on_train_end``: the returned module holds the global model, that step's checkpoints
do not.
"""

from __future__ import annotations

import lightning.pytorch as pl


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
