"""A module written for pipeline stages, and a fit runner that dumps each rank's stage.

``StagedModel`` holds an input layer, ``NUM_BLOCKS`` blocks in a ``ModuleList`` and a head;
``configure_model`` keeps this rank's stage (``keep_stage``) when the island has stages, and
``training_step`` runs the batch through ``strategy.pipeline_step``, so one module trains
with and without stages; with ``island_parallel="fsdp"`` and several data-parallel ranks per
stage it shards each part with FSDP2. Its data is a function of (step, island) only: an
island's batch is ``SLOTS`` chunks, each data-parallel rank takes its share, so an island
computes the same update under any layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy, keep_stage
from tests.helpers import fit_every_step, full_copy

NUM_BLOCKS = 4
WIDTH = 8


SLOTS = 2  # an island's batch: SLOTS chunks of 4 rows, dealt out over its data-parallel ranks


def batch(step: int, island: int, slot: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * island + slot)
    x = torch.randn(4, 6, generator=g)
    y = x[:, :3].sum(1, keepdim=True) - x[:, 3:].prod(1, keepdim=True)
    return x, y


class StagedModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed: nn.Module | None = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(NUM_BLOCKS)
        )
        self.head: nn.Module | None = nn.Linear(WIDTH, 1)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        keep_stage(self, mesh, blocks="blocks", first=["embed"], last=["head"])
        strategy = self.trainer.strategy
        fsdp = getattr(strategy, "config", None) and strategy.config.island_parallel == "fsdp"
        if fsdp and mesh["data_parallel"].size() > 1:  # FSDP2 inside each stage
            for part in [self.embed, *self.blocks, self.head]:
                if part is not None and any(True for _ in part.parameters()):
                    fully_shard(part, mesh=mesh["data_parallel"])

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def training_step(self, _: Any, batch_idx: int) -> Tensor:
        strategy = self.trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        sampler = strategy.distributed_sampler_kwargs
        dp = sampler["num_replicas"] // strategy.topology.num_islands
        island, position = strategy.topology.island_index, sampler["rank"] % dp
        mine = [
            batch(self.trainer.global_step, island, s) for s in range(SLOTS) if s % dp == position
        ]
        x, y = torch.cat([m[0] for m in mine]), torch.cat([m[1] for m in mine])
        loss = strategy.pipeline_step(x, y, nn.functional.mse_loss)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4096, 1)), batch_size=1)


class DumpStage(pl.Callback):
    """Every rank writes its stage's parameters, anchors, the logged loss and counters."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        outer = strategy.outer_syncs[0]
        info = {
            "island": strategy.topology.island_index,
            "stage": strategy.pipeline_stage,
            "params": {k: full_copy(v) for k, v in pl_module.named_parameters()},
            "anchors": {k: v.clone() for k, v in outer.anchors.items()},
            "anchor_bytes": outer.anchor_bytes,
            "losses": self.losses,
            "bytes_sent": strategy.totals.bytes_sent,
            "summary": strategy.checkpointer.summary,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def fit_staged(
    out: Path,
    *,
    devices: int,
    max_steps: int,
    ckpt_dir: Path | None = None,
    ckpt_path: Path | None = None,
    trainer_kw: dict[str, Any] | None = None,
    **strategy_kw: Any,
) -> None:
    pl.seed_everything(0)
    strategy_kw.setdefault("sync_every", 3)
    strategy = SwarmStrategy(start_method="fork", **strategy_kw)
    fit_every_step(
        StagedModel(),
        strategy,
        devices=devices,
        max_steps=max_steps,
        callbacks=[DumpStage(out)],
        ckpt_dir=ckpt_dir,
        ckpt_path=ckpt_path,
        **(trainer_kw or {}),
    )


def island_params(out: Path, world: int) -> dict[int, dict[str, Tensor]]:
    """Each island's full parameters, joined from its ranks' stages."""
    islands: dict[int, dict[str, Tensor]] = {}
    for rank in range(world):
        dump = torch.load(out / f"rank{rank}.pt", weights_only=False)
        islands.setdefault(dump["island"], {}).update(dump["params"])
    return islands
