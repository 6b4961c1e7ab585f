"""Helpers for elastic-island tests: a lighthouse in the test process, islands as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def lighthouse(
    min_islands: int = 2, heartbeat_timeout_ms: int = 1500, join_timeout_ms: int = 1000
) -> Iterator[str]:
    """A torchft lighthouse on a free port; yields its address."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=min_islands,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    try:
        yield server.address()
    finally:
        server.shutdown()


def start_island(
    out: Path, address: str, island: str, *extra: str, script: str = "tests/elastic_island.py"
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with (out / f"{island}.stderr").open("ab") as stderr:
        return subprocess.Popen(
            [
                sys.executable,
                script,
                "--lighthouse",
                address,
                "--island",
                island,
                "--out",
                str(out),
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def rounds(out: Path, island: str) -> list[dict[str, Any]]:
    path = out / f"{island}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def finish(proc: subprocess.Popen[bytes], timeout_s: float, out: Path, island: str) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        tail = (out / f"{island}.stderr").read_text()[-3000:]
        raise AssertionError(f"island {island} did not finish in {timeout_s} s:\n{tail}") from None


def anchors_by_round(out: Path, island: str) -> dict[int, str]:
    """Outer step -> anchor digest after each applied round of ``island``."""
    return {r["outer_steps"]: r["anchors"] for r in rounds(out, island) if r["applied"]}


def start_lighthouse(
    port: int, log: Path, min_islands: int = 2, heartbeat_timeout_ms: int = 1500
) -> subprocess.Popen[str]:
    """``swarm-lighthouse`` as its own process on ``port`` (so a test can SIGKILL and restart
    it); returns once it listens. Its log goes to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("a") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lightning_swarm.membership.lighthouse",
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--min-islands",
                str(min_islands),
                "--join-timeout-ms",
                "1000",
                "--heartbeat-timeout-ms",
                str(heartbeat_timeout_ms),
                "--quorum-tick-ms",
                "50",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "lighthouse at ..." once it listens; "" if it died
    if not line.startswith("lighthouse at"):
        proc.kill()
        proc.wait()
        raise AssertionError(f"the lighthouse did not start on port {port}: {log.read_text()}")
    return proc


def logged(out: Path, island: str, text: str) -> bool:
    """Whether ``text`` appears in the island's stderr (torchft's own log lines go there)."""
    path = out / f"{island}.stderr"
    return path.exists() and text in path.read_text(errors="replace")


@contextmanager
def reaped(procs: list[subprocess.Popen[Any]]) -> Iterator[None]:
    """Kill every island the test started and has not seen exit, however the test ends (a
    failed assertion, a timeout), so that no island outlives it."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def finish_all(procs: dict[str, subprocess.Popen[bytes]], out: Path, timeout_s: float) -> None:
    """Every island exits 0 within one shared ``timeout_s`` (they stop together)."""
    deadline = time.monotonic() + timeout_s
    for name, proc in procs.items():
        left = max(1.0, deadline - time.monotonic())
        assert finish(proc, left, out, name) == 0, (out / f"{name}.stderr").read_text()[-3000:]
