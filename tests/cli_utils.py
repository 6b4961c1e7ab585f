"""Running ``swarm-train`` (the Hydra app) as a user does: a subprocess in a folder of its own.

``TINY`` shrinks the main job to a model and data that train a step in well under a second, so
tests that launch 2 ranks through the CLI stay within a few seconds of compute each (a run takes
about 12-25 s on 2 busy cores).

Every child runs in a process group of its own that :func:`run_group` kills when it returns,
however it returns (a timeout, an error, pytest-timeout's interrupt): the ranks a launcher
spawns die with it instead of outliving the test. ``RUN_TIMEOUT_S`` keeps one run's wait under
pytest's 120 s per-test timeout, so that a stuck run fails with its own output; a test that
waits on several runs names a larger ``pytest.mark.timeout`` of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import free_port

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


RUN_TIMEOUT_S = 100.0


def _kill_group(pgid: int) -> None:
    # ProcessLookupError: every process of the group has exited already.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def run_group(
    cmd: list[str],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` whose whole process group (the
    child and whatever it spawned) is killed on the way out, a timeout included."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, with the child's pid as its id
    )
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    finally:
        _kill_group(proc.pid)
        if proc.poll() is None:  # interrupted before communicate reaped it
            proc.kill()
            proc.wait()
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def run_in(
    cwd: Path, cmd: list[str], timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from ``cwd`` with this checkout first on the path, capturing its output."""
    return run_group(cmd, cwd=cwd, env=tree_env(), timeout=timeout)


def swarm_train(
    run_dir: Path, *overrides: str, timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_swarm.cli <overrides> hydra.run.dir=<run_dir>`` from ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_swarm.cli.app", *overrides, f"hydra.run.dir={run_dir}"]
    return run_in(run_dir, cmd, timeout)


def run_rank_processes(
    module: str, args: list[str], world: int, timeout_s: float, *, wait_for: int | None = None
) -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]]]:
    """Run ``python -m <module> <args>`` once per rank, the rank in the environment.

    Lightning then starts no processes of its own, so each rank's exit status and output are its
    own. Waits up to ``timeout_s`` for the first ``wait_for`` ranks (all by default), then kills
    every rank still running. Returns the processes and the ``(stdout, stderr)`` of those waited
    for.
    """
    port = free_port()
    procs = []
    for rank in range(world):
        env = tree_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, "-m", module, *args]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs[:wait_for]]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
            p.communicate()
    return procs, outputs
