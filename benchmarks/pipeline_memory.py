"""Per-rank memory and bytes of pipeline-stage islands against islands of the whole model, at
>= 100M parameters on CPU.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/pipeline_memory.py [--params 100e6] [--layers 24]

Model: ``--layers`` blocks of ``Linear(width, width)`` + ReLU in a ``ModuleList`` (width rounded
up to a multiple of 64 so that ``layers * width**2 >= --params``), float32, Adam as the inner
optimizer, the default outer optimizer (Nesterov momentum: one buffer per anchor). Two fits, 2
islands each, ``sync_every=1``, 3 steps (3 rounds), gloo, ``start_method="fork"``:

- ``pp=1``: 2 islands of one rank, the whole model per rank;
- ``pp=2``: 2 islands of 2 stages (``keep_stage``, ``pipeline_parallel_size=2``, 1F1B with 2
  micro-batches of a batch of 4).

With stages the module is built under ``trainer.init_module(empty_init=True)`` (on the meta
device), so a rank materialises its own stage's parameters only. Each rank reports, at the end
of fit: its anchor bytes and outer-state bytes (``OuterLoop``'s own counts), its parameters, the
bytes it sent per round, and its peak RSS (``VmHWM``), which includes the process's imports and
Python heap (about the same in both).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy, keep_stage
from lightning_swarm.memory.procfs import ProcReader

MiB = 2**20
STEPS = 3


class Stack(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.width = width
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)
        )

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            keep_stage(self, self.device_mesh, blocks="blocks")

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        g = torch.Generator().manual_seed(100 * self.global_step)
        x = torch.randn(4, self.width, generator=g)
        strategy = self.trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        return strategy.pipeline_step(x, torch.zeros(4, self.width), nn.functional.mse_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)


class Report(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy) and strategy.outer_loop is not None
        status = ProcReader().status()
        assert status is not None, "needs /proc/self/status"
        info = {
            "rank": trainer.global_rank,
            "stage": strategy.pipeline_stage,
            "params": sum(p.numel() for p in pl_module.parameters()),
            "anchor_bytes": strategy.outer_loop.anchor_bytes(),
            "outer_state_bytes": strategy.outer_loop.outer_state_bytes(),
            "bytes_per_round": strategy.totals.bytes_sent / max(1, strategy.totals.outer_steps),
            "peak_rss": status["VmHWM"],
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))


def fit(out: Path, width: int, layers: int, pp: int) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    options: dict[str, Any] = {"sync_every": 1, "start_method": "fork"}
    if pp > 1:
        options |= {"island_size": pp, "pipeline_parallel_size": pp, "pipeline_microbatches": 2}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 * pp,
        strategy=SwarmStrategy(**options),
        max_steps=STEPS,
        callbacks=[Report(out)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    # With stages, built on the meta device (as a model too big for one node must be): each
    # rank then materialises its own stage's parameters only, after configure_model. (Without,
    # empty_init would leave DDP's weights uninitialised.)
    with trainer.init_module(empty_init=pp > 1):
        model = Stack(width, layers)
    trainer.fit(model)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2 * pp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    width = 64 * math.ceil(math.sqrt(args.params / args.layers) / 64)
    print(f"model: {args.layers} x Linear({width}, {width})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp in (1, 2):
            for info in fit(Path(tmp) / f"pp{pp}", width, args.layers, pp):
                print(json.dumps({"pp": pp, **info}), flush=True)
                if info["rank"] < pp:  # island 0's ranks
                    stage = "whole" if info["stage"] is None else f"stage {info['stage']}"
                    rows.append(
                        f"| {pp} | {info['rank']} ({stage}) | {info['params'] / 1e6:.1f} "
                        f"| {info['anchor_bytes'] / MiB:,.0f} "
                        f"| {info['outer_state_bytes'] / MiB:,.0f} "
                        f"| {info['bytes_per_round'] / MiB:,.1f} "
                        f"| {info['peak_rss'] / MiB:,.0f} |"
                    )
    print(
        "\n| pp | rank | parameters (M) | anchors (MiB) | outer state (MiB) "
        "| sent per round (MiB) | peak RSS (MiB) |\n|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
