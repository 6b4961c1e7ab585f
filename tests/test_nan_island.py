"""Issue 22, item 4: an island whose contribution went NaN trains again (swarm transport).

Island 1 poisons one weight before its second step, so its loss, gradients, parameters and Adam
moments turn NaN. The round after step 3 leaves its contribution out; the island must then
restart from the new anchors with its inner optimizer state cleared, train finite values again,
and be accepted by the round after step 6. ``swarm/islands_reset`` counts the reset.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

from lightning_swarm import SwarmStrategy
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from tests.helpers import TinyRegressor, regression_data

POISON_STEP = 1


class PoisonedAdam(TinyRegressor):
    """Adam (whose moments keep NaN once they hold it); island 1 goes NaN at POISON_STEP."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_rank == 1 and self.trainer.global_step == POISON_STEP:
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Watch(pl.Callback):
    """Per rank and step: are the parameters finite, and which islands did the round accept."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *a: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy) and strategy.outer_loop is not None
        transport = strategy.outer_loop.transport
        assert isinstance(transport, SwarmAggregator)
        last = transport.last_round
        params: list[Tensor] = [p.detach() for p in module.parameters()]
        self.steps.append(
            {
                "step": trainer.global_step,
                "finite": all(bool(torch.isfinite(p).all()) for p in params),
                "accepted": None if last is None else list(last.accepted),
            }
        )

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        state = trainer.optimizers[0].state_dict()["state"]
        adam_steps = {float(s["step"]) for s in state.values()}
        info = {"steps": self.steps, "adam_steps": sorted(adam_steps)}
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def test_a_nan_island_is_reset_to_the_anchors_and_trains_again(tmp_path: Path) -> None:
    pl.seed_everything(0)
    strategy = SwarmStrategy(
        sync_every=3,
        transport="swarm",
        swarm={"spool_dir": str(tmp_path / "spool")},
        start_method="fork",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        callbacks=[Watch(tmp_path)],
        logger=CSVLogger(str(tmp_path), name="m", version=0),
        log_every_n_steps=50,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(PoisonedAdam(), regression_data())
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    island1 = {s["step"]: s for s in ranks[1]["steps"]}
    assert not island1[2]["finite"]  # poisoned: the test's premise holds
    assert island1[3]["accepted"] == [0]  # round 1 left island 1 out...
    assert island1[4]["finite"] and island1[5]["finite"]  # ...and island 1 trains again
    assert island1[6]["accepted"] == [0, 1]  # round 2 counts it
    # Adam restarted on island 1 at the reset: 3 steps since, against 6 on island 0.
    assert ranks[1]["adam_steps"] == [3.0] and ranks[0]["adam_steps"] == [6.0]
    with open(tmp_path / "m" / "version_0" / "metrics.csv") as f:
        resets = [
            float(r["swarm/islands_reset"]) for r in csv.DictReader(f) if r["swarm/islands_reset"]
        ]
    assert resets[0] == 1.0 and resets[-1] == 1.0, resets
    assert not any(math.isnan(v) for v in resets)
