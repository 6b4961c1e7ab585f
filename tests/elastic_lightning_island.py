"""One elastic island as a Lightning fit, run as its own process by test_elastic_strategy.py.

A tiny regression model trains with ``SwarmStrategy(membership="torchft")`` on one CPU rank
(or ``--devices 2``: an island of two ranks). The first rank writes the final parameters and the
logged ``swarm/*`` metrics, as they happen, to ``<out>/<island>.rank<r>.safetensors`` and
``<out>/<island>.jsonl`` (each round's row also holds the rank and a digest of its anchors);
errors go to ``<out>/<island>.error.<rank>``. Every rank writes its parameters and anchors just
before its first round (``<island>.prejoin.rank<r>.safetensors``, after any resume) and right
after it (``<island>.join.rank<r>.safetensors``), so a test can check healing and the catch-up.

Fault injection for the tests (test-only monkeypatches, nothing in the library):
``--stall-file F``: once F exists, the island's next round stalls after its quorum formed (the
others wait on it in the round's all-reduce) and writes ``<island>.stalled``; the test kills it
there (``--stall-rank R``: only rank R stalls, and writes ``<island>.stalled``; every rank
writes its process id to ``<island>.pid.rank<r>`` when training starts).
``--fault PHASE:ROUND:ACTION`` (``tests/elastic_faults.py``) with ``--fault-rank R``: rank R's
membership kills or stops its own process as that phase of that round starts.
``--stall-in-heal``: the island stalls while being healed, after the healing peer's
header arrived and before its tensors do, and writes ``<island>.stalled``.

Under ``--budget-s`` the first rank also appends each round's weighing to
``<out>/<island>.weights.jsonl``: the header rows it weighed (island_id hash, healing, work,
inner steps), its own hash and the scale it got (a wrapper around ``round_header.weighed``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy, keep_stage
from lightning_swarm.membership import torchft_manager, torchft_quorum
from lightning_swarm.membership.round_header import HeaderRow
from lightning_swarm.membership.torchft_quorum import TorchftMembership
from lightning_swarm.transport.base import Opening
from tests.elastic_faults import fault_hook


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def snapshot(strategy: SwarmStrategy, path: Path) -> None:
    """This rank's parameters and anchors (first optimizer) as a safetensors file."""
    outer = strategy.outer_syncs[0]
    tensors = {f"param.{k}": v.detach().clone() for k, v in outer.params.items()}
    tensors.update({f"anchor.{k}": v.detach().clone() for k, v in outer.anchors.items()})
    save_file(tensors, str(path))


def stall(marker: Path) -> None:
    marker.write_text("")
    time.sleep(3600)


def inject_faults(args: argparse.Namespace, out: Path) -> None:
    marker = out / f"{args.island}.stalled"
    if args.stall_file:
        allreduce = TorchftMembership._allreduce

        def stalling_allreduce(self: TorchftMembership, tensors: list[torch.Tensor]) -> None:
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            if Path(args.stall_file).exists() and args.stall_rank in (None, rank):
                stall(marker)
            allreduce(self, tensors)

        TorchftMembership._allreduce = stalling_allreduce  # type: ignore[method-assign]
    if args.stall_in_heal:
        buffers = torchft_manager.receive_buffers

        def stalling_buffers(header: bytes) -> Any:
            stall(marker)
            return buffers(header)

        torchft_manager.receive_buffers = stalling_buffers  # type: ignore[assignment]


def record_weights(path: Path) -> None:
    """Wrap the membership's ``weighed`` to append what each round weighed to ``path``."""
    weigh = torchft_quorum.weighed

    def recording(rows: list[HeaderRow], mine: HeaderRow, opening: Opening) -> Opening:
        result = weigh(rows, mine, opening)
        line = {
            "t": time.time(),
            "mine": mine.island,
            "scale": result.scale,
            "rows": [[r.island, r.healing, r.work, r.inner_steps] for r in rows],
        }
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return result

    torchft_quorum.weighed = recording


