"""SwarmStrategy from plain Python, without Hydra: two islands of one CPU rank each.

    .venv/bin/python examples/train_regression.py

Any LightningModule works unchanged; only the Trainer's strategy differs from a DDP run.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    pl.seed_everything(0)
    x = torch.randn(4096, 16)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    data = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    strategy = SwarmStrategy(
        sync_every=25,  # H: inner steps between outer syncs
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        island_size=1,  # 2 ranks -> 2 islands
    )
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=200)
    trainer.fit(Regressor(), data)
    if trainer.is_global_zero:
        print(
            f"outer steps: {strategy.totals.outer_steps}, bytes sent per rank: "
            f"{strategy.totals.bytes_sent:,}"
        )


if __name__ == "__main__":
    main()
