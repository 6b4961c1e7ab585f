"""Run the README's main job (the Hydra app) as a subprocess and read its summary.

Shared by the benchmark scripts so that every figure comes from the same entry point a user
runs. The app writes ``summary.json`` (global rank 0) into its run directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_main_job(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Run ``python -m lightning_swarm.cli <overrides>`` with its outputs in ``run_dir``.

    Returns the app's summary plus ``wall_s`` (the whole command, launch included) and
    ``run_dir``. Raises RuntimeError with the end of stderr if the run fails.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_swarm.cli.app", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"main job {overrides} failed:\n{done.stderr[-4000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    summary["wall_s"] = wall
    summary["run_dir"] = str(run_dir)
    return summary
