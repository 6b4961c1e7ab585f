"""A module with uneven and empty FSDP2 shards, and a fit runner for DDP and FSDP islands.

``ShardedRegressor.configure_model`` shards each linear layer and then the stack over the
island's ``data_parallel`` mesh when the strategy gives one (``island_parallel="fsdp"``) and
does nothing under DDP islands, so the same module runs both ways. Over two data-parallel ranks
``Linear(8, 5)`` splits its 5 rows 3 + 2 (uneven) and ``Linear(5, 1)`` its single row 1 + 0
(an empty shard on the second rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy
from tests.helpers import QUIET, regression_data


class ShardedRegressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        )

    def configure_model(self) -> None:
        if self.device_mesh is None:  # DDP islands: nothing to shard
            return
        dp = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=dp)
        fully_shard(self.net[2], mesh=dp)
        fully_shard(self.net, mesh=dp)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)


class DumpShards(pl.Callback):
    """Every rank writes, at the end of fit, its full parameters (gathered inside the island),
    its local shards, anchors and byte totals, and the bytes of each round it sent."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rounds: list[int] = []
        self._sent = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        if strategy.totals.bytes_sent != self._sent:
            self.rounds.append(strategy.totals.bytes_sent - self._sent)
            self._sent = strategy.totals.bytes_sent

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        full, local = {}, {}
        for name, p in pl_module.named_parameters():
            if isinstance(p, DTensor):
                full[name], local[name] = p.full_tensor(), p.to_local()
            else:
                full[name], local[name] = p, p
            full[name], local[name] = full[name].detach().clone(), local[name].detach().clone()
        outer = strategy.outer_syncs[0]
        info = {
            "full": full,
            "local": local,
            "anchors": {n: a.clone() for n, a in outer.anchors.items()},
            "anchor_bytes": strategy.outer_loop.anchor_bytes() if strategy.outer_loop else -1,
            "outer_state_bytes": strategy.outer_loop.outer_state_bytes()
            if strategy.outer_loop
            else -1,
            "rounds": self.rounds,
            "outer_steps": outer.outer_steps,
            "residuals": {n: r.clone() for n, r in outer.residuals.items()},
        }
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def fit_islands(
    out: Path,
    *,
    steps: int,
    devices: int = 4,
    trainer_kw: dict[str, Any] | None = None,
    **strategy_kw: Any,
) -> None:
    """One fit of ``ShardedRegressor`` (fork launcher, CPU, gloo), each rank dumping its state."""
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(7)
    strategy_kw.setdefault("start_method", "fork")
    strategy = SwarmStrategy(**strategy_kw)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[DumpShards(out)],
        **QUIET,
        **(trainer_kw or {}),
    )
    trainer.fit(ShardedRegressor(), regression_data())


def load(out: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


# -- resume ------------------------------------------------------------------------------------
class ShardedStepModel(pl.LightningModule):
    """``resume_utils.StepDataModel``'s step-seeded data with uneven (5 rows) and empty (1 row)
    shards over two ranks, trained with Adam so the inner optimizer state matters."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        )

    def configure_model(self) -> None:
        assert self.device_mesh is not None, "run under island_parallel='fsdp'"
        dp = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=dp)
        fully_shard(self.net[2], mesh=dp)
        fully_shard(self.net, mesh=dp)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        g = torch.Generator().manual_seed(1000 * self.trainer.global_step + self.global_rank)
        x = torch.randn(16, 6, generator=g)
        y = x[:, :3].sum(1, keepdim=True) - x[:, 3:].prod(1, keepdim=True)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4096, 1)), batch_size=1)


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class DumpLocal(pl.Callback):
    """Every rank writes its local module shards, anchors, inner optimizer state and counters."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.start: dict[str, Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = {k: _local(v).detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        optimizer = trainer.optimizers[0].state_dict()["state"]
        info = {
            "params": {k: _local(v).detach().clone() for k, v in pl_module.state_dict().items()},
            "anchors": [{k: v.clone() for k, v in o.anchors.items()} for o in strategy.outer_syncs],
            "inner_steps": [o.inner_steps for o in strategy.outer_syncs],
            "outer_steps": [o.outer_steps for o in strategy.outer_syncs],
            "optimizer": {
                i: {k: _local(v).clone() for k, v in s.items()} for i, s in optimizer.items()
            },
            "summary": strategy.checkpointer.summary,
            "start": self.start,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


class TensorParallelStepModel(ShardedStepModel):
    """``ShardedStepModel``'s data over the island's ``tensor_parallel`` mesh (even splits)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
        )

    def configure_model(self) -> None:
        assert self.device_mesh is not None, "run under island_parallel='fsdp'"
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)


def fit_sharded(
    out: Path,
    *,
    max_steps: int,
    ckpt_dir: Path | None = None,
    ckpt_path: Path | None = None,
    model: type[pl.LightningModule] = ShardedStepModel,
    **strategy_kw: Any,
) -> None:
    """2 islands x 2 FSDP ranks of ``model``; a checkpoint after every step into ``ckpt_dir``."""
    pl.seed_everything(0)
    strategy_kw.setdefault("sync_every", 3)
    strategy = SwarmStrategy(
        island_size=2, island_parallel="fsdp", start_method="fork", **strategy_kw
    )
    callbacks: list[pl.Callback] = [DumpLocal(out)]
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=ckpt_dir is not None,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(model(), ckpt_path=ckpt_path)


# -- the demo GPT and refusals at setup -----------------------------------------------------------
def token_data(num: int = 64, block_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (num, block_size + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def fit_module(
    module: pl.LightningModule, data: DataLoader, out: Path, *, devices: int, **strategy_kw: Any
) -> None:
    """Fit any module under ``SwarmStrategy`` (fork launcher), each rank dumping its state."""
    out.mkdir(parents=True, exist_ok=True)
    strategy_kw.setdefault("start_method", "fork")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=SwarmStrategy(**strategy_kw),
        max_steps=4,
        callbacks=[DumpShards(out)],
        **QUIET,
    )
    trainer.fit(module, data)


class NoConfigureModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ForgetsToShard(NoConfigureModel):
    def configure_model(self) -> None:
        pass  # written for DDP: under FSDP islands nothing would average its gradients


class TensorParallelRegressor(ShardedRegressor):
    """A regressor split over the island's ``tensor_parallel`` mesh: the first layer column-wise
    (6 output rows, 3 per rank), the second row-wise (its bias replicated). Even splits: a
    column-wise output enters the row-wise layer as a local tensor, which torch re-wraps
    assuming even shards. Under DDP islands ``configure_model`` does nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
        )

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)


def fit_tensor_parallel(out: Path, *, devices: int, **strategy_kw: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=SwarmStrategy(start_method="fork", **strategy_kw),
        max_steps=9,
        callbacks=[DumpShards(out)],
        **QUIET,
    )
    trainer.fit(TensorParallelRegressor(), regression_data())


class UnevenTensorParallelModel(TensorParallelStepModel):
    """``Linear(6, 5)`` split column-wise over two ranks: 5 output rows do not divide by 2."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        )
