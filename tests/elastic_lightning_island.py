"""One elastic island as a Lightning fit, run as its own process by test_elastic_strategy.py.

A tiny regression model trains with ``SwarmStrategy(membership="torchft")`` on one CPU rank
(or ``--devices 2``: an island of two ranks). The first rank writes the final parameters and the
logged ``swarm/*`` metrics, as they happen, to ``<out>/<island>.rank<r>.safetensors`` and
``<out>/<island>.jsonl``; errors go to ``<out>/<island>.error.<rank>``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy


class Regression(pl.LightningModule):
    def __init__(self, width: int, step_s: float, fast_file: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 1))
        self.step_s = step_s
        self.fast_file = Path(fast_file) if fast_file else None

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        # Paced so that a restarted island can come up while the others still run.
        fast = self.fast_file is not None and self.fast_file.exists()
        time.sleep(0.002 if fast else self.step_s)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Recorder(Logger):
    """Appends every logged metric with its step to a JSON-lines file (rounds log straight here)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({**metrics, "step": float(step or 0), "t": time.time()}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--island", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--fast-file", default=None, help="steps are fast once it exists")
    args = parser.parse_args()
    out = Path(args.out)
    seed = sum(args.island.encode())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True) * (1 + seed % 3))
    recorder = Recorder(out / f"{args.island}.jsonl")
    model = Regression(args.width, args.step_s, args.fast_file)
    strategy = SwarmStrategy(
        sync_every=args.every,
        membership="torchft",
        lighthouse=args.lighthouse,
        island_id=args.island,
        min_islands=2,
        quorum_timeout_s=20.0,
        round_timeout_s=5.0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=recorder,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True, generator=gen))
    except Exception as err:
        (out / f"{args.island}.error.{trainer.global_rank}").write_text(
            f"{type(err).__name__}: {err}"
        )
        raise
    rank = trainer.global_rank
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / f"{args.island}.rank{rank}.safetensors"))
    os._exit(0)  # the demo's DataLoader workers and torchft threads need no orderly exit


if __name__ == "__main__":
    main()
