"""Main job under three strategies, side by side in one run.

Runs the Hydra app (the README's main job) at the same number of inner steps with:
  no_sync   the same islands with no cross-island sync at all (the floor)
  swarm     SwarmStrategy, sync_every=H (default 50)
  ddp       Lightning's DDP (gradients averaged across all ranks every step)
and reports the wall time of the whole command, the time spent inside outer syncs (measured by
the strategy), the final validation loss, and the bytes sent across islands per rank (counted
by the transport; for DDP the same ring formula at every step, as the summary reports it).

Usage: .venv/bin/python benchmarks/main_job_strategies.py [--steps 300] [--sync-every 50]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mainjob import run_main_job


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    common = [
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}",
        "trainer.enable_progress_bar=false",
        "logger=none",
    ]
    runs = {
        "no_sync": ["strategy=no_sync"],
        "swarm": ["strategy=swarm", f"strategy.sync_every={args.sync_every}"],
        "ddp": ["strategy=ddp"],
    }
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work:
        for name, overrides in runs.items():
            results[name] = run_main_job([*overrides, *common], Path(work) / name)
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    floor = results["no_sync"]["wall_s"]
    swarm = results["swarm"]
    print(f"steps={args.steps}, sync_every={args.sync_every}, 2 islands of 1 CPU rank\n")
    print(
        "| strategy | wall time (s) | vs no_sync | in outer syncs (s) | final val loss "
        "| bytes sent across islands per rank |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        sent = r.get("bytes_sent_per_rank", swarm["ddp_bytes_per_rank"])
        print(
            f"| {name} | {r['wall_s']:.1f} | {r['wall_s'] / floor:.3f} | "
            f"{r.get('sync_wall_s', 0.0):.3f} | {r['val_loss']:.4f} | {sent:,.0f} |"
        )
    ratio = swarm["ddp_bytes_per_rank"] / swarm["bytes_sent_per_rank"]
    share = 100 * swarm["sync_wall_s"] / swarm["wall_s"]
    print(
        f"\nDDP / swarm bytes: {ratio:.1f}x; outer syncs: {share:.2f}% of the swarm run's wall "
        f"time; swarm wall time {100 * (swarm['wall_s'] / floor - 1):+.1f}% vs no_sync"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
