"""Main job under three strategies, side by side in one run.

Runs the Hydra app (the README's main job) with:
  swarm     SwarmStrategy, sync_every=H (default 50)
  no_sync   the same islands without any cross-island sync (the floor)
  ddp       Lightning's DDP (gradients averaged across all ranks every step)
and reports wall time of fit, the time spent in outer syncs, final validation loss and the bytes
sent across islands per rank (SwarmStrategy counts them; for DDP the same ring formula at every
step, which is what ``SwarmStrategy.ddp_equivalent_bytes`` reports).

Usage: .venv/bin/python benchmarks/main_job_strategies.py [--steps 300] [--sync-every 50]
Writes a Markdown table to stdout (and JSON to --json if given).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUMMARY_KEYS = {
    "final validation loss": "val_loss",
    "outer steps": "outer_steps",
    "bytes sent across islands (per rank)": "bytes_sent",
    "bytes DDP would have sent (per rank)": "ddp_bytes",
    "time in outer syncs (s)": "sync_s",
}


def run_job(strategy: str, steps: int, sync_every: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "lightning_swarm.cli",
            f"strategy={strategy}",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps}",
            "trainer.enable_progress_bar=false",
            "logger=none",
            f"hydra.run.dir={out}",
        ]
        if strategy == "swarm":
            cmd.append(f"strategy.sync_every={sync_every}")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{strategy} run failed:\n{done.stderr[-4000:]}")
    result: dict[str, float] = {"wall_s": wall}
    for line in done.stdout.splitlines():
        for label, key in SUMMARY_KEYS.items():
            m = re.match(rf"\s+{re.escape(label)}\s+([\d,.]+)$", line)
            if m:
                result[key] = float(m.group(1).replace(",", ""))
    val = re.findall(r"val_loss=([\d.]+)", done.stderr + done.stdout)
    if "val_loss" not in result and val:
        result["val_loss"] = float(val[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for strategy in ("no_sync", "swarm", "ddp"):
        results[strategy] = run_job(strategy, args.steps, args.sync_every)
        print(f"{strategy}: {results[strategy]}", file=sys.stderr, flush=True)
    floor = results["no_sync"]["wall_s"]
    swarm = results["swarm"]
    ddp_bytes = swarm.get("ddp_bytes", float("nan"))
    print(
        "| strategy | wall time (s) | vs no_sync | outer-sync time (s) | final val loss | "
        "bytes sent across islands per rank |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        sent = r.get("bytes_sent", ddp_bytes if name == "ddp" else 0.0)
        print(
            f"| {name} | {r['wall_s']:.1f} | {r['wall_s'] / floor:.3f} | "
            f"{r.get('sync_s', 0.0):.2f} | {r.get('val_loss', float('nan')):.4f} | {sent:,.0f} |"
        )
    if swarm.get("bytes_sent"):
        print(
            f"\nDDP / swarm bytes: {ddp_bytes / swarm['bytes_sent']:.1f}x; "
            f"outer syncs took {100 * swarm.get('sync_s', 0) / swarm['wall_s']:.2f}% of the "
            f"swarm run's wall time"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
