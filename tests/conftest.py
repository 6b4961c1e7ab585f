"""Test fixtures: every test leaves no process group, environment change or stray thread."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

# One intra-op thread, and say so in the environment too: Lightning otherwise raises the thread
# count of an in-process fit, and a fork launched after that inherits a live OpenMP pool, which
# deadlocks the child (GNU OpenMP is not fork-safe). Tests fork ranks, so keep the pool unborn.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


# What Lightning's launchers write into the environment of the process that runs a fit. A fit
# in a module-scoped fixture runs before the per-test snapshot below, so these are also dropped
# after every test unless the session started with them: a `swarm-train` child that inherits
# LOCAL_RANK takes itself for an already launched rank and waits for peers that never come.
_LAUNCH_VARS = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GLOBAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_SESSION_ENV = dict(os.environ)


@pytest.fixture(autouse=True)
def _clean_process_state() -> Iterator[None]:
    env_before = dict(os.environ)
    threads_before = set(threading.enumerate())
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a torch.distributed process group initialised")
    os.environ.clear()
    os.environ.update(env_before)
    for name in _LAUNCH_VARS:
        if name not in _SESSION_ENV:
            os.environ.pop(name, None)
    leftover = [
        t
        for t in threading.enumerate()
        if t not in threads_before and t.is_alive() and not t.daemon
    ]
    for t in leftover:
        t.join(timeout=5)
    still = [t.name for t in leftover if t.is_alive()]
    assert not still, f"test left non-daemon threads running: {still}"
