"""Small models, data and recorders shared by the Lightning-level tests.

Everything is defined at module level so the fork and spawn launchers can use it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

QUIET: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
}


def full_copy(value: Tensor) -> Tensor:
    """A detached copy of the whole tensor: a DTensor gathered over its mesh (collective)."""
    from torch.distributed.tensor import DTensor

    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def fit_every_step(
    module: pl.LightningModule,
    strategy: pl.strategies.Strategy,
    *,
    devices: int,
    max_steps: int,
    callbacks: list[pl.Callback],
    ckpt_dir: Path | None = None,
    ckpt_path: Path | None = None,
    **trainer_kw: Any,
) -> None:
    """One quiet CPU fit of ``module``; with ``ckpt_dir``, a checkpoint after every step
    (named ``step=N.ckpt``); ``ckpt_path`` resumes."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if ckpt_dir is not None:
        every = ModelCheckpoint(
            dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1
        )
        callbacks = [*callbacks, every]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **{**QUIET, "enable_checkpointing": ckpt_dir is not None},
        **trainer_kw,
    )
    trainer.fit(module, ckpt_path=ckpt_path)


def regression_data(num: int = 256, dim: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num, dim, generator=g)
    y = x @ torch.linspace(-1, 1, dim).unsqueeze(1) + 0.1 * torch.randn(num, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class TinyRegressor(pl.LightningModule):
    """Two linear layers trained with plain SGD (deterministic on CPU)."""

    def __init__(self, lr: float = 0.05, dim: int = 8) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ScheduledRegressor(TinyRegressor):
    """TinyRegressor with a step-wise LR schedule (halves the LR every 4 steps)."""

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class ThawingRegressor(TinyRegressor):
    """The first layer's weight starts frozen and is unfrozen before the third step."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)  # frozen when the strategy sets up

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            self.net[0].weight.requires_grad_(True)


class GrowingRegressor(TinyRegressor):
    """Adds a parameter group to its optimizer mid-run (what BackboneFinetuning does)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Parameter(torch.zeros(3))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            self.trainer.optimizers[0].add_param_group({"params": [self.extra]})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=self.lr)


class TwoOptimizerModule(pl.LightningModule):
    """Manual optimization with two optimizers, each owning one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()  # type: ignore[misc]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        # The second optimizer steps every other batch: its counter must advance half as fast.
        if batch_idx % 2 == 1:
            opt_b.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.a.parameters(), lr=0.05),
            torch.optim.SGD(self.b.parameters(), lr=0.05),
        ]


def flat_params(module: torch.nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class Recorder(pl.Callback):
    """Saves, on every rank, the parameters and anchors after each inner step to a file."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        strategy = trainer.strategy
        anchors = [
            torch.cat([a.reshape(-1).float() for a in o.anchors.values()])
            for o in getattr(strategy, "outer_syncs", [])
        ]
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "params": flat_params(pl_module),
                "anchors": anchors,
                # By name: a sharded outer loop holds only this rank's share of the anchors.
                "named_params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                "named_anchors": {
                    n: a.clone()
                    for o in getattr(strategy, "outer_syncs", [])
                    for n, a in o.anchors.items()
                },
            }
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        info: dict[str, Any] = {"steps": self.steps, "final": flat_params(pl_module)}
        info["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        if hasattr(strategy, "outer_syncs"):
            info["inner_steps"] = [o.inner_steps for o in strategy.outer_syncs]
            info["outer_steps"] = [o.outer_steps for o in strategy.outer_syncs]
            info["totals"] = vars(strategy.totals).copy()
            info["island"] = strategy.topology.island_index
        path = Path(self.out_dir) / f"rank{trainer.global_rank}.pt"
        torch.save(info, path)


def load_ranks(out_dir: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def set_cpu_threads() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
