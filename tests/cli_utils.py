"""Running ``swarm-train`` (the Hydra app) as a user does: a subprocess in a folder of its own.

``TINY`` shrinks the main job to a model and data that train a step in well under a second, so
tests that launch 2 ranks through the CLI stay within a few seconds of compute each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "trainer.enable_progress_bar=false",
    "trainer.limit_val_batches=1",
    "data.max_bytes=100000",
    "data.block_size=32",
    "data.batch_size=8",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
]


def tree_env(**extra: str) -> dict[str, str]:
    """The environment with this checkout first on the path (child ranks inherit it)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def run_in(cwd: Path, cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from ``cwd`` with this checkout first on the path, capturing its output."""
    return subprocess.run(
        cmd, cwd=cwd, env=tree_env(), capture_output=True, text=True, timeout=timeout
    )


def swarm_train(
    run_dir: Path, *overrides: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_swarm.cli <overrides> hydra.run.dir=<run_dir>`` from ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_swarm.cli", *overrides, f"hydra.run.dir={run_dir}"]
    return run_in(run_dir, cmd, timeout)
