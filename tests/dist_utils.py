"""Run a function on N local ranks over a real gloo process group (torch.multiprocessing)."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float | None,
) -> None:
    torch.set_num_threads(1)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float | None = None
) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` forked processes; re-raises their errors.

    Fork is safe here because the test session pins one intra-op thread (conftest), so no
    OpenMP pool is inherited. ``fn`` must be a module-level function; results travel back
    through files in ``args``. ``timeout_s`` bounds every collective and point-to-point wait
    (the process group's timeout; torch's default is 30 minutes): a test of a path that used to
    hang sets it short, so a regression fails in seconds instead of hanging.
    """
    mp.start_processes(
        _entry,
        args=(world, free_port(), fn, args, timeout_s),
        nprocs=world,
        join=True,
        start_method="fork",
    )
