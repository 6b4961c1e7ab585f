"""One rank of a static run of two FSDP islands of two ranks; rank 1 SIGKILLs itself.

Run by ``tests/test_peer_lost.py`` once per rank, with the rank in the environment:
``python -m tests.fsdp_kill_rank <out_dir>``. Rank 1 dies between rounds; its island peer
(rank 0) fails at once in an FSDP collective, the other island at the next round, where rank 2
finds rank 0 gone and rank 3 rank 1. Each survivor writes its error to ``<out_dir>/rank<r>.pt``.
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
from tests.fsdp_utils import ShardedRegressor
from tests.helpers import QUIET, regression_data

WORLD = 4
SYNC_EVERY = 4
KILL_STEP = 5


class KillOnce(pl.Callback):
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == 1 and trainer.global_step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        result = {"exception": type(exception).__name__, "message": str(exception)}
        torch.save(result, self.out_dir / f"rank{trainer.global_rank}.pt")


def main(out_dir: Path) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=SwarmStrategy(sync_every=SYNC_EVERY, island_size=2, island_parallel="fsdp"),
        max_steps=40,
        callbacks=[KillOnce(out_dir)],
        **QUIET,
    )
    trainer.fit(ShardedRegressor(), regression_data())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