class Snapshots(pl.Callback):
    """Writes the resumed state just before the island's first round (strategy hook after)."""

    def __init__(self, out: Path, island: str) -> None:
        self.out, self.island = out, island

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        rank = trainer.global_rank
        snapshot(strategy, self.out / f"{self.island}.prejoin.rank{rank}.safetensors")
        (self.out / f"{self.island}.pid.rank{rank}").write_text(str(os.getpid()))


class Faults(pl.Callback):
    """Installs ``tests/elastic_faults.py``'s hook on one rank's membership (built at setup)."""

    def __init__(self, faults: list[str], rank: int, out: Path, island: str) -> None:
        self.faults, self.rank, self.out, self.island = faults, rank, out, island

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy) and strategy._elastic is not None
        membership = strategy._elastic.membership
        if trainer.global_rank == self.rank and membership is not None:
            membership.on_phase = fault_hook(self.faults, self.out, self.island)


class CheckpointAt(pl.Callback):
    """Saves one checkpoint of the island at a given inner step (with its swarm state)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(str(self.path))


def mean_output_loss(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output.mean(dim=1, keepdim=True), y)


class Regression(pl.LightningModule):
    """``width`` hidden units and one output; ``width=0``: two 8 x 8 layers whose outputs are
    averaged (equal tensors, so that two shares of the outer state hold exactly half each)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def __init__(self, width: int, step_s: float, fast_file: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width or 8), torch.nn.Linear(width or 8, 1 if width else 8)
        )
        self.step_s = step_s
        self.fast_file = Path(fast_file) if fast_file else None

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        # Paced so that a restarted island can come up while the others still run.
        fast = self.fast_file is not None and self.fast_file.exists()
        time.sleep(0.002 if fast else self.step_s)
        x, y = batch
        strategy = self.trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        return strategy.pipeline_step(x, y, mean_output_loss)

    def configure_model(self) -> None:
        # FSDP islands (--fsdp): each layer sharded over the island's data-parallel ranks;
        # tensor-parallel islands (--tp): the first layer split by rows, the second by columns.
        if self.device_mesh is None:
            return
        if "pipeline_parallel" in (self.device_mesh.mesh_dim_names or ()):  # --pp
            keep_stage(self, self.device_mesh, blocks="net")
            return
        if self.device_mesh["tensor_parallel"].size() > 1:
            plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
            parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
            return
        dp = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=dp)
        fully_shard(self.net, mesh=dp)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StopAt(pl.Callback):
    """Ends the fit after the round the file ``path`` names, once it exists (every island that
    takes that round stops on the same anchors)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        named = self.path.read_text().strip() if self.path.exists() else ""
        if named and strategy.outer_syncs[0].outer_steps >= int(named):
            trainer.should_stop = True


class FullState(pl.Callback):
    """The module's full state at the end of fit: an FSDP island's shards gathered over its
    ranks (collective), while the island mesh still exists."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().contiguous()
            for k, v in pl_module.state_dict().items()
        }


