"""A module whose islands train alike under any layout, a fit runner, and a plain-torch DiLoCo.

``MovableModel``'s data is a function of (step, island, slot) only: an island's batch is
``SLOTS`` chunks of 8 rows, and each data-parallel rank of the island takes the chunks
``slot % dp == position``. The island's gradient is the mean over all its chunks whatever its
data-parallel size (1, 2 or 4 ranks), so one island computes the same update, up to float
rounding, as DDP island of one rank, FSDP over two or four, or tensor parallel over two.
``simulate`` is DiLoCo written out in plain torch for this model (islands as model copies),
the reference a resharded run is held to.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy
from tests.helpers import fit_every_step, full_copy

SLOTS = 4
SYNC_EVERY = 3
LR = 0.02


def batch(step: int, island: int, slot: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * island + slot)
    x = torch.randn(8, 6, generator=g)
    y = x[:, :3].sum(1, keepdim=True) - x[:, 3:].prod(1, keepdim=True)
    return x, y


def make_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


class MovableModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:  # DDP islands
            return
        if mesh["tensor_parallel"].size() > 1:
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            parallelize_module(self.net, mesh["tensor_parallel"], plan)
        if mesh["data_parallel"].size() > 1:
            dp = mesh["data_parallel"]
            fully_shard(self.net[0], mesh=dp)
            fully_shard(self.net[2], mesh=dp)
            fully_shard(self.net, mesh=dp)

    def training_step(self, _: Any, batch_idx: int) -> Tensor:
        strategy = self.trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        island = strategy.topology.island_index
        sampler = strategy.distributed_sampler_kwargs
        dp = sampler["num_replicas"] // strategy.topology.num_islands
        position = sampler["rank"] % dp
        rows = [batch(self.trainer.global_step, island, s) for s in range(SLOTS)]
        mine = [rows[s] for s in range(SLOTS) if s % dp == position]
        x, y = torch.cat([r[0] for r in mine]), torch.cat([r[1] for r in mine])
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4096, 1)), batch_size=1)


class DumpFull(pl.Callback):
    """Every rank writes its island's full parameters and its anchors at the end of fit."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before the resume: its warnings are raised in this (launched) process.
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resume at max_steps trains no step, and Lightning skips on_train_end then.
        if not (self.out / f"rank{trainer.global_rank}.pt").exists():
            self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        outer = strategy.outer_syncs[0]
        info = {
            "island": strategy.topology.island_index,
            "params": {k: full_copy(v) for k, v in pl_module.named_parameters()},
            "anchors": {k: v.clone() for k, v in outer.anchors.items()},
            "momentum": {
                name: outer.outer_optimizer.state[a]["momentum_buffer"].clone()
                for name, a in outer.anchors.items()
                if "momentum_buffer" in outer.outer_optimizer.state.get(a, {})
            },
            "layout": dict(outer.layout),
            "outer_steps": outer.outer_steps,
            "summary": strategy.checkpointer.summary,
            "warnings": [str(w.message) for w in self._caught],
        }
        self._catcher.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def fit_movable(
    out: Path,
    *,
    devices: int,
    max_steps: int,
    ckpt_dir: Path | None = None,
    ckpt_path: Path | None = None,
    **strategy_kw: Any,
) -> None:
    """One fit of ``MovableModel`` on ``devices`` CPU ranks (fork, gloo); every step saved to
    ``ckpt_dir`` when given."""
    pl.seed_everything(0)
    strategy_kw.setdefault("sync_every", SYNC_EVERY)
    # A constant outer momentum, as ``simulate`` steps (the default ramps it over the run).
    strategy_kw.setdefault("outer_momentum_warmup", 0.0)
    strategy_kw.setdefault("outer_momentum_cooldown", 0.0)
    strategy = SwarmStrategy(start_method="fork", **strategy_kw)
    fit_every_step(
        MovableModel(),
        strategy,
        devices=devices,
        max_steps=max_steps,
        callbacks=[DumpFull(out)],
        ckpt_dir=ckpt_dir,
        ckpt_path=ckpt_path,
    )


def load_dumps(out: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def simulate(
    islands_at: dict[int, int], max_steps: int
) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """Plain-torch DiLoCo of ``MovableModel`` (Adam inner, the strategy's outer optimizer with
    its momentum held constant, as ``fit_movable`` runs it: SGD lr 0.7, Nesterov momentum 0.9,
    a round every ``SYNC_EVERY`` steps). ``islands_at``:
    from which step how many islands train (a new island starts from the anchors with island
    0's Adam state). Returns every island's final parameters and the anchors."""
    nets = [make_net()]
    anchors = [p.detach().clone() for p in nets[0].parameters()]
    outer = torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)
    inner = [torch.optim.Adam(nets[0].parameters(), lr=LR)]
    for step in range(max_steps):
        count = islands_at.get(step, len(nets))
        while len(nets) < count:
            net = make_net()
            with torch.no_grad():
                for p, a in zip(net.parameters(), anchors, strict=True):
                    p.copy_(a)
            optimizer = torch.optim.Adam(net.parameters(), lr=LR)
            optimizer.load_state_dict(copy.deepcopy(inner[0].state_dict()))
            nets.append(net)
            inner.append(optimizer)
        del nets[count:], inner[count:]
        for island, (net, optimizer) in enumerate(zip(nets, inner, strict=True)):
            chunks = [batch(step, island, s) for s in range(SLOTS)]
            x, y = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
        if (step + 1) % SYNC_EVERY == 0:
            with torch.no_grad():
                for i, anchor in enumerate(anchors):
                    locals_ = [list(net.parameters())[i] for net in nets]
                    anchor.grad = torch.stack([anchor - p for p in locals_]).mean(0)
                outer.step()
                for net in nets:
                    for p, a in zip(net.parameters(), anchors, strict=True):
                        p.copy_(a)
    names = [f"net.{n}" for n, _ in nets[0].named_parameters()]
    params = [{f"net.{n}": p.detach().clone() for n, p in net.named_parameters()} for net in nets]
    return params, dict(zip(names, anchors, strict=True))
