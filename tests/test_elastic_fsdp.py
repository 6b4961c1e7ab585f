"""Elastic FSDP islands: ``membership="torchft"`` with ``island_parallel="fsdp"``. Every rank
of an island exchanges its own shard with a torchft Manager of its own, with the rank at its
position in the other islands; a restarted island heals shard by shard. Lightning islands as
processes (tests/elastic_lightning_island.py ``--fsdp``), each of two ranks, with a model whose
two FSDP shards are exactly half of it (``--width 0``: two Linear(8, 8), rows split 4 + 4).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lightning_swarm.transport.allreduce import ring_allreduce_bytes
from tests.elastic_utils import finish, lighthouse, start_island, wait_for
from tests.test_elastic_per_rank import (
    OPTS,
    SHARE_BYTES,
    _alive,
    _assert_equal,
    _by_rank,
    _bytes_per_round,
    checkpoint_kill_and_resume,
)
from tests.test_elastic_strategy import SCRIPT, _kill_all

pytest.importorskip("torchft")

FSDP = [*OPTS, "--fsdp"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "inside",
    [
        "--fsdp",
        pytest.param("--tp", marks=pytest.mark.slow),
        pytest.param("--pp", marks=pytest.mark.slow),
    ],
)
def test_sharded_islands_each_rank_sends_its_shard_and_they_end_equal(
    tmp_path: Path, inside: str
) -> None:
    """Two islands of two ranks, FSDP, tensor parallel or two pipeline stages inside: each
    rank's bytes per round are a ring all-reduce of its own slices (its stage's layer), and
    every island ends with the same full parameters."""
    opts = [*OPTS, inside, "--max-steps", "24", "--step-s", "0.02"]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            for name, proc in procs.items():
                assert finish(proc, 300, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for name in "ab":
        for rank in (0, 1):
            rows = _by_rank(tmp_path, name, rank)
            assert rows[-1]["swarm/outer_steps"] == 6, (name, rank, rows[-1])
            # FSDP: half of every tensor. Tensor parallel: half of each weight and of the first
            # bias, and the whole second bias (replicated: each rank holds and sends it).
            # Pipeline stages: one layer each (half the model).
            share = SHARE_BYTES + 4 * 4 if inside == "--tp" else SHARE_BYTES
            assert set(_bytes_per_round(rows)) == {ring_allreduce_bytes(share, 2)}
    if inside == "--pp":  # each rank holds its stage: the same stage of each island compared
        for rank in (0, 1):
            _assert_equal(tmp_path, [f"a.rank{rank}", f"b.rank{rank}"])
        return
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ab" for r in (0, 1)])


@pytest.mark.slow  # ~1 to 2 minutes on 2 busy cores: six, then eight Lightning processes
@pytest.mark.timeout(900)
def test_a_killed_fsdp_rank_takes_its_island_out_and_the_restarted_island_heals(
    tmp_path: Path,
) -> None:
    """Three FSDP islands of two ranks. Rank 1 of c stalls inside a round's exchange and is
    SIGKILLed there: a and b abandon that round, go on without c, and c's other rank leaves
    too (never half an island in a round). c is then launched again: each of its ranks heals
    its own shard from a live island's rank at its position, and all three islands finish
    with the same full parameters."""
    fast, stall = tmp_path / "fast", tmp_path / "stall"
    opts = [*FSDP, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    faults = ["--stall-file", str(stall), "--stall-rank", "1"]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address:
        try:
            procs = {
                n: start_island(
                    tmp_path, address, n, *opts, *(faults if n == "c" else ()), script=SCRIPT
                )
                for n in "abc"
            }
            started += procs.values()
            wait_for(lambda: len(_by_rank(tmp_path, "c", 1)) >= 3, 240, "c's third round")
            stall.write_text("")
            wait_for((tmp_path / "c.stalled").exists, 60, "c's rank 1 to stall inside a round")
            pids = [int((tmp_path / f"c.pid.rank{r}").read_text()) for r in (0, 1)]
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.time()
            wait_for(lambda: not any(_alive(pid) for pid in pids), 120, "c's ranks to end")
            wait_for(
                lambda: any(
                    r["t"] > killed_at and r["swarm/islands_in_round"] == 2
                    for r in _by_rank(tmp_path, "a", 1)
                ),
                120,
                "a round of a and b without c",
            )
            procs.pop("c").wait()
            stall.unlink()
            rounds_before = len(_by_rank(tmp_path, "c", 1))
            procs["c"] = start_island(tmp_path, address, "c", *opts, script=SCRIPT)
            started.append(procs["c"])
            wait_for(
                lambda: len(_by_rank(tmp_path, "c", 1)) >= rounds_before + 2,
                240,
                "the restarted c's rounds",
            )
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 300, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for rank in (0, 1):
        rejoined = _by_rank(tmp_path, "c", rank)[rounds_before]
        assert rejoined["t"] > killed_at and rejoined["swarm/heal_bytes"] == 2 * SHARE_BYTES
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "abc" for r in (0, 1)])


@pytest.mark.slow  # ~40 s on 2 busy cores
@pytest.mark.timeout(600)
def test_an_fsdp_island_saves_per_rank_and_resumes_into_the_swarm(tmp_path: Path) -> None:
    """c (FSDP, two ranks) checkpoints at step 6: each rank writes its own shards. c is killed,
    resumes from that checkpoint while a goes on, is healed shard by shard, and a and c end
    with the same full parameters."""
    checkpoint_kill_and_resume(tmp_path, FSDP)
    files = sorted(p.name for p in tmp_path.glob("c.ckpt.swarm/*/*.pt"))
    assert files == [
        "anchors-rank-00000.pt",
        "anchors-rank-00001.pt",
        "island-00000-rank-00000.pt",
        "island-00000-rank-00001.pt",
    ], files
    for rank in (0, 1):
        first = _by_rank(tmp_path, "c", rank)[0]
        assert first["swarm/heal_bytes"] == 2 * SHARE_BYTES  # its own shard's anchors and momentum
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ac" for r in (0, 1)])


@pytest.mark.slow  # ~30 s on 2 busy cores
@pytest.mark.timeout(400)
def test_an_fsdp_island_among_ddp_islands_is_refused_on_every_rank(tmp_path: Path) -> None:
    """a and b are DDP islands of two ranks sharing the outer state by name; y is an FSDP
    island of two ranks (each holds half of every tensor): the same share count, another
    layout. y is refused on both ranks, naming it; a and b go on and end equal."""
    fast = tmp_path / "fast"
    opts = [*OPTS, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            wait_for(lambda: len(_by_rank(tmp_path, "a", 1)) >= 2, 120, "a's second round")
            other = start_island(tmp_path, address, "y", *opts, "--fsdp", script=SCRIPT)
            started.append(other)
            assert finish(other, 120, tmp_path, "y") != 0
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 120, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for rank in (0, 1):
        error = (tmp_path / f"y.error.{rank}").read_text()
        assert "island 'y' was refused: it splits the model otherwise than" in error, error
        assert "net.0.weight is (8, 8) float32 (this rank: (4, 8) at " in error, error
        assert "the same island_parallel, number of ranks" in error, error
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ab" for r in (0, 1)])
