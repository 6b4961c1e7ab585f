"""How much the order of the data alone moves a DDP run's final loss (issue 40, docs/tuning.md).

The quality check scores a swarm by the share of the gap it closes between islands that never
sync and DDP. When DDP reads its data in another order than the islands, that order's own luck
enters the share. This script measures it: DDP as one rank with the islands' global batch, the
same initialisation (``--seed``), once per ``--orders`` seed of its training sampler, and prints
each run's final validation loss.

``--same-batches`` checks the premise of ``quality_check.py --ddp one_rank`` instead: one rank
with the global batch and DDP over ``--islands`` gloo ranks with ``batch_size`` each, both fed
the same samples in the same order (no shuffling: rank r reads samples r, r + k, ...), print
their training losses; DDP's mean over ranks equals the one rank's loss step for step.

Usage:
    python benchmarks/quality_data_order.py --workload demo_gpt --orders 1 2 3 4
    python benchmarks/quality_data_order.py --workload demo_gpt --same-batches --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, RandomSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


class _Losses(pl.Callback):
    """Training loss of every step (this rank's), and the final validation loss."""

    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.train.append(float(args[1]["loss"]))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.val = float(trainer.callback_metrics["val_loss"])


def _fit(spec: dict[str, Any]) -> None:
    """One fit as ``spec`` says; rank 0 writes its losses to ``spec["out"]``."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy
    from quality_check import quiet_trainer
    from quality_workloads import WORKLOADS

    work = WORKLOADS[spec["workload"]]
    k, mode = int(spec["islands"]), spec["mode"]
    per_rank = int(work.data_args["batch_size"])
    batch = per_rank * k if mode == "one_rank" else per_rank
    order = spec.get("order")

    class Data(work.data):  # type: ignore[misc, name-defined]
        def train_dataloader(self) -> DataLoader[Any]:
            data = self.train_set
            if order is not None:  # one rank, the order's own shuffle
                generator = torch.Generator().manual_seed(int(order))
                return DataLoader(data, batch, sampler=RandomSampler(data, generator=generator))
            # The same samples in both modes: rank r of k reads r, r + k, ...; one rank reads
            # them all in turn, so its batch i is the union of the ranks' batches i.
            rank = dist.get_rank() if dist.is_initialized() else 0
            size = dist.get_world_size() if dist.is_initialized() else 1
            return DataLoader(data, batch, sampler=list(range(rank, len(data), size)))

    pl.seed_everything(int(spec["seed"]), workers=True)
    module = work.module(**work.module_args)
    data = Data(**{**work.data_args, "batch_size": batch})
    losses = _Losses()
    strategy = (
        "auto"
        if mode == "one_rank"
        else DDPStrategy(process_group_backend="gloo", start_method="popen")
    )
    steps = int(spec["steps"])
    devices = 1 if mode == "one_rank" else k
    trainer = quiet_trainer(
        work, devices, strategy, steps, steps, [losses], use_distributed_sampler=False
    )
    trainer.fit(module, data)
    if mode == "ranks":  # every rank's training losses, to average over ranks
        gathered: list[Any] = [None] * k
        dist.all_gather_object(gathered, losses.train)
        train = [sum(step) / k for step in zip(*gathered, strict=True)]
    else:
        train = losses.train
    if trainer.global_rank == 0:
        Path(spec["out"]).write_text(json.dumps({"train": train, "val": losses.val}))


def _run(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{spec['mode']}-{spec.get('order')}"
    spec = {**spec, "out": str(work / f"{tag}.out.json")}
    (work / f"{tag}.spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "_fit", str(work / f"{tag}.spec.json")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(Path(spec["out"]).read_text()))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_fit"]:
        _fit(json.loads(Path(argv[1]).read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=["demo_gpt", "litgpt", "cnn"], default="demo_gpt")
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1, help="initialisation")
    parser.add_argument("--orders", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--same-batches", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("/tmp/quality_data_order"))
    args = parser.parse_args(argv)
    base = {"workload": args.workload, "islands": args.islands, "steps": args.steps}
    base["seed"] = args.seed
    if args.same_batches:
        one = _run({**base, "mode": "one_rank"}, args.work)
        ranks = _run({**base, "mode": "ranks"}, args.work)
        worst = max(abs(a - b) for a, b in zip(one["train"], ranks["train"], strict=True))
        print(f"training loss, one rank: {[round(x, 4) for x in one['train'][::5]]}")
        print(
            f"training loss, mean of {args.islands} DDP ranks: "
            f"{[round(x, 4) for x in ranks['train'][::5]]}"
        )
        print(f"largest difference over {args.steps} steps: {worst:.2e}")
        return
    finals = []
    for order in args.orders:
        result = _run({**base, "mode": "one_rank", "order": order}, args.work)
        finals.append(result["val"])
        print(f"order {order}: final val loss {result['val']:.4f}")
    print(
        f"{args.workload}, {args.islands} islands' batch, {args.steps} steps, init seed "
        f"{args.seed}: {min(finals):.4f} to {max(finals):.4f} over {len(finals)} orders"
    )


if __name__ == "__main__":
    main()
