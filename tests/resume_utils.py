"""A deterministic model and fit runner for the resume tests (fork launcher, CPU, gloo).

The batch of inner step s on global rank r is drawn from a generator seeded by (s, r), so a run
resumed at step s sees exactly the data an uninterrupted run sees there, whatever Lightning's
dataloader does on a mid-epoch restart. Adam makes the inner optimizer state matter.
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy
from lightning_swarm.resume.files import swarm_root
from lightning_swarm.resume.integrity import file_digest
from lightning_swarm.resume.records import record_checksum

SYNC_EVERY = 3


class StepDataModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        seed = 1000 * self.trainer.global_step + self.trainer.global_rank
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 6, generator=g)
        y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], dim=1)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def train_dataloader(self) -> DataLoader:
        # Only the count matters: training_step draws its own batch from the step.
        return DataLoader(TensorDataset(torch.zeros(4096, 1)), batch_size=1)


class DumpFinal(pl.Callback):
    """Every rank writes its final parameters, anchors, counters and resume summary."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.start_anchors: list[dict[str, Tensor]] = []
        self.start_params: dict[str, Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        self.start_anchors = [
            {k: v.clone() for k, v in o.anchors.items()} for o in strategy.outer_syncs
        ]
        self.start_params = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        info = {
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "anchors": [{k: v.clone() for k, v in o.anchors.items()} for o in strategy.outer_syncs],
            "anchor_dtypes": [str(o.anchor_dtype) for o in strategy.outer_syncs],
            "inner_steps": [o.inner_steps for o in strategy.outer_syncs],
            "outer_steps": [o.outer_steps for o in strategy.outer_syncs],
            "outer_momentum": [
                o.outer_optimizer.param_groups[0].get("momentum") for o in strategy.outer_syncs
            ],
            "optimizer": trainer.optimizers[0].state_dict(),
            "summary": strategy.checkpointer.summary,
            "global_step": trainer.global_step,
            "start_anchors": self.start_anchors,
            "start_params": self.start_params,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(info, self.out_dir / f"rank{trainer.global_rank}.pt")


def fit(
    out: Path,
    *,
    devices: int,
    island_size: int,
    max_steps: int,
    ckpt_dir: Path | None = None,
    ckpt_path: Path | None = None,
    callbacks: list[pl.Callback] | None = None,
    module: pl.LightningModule | None = None,
    **strategy_kw: Any,
) -> None:
    """One ``Trainer.fit`` (of ``module``, a ``StepDataModel`` by default); checkpoints after
    every step into ``ckpt_dir`` when given."""
    pl.seed_everything(0)
    strategy_kw.setdefault("sync_every", SYNC_EVERY)
    strategy_kw.setdefault("start_method", "fork")
    strategy = SwarmStrategy(island_size=island_size, **strategy_kw)
    cbs: list[pl.Callback] = [DumpFinal(out), *(callbacks or [])]
    if ckpt_dir is not None:
        cbs.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=ckpt_dir is not None,
        num_sanity_val_steps=0,
        callbacks=cbs,
    )
    trainer.fit(module if module is not None else StepDataModel(), ckpt_path=ckpt_path)


def fit_here(out: Path, *, max_steps: int, **kw: Any) -> None:
    """One ``fit`` of a single rank in this process (popen launches no child for devices=1),
    so that pytest sees its warnings; the process group is destroyed afterwards."""
    import torch.distributed as dist

    # Lightning leaves LOCAL_RANK, MASTER_PORT, ... in the environment. conftest restores it
    # after each test, but a module-scoped fixture runs before that snapshot: a later
    # `swarm-train` subprocess then took itself for an already launched rank and waited for a
    # peer that never came. Restore it here, whoever calls.
    env = dict(os.environ)
    try:
        fit(out, devices=1, island_size=1, max_steps=max_steps, start_method="popen", **kw)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


def load_ranks(out: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), f"{where}: param {key} differs"
    for oa, ob in zip(a["anchors"], b["anchors"], strict=True):
        for key in oa:
            assert torch.equal(oa[key], ob[key]), f"{where}: anchor {key} differs"
    assert a["inner_steps"] == b["inner_steps"] and a["outer_steps"] == b["outer_steps"], where
    for sa, sb in zip(
        a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True
    ):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (
                f"{where}: inner optimizer {key} differs"
            )


# -- editing saved checkpoints (damage) ---------------------------------------------------------
def swarm_dir(ckpt: Path) -> Path:
    """The save directory a Lightning checkpoint names."""
    record = torch.load(ckpt, weights_only=True)["swarm"]
    return swarm_root(ckpt) / record["save_id"]


def edit_record(
    ckpt: Path, edit: Callable[[dict[str, Any]], None], *, reseal_it: bool = True
) -> None:
    """Rewrite the ``swarm`` record of a Lightning checkpoint in place (and, unless told not
    to, its checksum: as a tool that rewrites records on purpose would)."""
    checkpoint = torch.load(ckpt, weights_only=True)
    edit(checkpoint["swarm"])
    if reseal_it:
        checkpoint["swarm"]["checksum"] = record_checksum(checkpoint["swarm"])
    torch.save(checkpoint, ckpt)


def record_file_again(ckpt: Path, name: str) -> None:
    """After rewriting swarm file ``name`` on purpose, record its new size and checksum."""
    digest = file_digest(swarm_dir(ckpt) / name)

    def edit(record: dict[str, Any]) -> None:
        record["files"][name] = digest.to_dict()

    edit_record(ckpt, edit)


def flip_bit_in_tensor_data(path: Path) -> str:
    """XOR 0x10 into one byte in the middle of the first tensor's data; returns the entry."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", handle.read(4))
        offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x10]))
    return info.filename
