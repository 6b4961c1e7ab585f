"""A swarm round that dies mid-collection: the survivor raises at once and leaves no files.
Both aggregators: the rotating one (island 0 collects round 0) and the sharded one (island 0
collects its shard while it sends the other), the latter both spooling its shard (``median``)
and summing it as it arrives (``mean``, no spool: the fault lands in the sum instead).

The ranks here are plain processes this test starts and kills itself (fork, a TCP store, no
Lightning launcher and no ``torch.multiprocessing`` watcher that would kill the survivor for us),
as with torchrun or ranks on several nodes. ``cleanup_timeout_s`` stays large (60 s): before the
fix the aggregator sat in spool cleanup for that long, waiting for the leases of the round's
writers that nobody aborted. The bound asserted below is generous (not a timing test): it only
separates "raised at once" from "waited for the cleanup deadline".
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Mapping
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_swarm.transport.aggregator.exchange import PartFold
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from tests.dist_utils import free_port
from tests.transport_rounds import average

CLEANUP_TIMEOUT_S = 60.0
RAISE_BOUND_S = 30.0  # well under CLEANUP_TIMEOUT_S: the old behaviour cannot pass it
WAIT_S = 60.0  # bound on every wait of the test itself


def _tensors() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(256, 1024)}  # 1 MiB: 256 chunks of 4 KiB


def _rank(
    rank: int, port: int, spool_dir: str, out: str, collecting: Event, fault: str, kind: str
) -> None:
    """One island; rank 0 aggregates round 0 (its shard, with a sharded ``kind``) and reports
    what it raised into ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    writes = {"n": 0}

    def collect_slowly() -> None:
        # The aggregator is mid-collection: tell the test, then go slowly enough that the
        # fault lands before the payload is complete.
        writes["n"] += 1
        if writes["n"] == 3:
            collecting.set()
            if fault == "interrupt":
                raise KeyboardInterrupt
        if writes["n"] >= 3:
            time.sleep(0.05)

    def slow_write(fd: int, data: memoryview, offset: int) -> int:
        collect_slowly()
        return os.pwrite(fd, data, offset)

    # Only rank 0's writes are slowed and faulted: with the sharded transport rank 1 spools
    # too, and the fault must land on the island the test watches.
    spool = Spool(
        spool_dir,
        cleanup_timeout_s=CLEANUP_TIMEOUT_S,
        write_at=slow_write if rank == 0 else os.pwrite,
    )
    if kind == "sharded_mean" and rank == 0:  # a forked child: the patch dies with it
        import lightning_swarm.transport.aggregator.swarm_round as round_module

        class SlowFold(PartFold):
            def add(self, k: int, chunks: Mapping[int, torch.Tensor]) -> None:
                collect_slowly()
                super().add(k, chunks)

        round_module.PartFold = SlowFold  # type: ignore[misc]
    options: dict[str, Any] = {"spool": spool, "chunk_bytes": 4096}
    if kind == "rotating":
        transport = SwarmAggregator(None, num_islands=2, island_index=rank, **options)
    else:
        aggregation = "mean" if kind == "sharded_mean" else "median"
        transport = SwarmAggregator(
            None,
            owners="sharded",
            num_islands=2,
            island_index=rank,
            aggregation=aggregation,
            **options,
        )
    start = time.monotonic()
    outcome = ["no error"]

    def exchange() -> None:
        try:
            average(transport, _tensors(), round_index=0)
        except BaseException as err:  # the test reports whatever was raised
            outcome[0] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"

    if fault == "kill_background":  # as with sync_delay > 0: the round runs in a thread
        worker = threading.Thread(target=exchange, name="swarm-sync")
        worker.start()
        worker.join()
    else:
        exchange()
    elapsed = time.monotonic() - start
    files = [p.name for p in spool.files()]
    Path(out, f"rank{rank}.txt").write_text(f"{elapsed}\n{files}\n{outcome[0]}")
    spool.close()
    os._exit(0)  # the peer is gone: skip destroy_process_group, which could wait on it


def _start(spool_dir: Path, out: Path, fault: str, kind: str) -> tuple[list[Any], Event]:
    context = multiprocessing.get_context("fork")
    collecting = context.Event()
    port = free_port()
    procs = [
        context.Process(
            target=_rank, args=(rank, port, str(spool_dir), str(out), collecting, fault, kind)
        )
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    return procs, collecting


def _finish(procs: list[Any]) -> None:
    for p in procs:
        p.join(WAIT_S)
        if p.is_alive():
            p.kill()
            p.join()


def _report(out: Path) -> tuple[float, str, str]:
    path = out / "rank0.txt"
    assert path.exists(), "the aggregator did not finish within the test's bound: it hung"
    elapsed, files, outcome = path.read_text().split("\n", 2)
    return float(elapsed), files, outcome


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["rotating", "sharded", "sharded_mean"])
@pytest.mark.parametrize("fault", ["kill", "kill_background"])
def test_a_peer_killed_mid_collection_fails_the_aggregator_at_once(
    tmp_path: Path, fault: str, kind: str
) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "out"
    out.mkdir()
    procs, collecting = _start(spool_dir, out, fault=fault, kind=kind)
    try:
        assert collecting.wait(WAIT_S), "the aggregator never started collecting"
        os.kill(procs[1].pid, signal.SIGKILL)
    finally:
        _finish(procs)
    elapsed, files, outcome = _report(out)
    # Named as the all-reduce names it (tests/test_peer_lost.py): the island and its rank.
    gone = "PeerLostError: rank 0, island 0, round 0: island 1 (global rank 1) went away"
    assert outcome.startswith(gone), outcome
    assert "Restart the fit from the last checkpoint (ckpt_path=last)" in outcome, outcome
    assert elapsed < RAISE_BOUND_S, f"the aggregator raised only after {elapsed:.1f}s"
    assert files == "[]", f"the failed round left spool files: {files}"
    # The aggregator closed its spool; the killed peer could not: its root is left behind, and
    # the next spool started in that directory sweeps it (its pid is dead, this user owns it).
    left = [p.name for p in spool_dir.iterdir()]
    assert left and all(n.startswith(f"lightning_swarm-{procs[1].pid}") for n in left), left
    Spool(spool_dir).close()
    assert list(spool_dir.iterdir()) == [], "a dead run's spool root was not swept"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["rotating", "sharded", "sharded_mean"])
def test_an_interrupt_mid_collection_removes_the_rounds_files_and_is_reraised(
    tmp_path: Path, kind: str
) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "out"
    out.mkdir()
    procs, collecting = _start(spool_dir, out, fault="interrupt", kind=kind)
    try:
        assert collecting.wait(WAIT_S), "the aggregator never started collecting"
        procs[0].join(WAIT_S)
        # The aggregator is gone; its peer now fails in its send and exits too.
    finally:
        _finish(procs)
    elapsed, files, outcome = _report(out)
    assert outcome.startswith("KeyboardInterrupt"), outcome
    assert elapsed < RAISE_BOUND_S, f"the aggregator raised only after {elapsed:.1f}s"
    assert files == "[]", f"the interrupted round left spool files: {files}"
    # The peer is not left waiting either: the aggregator's exit closed its connection.
    peer = (out / "rank1.txt").read_text().split("\n", 2)
    assert float(peer[0]) < RAISE_BOUND_S and peer[2] != "no error", peer