class Recorder(Logger):
    """Appends every logged metric with its step to a JSON-lines file (rounds log straight here)."""

    def __init__(self, path: Path, strategy: SwarmStrategy, join_file: str) -> None:
        super().__init__()
        self.path, self.strategy, self.join_file = path, strategy, join_file
        self.rounds = 0

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {**metrics, "step": float(step or 0), "t": time.time()}
        if "swarm/islands_in_round" in metrics:
            rank = self.strategy.global_rank
            row.update(rank=rank, anchors=digest(self.strategy.outer_syncs[0].anchors))
            if self.rounds == 0:  # the island's first round: its join (healed if behind)
                snapshot(self.strategy, Path(self.join_file.format(rank=rank)))
            self.rounds += 1
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


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
    parser.add_argument("--stall-file", default=None, help="see the module docstring")
    parser.add_argument("--stall-rank", type=int, default=None, help="see the module docstring")
    parser.add_argument("--fault", action="append", default=[], help="see the module docstring")
    parser.add_argument("--fault-rank", type=int, default=0, help="see the module docstring")
    parser.add_argument("--stall-in-heal", action="store_true", help="see the module docstring")
    parser.add_argument(
        "--no-shard-outer", action="store_true", help="rank 0 exchanges, the island fans out"
    )
    parser.add_argument("--checkpoint-at", type=int, default=0, help="save <island>.ckpt there")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from (ckpt_path)")
    parser.add_argument("--merge-alpha", type=float, default=0.0)
    parser.add_argument("--quorum-timeout", type=float, default=20.0)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--fragments", type=int, default=1, help="num_fragments")
    parser.add_argument("--delay", type=int, default=0, help="sync_delay")
    parser.add_argument("--quantize", default="none", help="int8 / int4, with error feedback")
    parser.add_argument("--budget-s", type=float, default=None, help="sync_every_s")
    parser.add_argument("--fsdp", action="store_true", help="island_parallel='fsdp'")
    parser.add_argument("--tp", action="store_true", help="tensor parallel over the island")
    parser.add_argument("--pp", action="store_true", help="a pipeline stage per rank")
    parser.add_argument("--stop-file", default=None, help="stop after the round it names")
    args = parser.parse_args()
    out = Path(args.out)
    seed = sum(args.island.encode())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True) * (1 + seed % 3))
    inject_faults(args, out)
    if args.budget_s is not None:
        record_weights(out / f"{args.island}.weights.jsonl")
    model = Regression(args.width, args.step_s, args.fast_file)
    strategy = SwarmStrategy(
        sync_every=args.every,
        sync_every_s=args.budget_s,
        membership="torchft",
        lighthouse=args.lighthouse,
        island_id=args.island,
        min_islands=2,
        quorum_timeout_s=args.quorum_timeout,
        round_timeout_s=5.0,
        merge_alpha=args.merge_alpha,
        num_fragments=args.fragments,
        sync_delay=args.delay,
        quantize=args.quantize,
        error_feedback=args.quantize != "none",
        shard_outer=not args.no_shard_outer,
        island_parallel="fsdp" if args.fsdp or args.tp else "ddp",
        # An island of tensor-parallel ranks or stages names its size (its mesh needs it).
        island_size=args.devices if args.tp or args.pp else 1,
        tensor_parallel_size=args.devices if args.tp else 1,
        pipeline_parallel_size=args.devices if args.pp else 1,
        pipeline_microbatches=2 if args.pp else None,
        outer_optimizer=functools.partial(
            torch.optim.SGD, lr=args.outer_lr, momentum=0.9, nesterov=True
        ),
    )
    join_file = str(out / f"{args.island}.join.rank{{rank}}.safetensors")
    recorder = Recorder(out / f"{args.island}.jsonl", strategy, join_file)
    full = FullState()
    callbacks: list[pl.Callback] = [Snapshots(out, args.island), full]
    if args.fault:
        callbacks.append(Faults(args.fault, args.fault_rank, out, args.island))
    if args.stop_file:
        callbacks.append(StopAt(Path(args.stop_file)))
    if args.checkpoint_at:
        callbacks.append(CheckpointAt(args.checkpoint_at, out / f"{args.island}.ckpt"))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=recorder,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    try:
        loader = DataLoader(data, batch_size=16, shuffle=True, generator=gen)
        trainer.fit(model, loader, ckpt_path=args.resume)
    except Exception as err:
        (out / f"{args.island}.error.{trainer.global_rank}").write_text(
            f"{type(err).__name__}: {err}"
        )
        raise
    rank = trainer.global_rank
    state = full.state or {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / f"{args.island}.rank{rank}.safetensors"))
    os._exit(0)  # the demo's DataLoader workers and torchft threads need no orderly exit


if __name__ == "__main__":
    main()
