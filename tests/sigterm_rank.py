"""One rank of a static run of two islands of two ranks; rank 3 sends itself SIGTERM.

Run by ``tests/test_between_rounds.py`` once per rank, with the rank in the environment, so
that each rank's exit status and output are its own:
``python -m tests.sigterm_rank <out_dir>``. Each rank writes how its fit ended to
``<out_dir>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_swarm import SwarmStrategy
from tests.helpers import QUIET, TinyRegressor, flat_params, regression_data

WORLD = 4
SYNC_EVERY = 4
STOP_STEP = 5  # rank 3 is signalled before this step's batch


class SignalOnce(pl.Callback):
    """Rank 3 receives SIGTERM, as from a scheduler; every rank records how the fit ended."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == WORLD - 1 and trainer.global_step == STOP_STEP:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        strategy = trainer.strategy
        result = {
            "exception": type(exception).__name__,
            "global_step": trainer.global_step,
            "outer_steps": strategy.outer_syncs[0].outer_steps,  # type: ignore[attr-defined]
            "params": flat_params(pl_module),
        }
        torch.save(result, self.out_dir / f"rank{trainer.global_rank}.pt")


def main(out_dir: Path) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=SwarmStrategy(sync_every=SYNC_EVERY, island_size=2),
        max_steps=40,
        callbacks=[SignalOnce(out_dir)],
        **QUIET,
    )
    trainer.fit(TinyRegressor(), regression_data())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
