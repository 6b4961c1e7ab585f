"""The three built-in workloads of the quality check (benchmarks/quality_check.py, issue 40).

Each workload is a ``Workload``: a LightningModule class and a LightningDataModule class with
their keyword arguments, the Trainer options the model is trained with, and the metric the
check compares. ``batch_size`` is a keyword of every data module here, so a DDP run can be one
rank with the islands' global batch (see ``quality_check.run_spec``).

- ``demo_gpt``: the main job's byte-level GPT (what ``swarm-train`` trains), 2 layers, width
  128, AdamW 3e-3 with a 50-step warm-up then constant, 16 x 128 bytes per island per step.
- ``litgpt``: litgpt's ``GPT`` (``pythia-14m`` config, 2 layers, width 128, byte vocabulary)
  in a module written as a litgpt user would: AdamW weight decay 0.1, linear warm-up then a
  cosine schedule stepped per step, ``gradient_clip_val=1.0``, ``accumulate_grad_batches=2``,
  ``bf16-mixed``, validation loss through torchmetrics. litgpt is a benchmark-only
  dependency: ``pip install --no-deps litgpt==0.5.13`` (or the ``quality`` extra).
- ``cnn``: a small CNN on generated images: 10 classes, each a fixed random smooth pattern,
  drawn with a random shift, contrast and Gaussian noise; SGD with Nesterov momentum and a
  cosine schedule to zero, cross-entropy.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from lightning_swarm.demo.gpt import GPTLightningModule
from lightning_swarm.demo.text import ByteBlocks, StdlibTextDataModule, read_corpus


@dataclass(frozen=True)
class Workload:
    """A model, its data and how it is trained; ``metric`` is logged at each validation."""

    module: type[pl.LightningModule]
    data: type[pl.LightningDataModule]
    module_args: dict[str, Any] = field(default_factory=dict)
    data_args: dict[str, Any] = field(default_factory=dict)
    trainer_args: dict[str, Any] = field(default_factory=dict)
    metric: str = "val_loss"


class TextData(StdlibTextDataModule):
    """The main job's byte-level data with a validation set that does not depend on
    ``batch_size`` (``val_sequences`` held-out windows, 32 per batch), so a one-rank DDP run
    with the islands' global batch validates on the same bytes as the islands."""

    def __init__(self, val_sequences: int = 256, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_sequences = val_sequences

    def setup(self, stage: str | None = None) -> None:
        root = Path(self.corpus_dir or sysconfig.get_paths()["stdlib"])
        train, val = read_corpus(root, self.max_bytes, self.val_every)
        self.train_set = ByteBlocks(train, self.block_size)
        self.val_set = ByteBlocks(val[: self.val_sequences * self.block_size + 1], self.block_size)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=32, shuffle=False)


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int, final: float) -> float:
    """The multiplier of the base lr at ``step``: linear warm-up, then half a cosine to
    ``final`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LitGPTModule(pl.LightningModule):
    """litgpt's ``GPT`` as a new user would train it (see the module docstring)."""

    def __init__(
        self,
        block_size: int = 128,
        n_layer: int = 2,
        n_embd: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        final_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        self.save_hyperparameters()
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.final_lr_ratio = warmup_steps, final_lr_ratio
        config = Config.from_name(
            "pythia-14m",
            n_layer=n_layer,
            n_embd=n_embd,
            block_size=block_size,
            vocab_size=256,
            padded_vocab_size=256,
        )
        self.model = GPT(config)
        self.val_loss = MeanMetric()

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch))
        self.log("val_loss", self.val_loss)

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        total = int(self.trainer.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: cosine_with_warmup(s, self.warmup_steps, total, self.final_lr_ratio),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def make_images(
    num: int, *, num_classes: int, size: int, noise: float, seed: int
) -> tuple[Tensor, Tensor]:
    """``num`` images (3 x size x size) and labels: each class one smooth random pattern
    (shared by every call with the same ``seed``), shifted, scaled and noised per image."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=gen)
    patterns = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    gen = torch.Generator().manual_seed(seed + num)  # train and val draw different images
    labels = torch.randint(num_classes, (num,), generator=gen)
    images = patterns[labels]
    shifts = torch.randint(-3, 4, (num, 2), generator=gen)
    for i, (dy, dx) in enumerate(shifts.tolist()):
        images[i] = torch.roll(images[i], shifts=(dy, dx), dims=(1, 2))
    contrast = 0.5 + torch.rand(num, 1, 1, 1, generator=gen)
    images = images * contrast + noise * torch.randn(images.shape, generator=gen)
    return images, labels


class ShapesDataModule(pl.LightningDataModule):
    """Generated 10-class images (``make_images``); the same sets on every rank."""

    def __init__(
        self,
        batch_size: int = 8,
        num_train: int = 20_000,
        num_val: int = 2048,
        size: int = 16,
        noise: float = 3.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size, self.num_train, self.num_val = batch_size, num_train, num_val
        self.size, self.noise, self.seed = size, noise, seed

    def setup(self, stage: str | None = None) -> None:
        def images(num: int) -> TensorDataset:
            return TensorDataset(
                *make_images(num, num_classes=10, size=self.size, noise=self.noise, seed=self.seed)
            )

        self.train_set, self.val_set = images(self.num_train), images(self.num_val)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(self.val_set, batch_size=256, shuffle=False)


class SmallCNN(pl.LightningModule):
    """Two conv blocks and a linear head; SGD Nesterov 0.9 with a per-step cosine to zero."""

    def __init__(self, width: int = 16, lr: float = 0.02, weight_decay: float = 5e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.weight_decay = lr, weight_decay
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * width, 10),
        )
        self.val_loss = MeanMetric()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_loss.update(F.cross_entropy(self.net(x), y), weight=len(y))
        self.log("val_loss", self.val_loss)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=self.lr,
            momentum=0.9,
            nesterov=True,
            weight_decay=self.weight_decay,
        )
        total = int(self.trainer.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: cosine_with_warmup(s, 0, total, 0.0)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


WORKLOADS: dict[str, Workload] = {
    "demo_gpt": Workload(
        GPTLightningModule,
        TextData,
        module_args={"block_size": 64, "n_layer": 2, "n_embd": 128, "lr": 3e-3},
        data_args={"block_size": 64, "batch_size": 8},
    ),
    "litgpt": Workload(
        LitGPTModule,
        TextData,
        module_args={"block_size": 64},
        data_args={"block_size": 64, "batch_size": 4},
        trainer_args={
            "precision": "bf16-mixed",
            "gradient_clip_val": 1.0,
            "accumulate_grad_batches": 2,
        },
    ),
    "cnn": Workload(SmallCNN, ShapesDataModule, data_args={"batch_size": 8}),
}
