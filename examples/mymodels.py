"""The model and data of ``docs/your_model.md``'s CLI recipe: your own classes under
``swarm-train``, built by Hydra from ``myconf/model/regressor.yaml`` and
``myconf/data/random.yaml``. The page gives the command (run from ``examples/``), and
``tests/test_docs.py`` runs it as written.

Nothing here knows about lightning_swarm: the YAML's keys are the constructors' arguments.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    """A two-layer MLP fitting ``sin(x.sum())`` on 16 inputs; ``width`` is its hidden size."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 1)
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        # sync_dist: the mean over every rank of every island, so each rank logs one figure.
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class RandomData(pl.LightningDataModule):
    """Random inputs and their targets, drawn once from a fixed seed, so that every rank holds
    the same data and Lightning's ``DistributedSampler`` gives each island its own batches."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size

    def _split(self, size: int, seed: int) -> TensorDataset:
        x = torch.randn(size, 16, generator=torch.Generator().manual_seed(seed))
        return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(self._split(4096, seed=0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(self._split(512, seed=1), batch_size=self.batch_size)
