"""Does a slow island pace a fast one between rounds? The fast island's inner-step times.

Two islands of one rank each run the README's main job over loopback (torchrun, one "node" per
island), with no round inside the measured steps (``sync_every`` above ``max_steps``; the
end-of-fit round is left out of the figures). The slow island (``--slow-island``, 0 by default:
global rank 0, the rank Lightning's per-batch broadcast is sent from) runs once at full speed
and once inside a cgroup (v1 ``cpu``) capped at ``--quota`` of one core. The figure is the
other (fast) island's median inner step in each case, and their ratio: 1.0 means the slow
island does not reach the fast one at all between rounds.

Needs root (the cgroup) and ``torchrun``; the cgroup is removed at the end, even on failure.

Usage:
    sudo .venv/bin/python benchmarks/slow_island.py [--steps 60] [--quota 0.4] [--slow-island 0]
        [--checkout DIR]   # run another checkout of the library, e.g. a git worktree of main

Results are printed as JSON; docs/launch.md quotes them with this command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[1]
CGROUP = Path("/sys/fs/cgroup/cpu/lightning_swarm_slow_island")


class StepTimes(pl.Callback):
    """Writes this rank's wall time per training batch to ``<out>/steps_rank<r>.json``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_: Any) -> None:
        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(self.out) / f"steps_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.times))


@contextlib.contextmanager
def cpu_cgroup(quota: float) -> Iterator[Path]:
    """A cgroup v1 ``cpu`` group limited to ``quota`` of one core; removed on exit."""
    if os.geteuid() != 0 or not CGROUP.parent.is_dir():
        raise SystemExit(
            f"needs root and cgroup v1's cpu controller at {CGROUP.parent}: run it as root on "
            "a host that mounts it (docs/launch.md)."
        )
    CGROUP.mkdir(exist_ok=True)
    try:
        (CGROUP / "cpu.cfs_period_us").write_text("100000")
        (CGROUP / "cpu.cfs_quota_us").write_text(str(int(quota * 100000)))
        yield CGROUP
    finally:
        with contextlib.suppress(OSError):
            CGROUP.rmdir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(
    checkout: Path, steps: int, slow: Path | None, slow_island: int, out: Path
) -> list[list[float]]:
    """Both islands' per-step times; island ``slow_island`` inside cgroup ``slow`` if given."""
    out.mkdir(parents=True)
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{checkout}:{ROOT / 'benchmarks'}",
        "OMP_NUM_THREADS": "1",
    }
    overrides = [
        "trainer.num_nodes=2",
        "trainer.devices=1",
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=null",
        "trainer.limit_val_batches=0",
        f"strategy.sync_every={steps + 1000}",
        "callbacks=none",
        "logger=none",
        "+callbacks.step_times._target_=slow_island.StepTimes",
        f"+callbacks.step_times.out={out}",
    ]
    procs = []
    for node in range(2):
        run_dir = out / f"island{node}"
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "lightning_swarm.cli.app",
            *overrides,
            f"hydra.run.dir={run_dir}",
        ]
        if node == slow_island and slow is not None:
            # Enter the cgroup first, then become the launcher: every rank it starts is capped.
            script = f'echo $$ > {slow / "cgroup.procs"} && exec "$@"'
            launch = ["sh", "-c", script, "sh", *launch]
        log = (out / f"island{node}.log").open("w")
        procs.append(subprocess.Popen(launch, env=env, stdout=log, stderr=subprocess.STDOUT))
    for node, proc in enumerate(procs):
        if proc.wait(timeout=900) != 0:
            tail = (out / f"island{node}.log").read_text()[-3000:]
            raise RuntimeError(f"island {node} failed:\n{tail}")
    return [json.loads((out / f"steps_rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quota", type=float, default=0.4, help="slow island's share of a core")
    parser.add_argument("--slow-island", type=int, choices=(0, 1), default=0)
    parser.add_argument("--checkout", type=Path, default=ROOT)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slow_island_"))
    try:
        slow = args.slow_island
        even = run_pair(args.checkout, args.steps, None, slow, work / "even")
        with cpu_cgroup(args.quota) as group:
            uneven = run_pair(args.checkout, args.steps, group, slow, work / "uneven")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The first steps warm up and the last one holds the end-of-fit round: leave them out.
    fast = 1 - slow
    fast_even = statistics.median(even[fast][5:-1])
    fast_uneven = statistics.median(uneven[fast][5:-1])
    result = {
        "checkout": str(args.checkout),
        "steps": args.steps,
        "slow_quota": args.quota,
        "slow_island": slow,
        "fast_island_median_step_s_beside_even": round(fast_even, 4),
        "fast_island_median_step_s_beside_slow": round(fast_uneven, 4),
        "slow_island_median_step_s": round(statistics.median(uneven[slow][5:-1]), 4),
        "ratio": round(fast_uneven / fast_even, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
