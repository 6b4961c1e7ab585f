"""One rank of a static run of two islands of one rank each; rank 1 SIGKILLs itself.

Run by ``tests/test_peer_lost.py`` once per rank, with the rank in the environment:
``python -m tests.peer_lost_rank <out_dir> <when> [<transport>]``. ``when`` is ``between``
(rank 1 dies before an inner step between rounds) or ``mid`` (rank 1 dies inside a round, after
its opening agreement, before its bucket starts); ``transport`` is the strategy's (default
``allreduce``). The survivor writes the class and message of the error its fit ended with to
``<out_dir>/rank0.pt``.
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
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.allreduce import AllReduceTransport
from tests.helpers import QUIET, TinyRegressor, regression_data

WORLD = 2
SYNC_EVERY = 4
KILL_STEP = 5  # between rounds: after round 1 (step 4), before round 2 (step 8)


class KillOnce(pl.Callback):
    """Rank 1 dies as from the OOM killer; rank 0 records how its fit ended."""

    def __init__(self, out_dir: Path, when: str) -> None:
        self.out_dir = out_dir
        self.when = when

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != 1:
            return
        if self.when == "between" and trainer.global_step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.when == "mid" and trainer.global_step == KILL_STEP:
            for cls in (AllReduceTransport, SwarmAggregator):
                # After the round's opening agreement, before its bucket moves: the survivor's
                # bucket cannot complete (had rank 1 sent it first, the survivor's mean could
                # complete and the death show only at the next cross-island message).
                cls.start = die_at_start  # type: ignore[method-assign, assignment]

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        result = {"exception": type(exception).__name__, "message": str(exception)}
        torch.save(result, self.out_dir / f"rank{trainer.global_rank}.pt")


def die_at_start(transport: Any, bucket: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


def main(out_dir: Path, when: str, transport: str = "allreduce") -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=SwarmStrategy(sync_every=SYNC_EVERY, transport=transport),
        max_steps=40,
        callbacks=[KillOnce(out_dir, when)],
        **QUIET,
    )
    trainer.fit(TinyRegressor(), regression_data())


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
