"""One rank of a 3-rank static run whose last rank stops itself (SIGSTOP) at a chosen step.

Run by ``tests/test_collective_timeout.py`` once per rank, with the rank in the environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so that Lightning
starts no processes of its own and every rank's output is its own:
``python -m tests.stopped_rank <timeout_s> <stop_step>``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import lightning.pytorch as pl

from lightning_swarm import SwarmStrategy
from tests.helpers import QUIET, TinyRegressor, regression_data

WORLD = 3


class StopSelf(pl.Callback):
    """The last rank stops (as a debugger or a frozen host would) before step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == WORLD - 1 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGSTOP)


def main(timeout_s: float, stop_step: int) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=SwarmStrategy(sync_every=2, timeout_s=timeout_s),
        max_steps=40,
        callbacks=[StopSelf(stop_step)],
        **QUIET,
    )
    trainer.fit(TinyRegressor(), regression_data())


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
