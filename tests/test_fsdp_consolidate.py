"""The recipe of docs/fsdp.md "Consolidated weights": gather the global model out of FSDP islands.

2 islands x 2 FSDP2 ranks over gloo. Fit stops 2 inner steps after the last round, so the model
is the global one only because ``sync_at_end`` runs one last round. Every rank calls the recipe
in ``on_train_end``; the test checks that global rank 0 gets the full tensors, equal to every
island's own gathered parameters, and that the other ranks keep nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_swarm import SwarmStrategy
from tests.fsdp_utils import DumpShards, ShardedRegressor, load
from tests.helpers import QUIET, regression_data


class SaveGlobalModel(pl.Callback):
    """The docs' recipe, as written there, plus a record of what each rank kept."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        full = get_model_state_dict(
            pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if trainer.is_global_zero:
            torch.save(full, self.out / "global_model.pt")
        torch.save(sorted(full), self.out / f"kept{trainer.global_rank}.pt")


def test_recipe_gathers_the_global_model_on_rank_zero(tmp_path: Path) -> None:
    pl.seed_everything(7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=SwarmStrategy(
            island_size=2, island_parallel="fsdp", sync_every=3, start_method="fork"
        ),
        max_steps=8,
        callbacks=[DumpShards(tmp_path), SaveGlobalModel(tmp_path)],
        **QUIET,
    )
    trainer.fit(ShardedRegressor(), regression_data())

    ranks: list[dict[str, Any]] = load(tmp_path, 4)
    saved = torch.load(tmp_path / "global_model.pt", weights_only=True)
    assert sorted(saved) == sorted(ranks[0]["full"])
    for name, tensor in saved.items():
        assert tensor.device.type == "cpu"
        for rank in ranks:  # both islands hold the same (global) model after sync_at_end
            torch.testing.assert_close(tensor, rank["full"][name], rtol=0, atol=0, msg=name)
    assert ranks[0]["outer_steps"] == 3  # rounds at steps 3 and 6, and the one at the end
    kept = [torch.load(tmp_path / f"kept{r}.pt", weights_only=True) for r in range(4)]
    assert kept[0] == sorted(saved) and kept[1:] == [[], [], []]
