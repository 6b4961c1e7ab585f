"""``timeout_s``: a rank that stops makes every other rank exit within it, saying why.

Issue 22, item 5. Each rank is its own process (the environment says which rank), so each
rank's exit status and message are its own; the stopped rank is killed by the test afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import subprocess
import sys

import pytest

from lightning_swarm import SwarmStrategy
from tests.cli_utils import ROOT, tree_env
from tests.dist_utils import free_port
from tests.stopped_rank import WORLD


def test_a_stopped_rank_ends_every_other_rank_with_a_timeout_message() -> None:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = tree_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, "-m", "tests.stopped_rank", "3", "3"]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        # Without timeout_s reaching the groups these waits would last torch's 30 minutes:
        # the bound here is the test's own, far above timeout_s (not a timing assertion).
        outputs = [p.communicate(timeout=90) for p in procs[: WORLD - 1]]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
            p.communicate()
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=False)):
        assert proc.returncode != 0, f"rank {rank} exited 0:\n{err[-3000:]}"
        assert "CollectiveTimeoutError" in err, err[-3000:]
        assert f"rank {rank}: a collective waited timeout_s=3 s" in err, err[-3000:]


def test_timeout_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"timeout_s=0 must be a finite number of seconds"):
        SwarmStrategy(timeout_s=0)


def test_timeout_s_reaches_the_process_group_options() -> None:
    strategy = SwarmStrategy(timeout_s=12.5)
    assert strategy._timeout == datetime.timedelta(seconds=12.5)
    assert strategy.config.timeout_s == 12.5


def test_ddp_timeout_keyword_still_works_and_conflicts_are_refused() -> None:
    strategy = SwarmStrategy(timeout=datetime.timedelta(seconds=7))
    assert strategy.config.timeout_s == 7
    with pytest.raises(ValueError, match="disagree; give timeout_s only"):
        SwarmStrategy(timeout_s=5, timeout=datetime.timedelta(seconds=7))
