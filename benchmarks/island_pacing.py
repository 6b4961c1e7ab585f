"""Does a slow island pace a fast one between rounds? Each island's median inner step.

Two islands of one rank each (Lightning's fork launcher, gloo, a small regression model) train
``--steps`` inner steps with no round inside the run (``sync_every`` above ``--steps``). Island 0
is made slow by sleeping ``--slow-s`` in every training step. A step is timed from one batch's
end to the next's, so it includes what Lightning does before the batch (its per-batch SIGTERM
check). Also reported: each island's median time inside ``torch.distributed.broadcast`` with no
group, the call Lightning makes at every batch.

If nothing crosses islands between rounds, the fast island's median step stays its own; if a
per-step world message remains, it equals the slow island's.

Usage:
    .venv/bin/python benchmarks/island_pacing.py [--steps 30] [--slow-s 0.2] [--checkout DIR]
``--checkout`` runs another checkout of the library (e.g. a git worktree of an older commit),
side by side with the same script. Results are printed as JSON; docs/launch.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _fit(steps: int, slow_s: float, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_swarm import SwarmStrategy

    broadcast = dist.broadcast
    waits: list[float] = []

    def timed_broadcast(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return broadcast(*args, **kwargs)
        finally:
            if kwargs.get("group") is None and (len(args) < 3 or args[2] is None):
                waits.append(time.perf_counter() - start)

    dist.broadcast = timed_broadcast  # inherited by the forked ranks

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_rank == 0:
                time.sleep(slow_s)  # the slow island
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last: float | None = None

        def on_train_batch_end(self, *_: Any) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

        def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
            result = {"steps": self.times, "broadcast_waits": waits}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))

    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SwarmStrategy(sync_every=steps + 1000, start_method="fork"),
        max_steps=steps,
        callbacks=[StepTimes()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8))


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-s", type=float, default=0.2)
    parser.add_argument("--checkout", type=Path, default=ROOT)
    args = parser.parse_args()
    sys.path.insert(0, str(args.checkout))
    os.environ["PYTHONPATH"] = str(args.checkout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        _fit(args.steps, args.slow_s, Path(tmp))
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    import lightning_swarm

    result = {
        "library": str(Path(lightning_swarm.__file__).parent),
        "steps": args.steps,
        "slow_s": args.slow_s,
        "slow_island_median_step_s": _median(ranks[0]["steps"][1:-1]),
        "fast_island_median_step_s": _median(ranks[1]["steps"][1:-1]),
        "fast_island_median_world_broadcast_s": _median(ranks[1]["broadcast_waits"]),
        "fast_island_world_broadcasts": len(ranks[1]["broadcast_waits"]),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
