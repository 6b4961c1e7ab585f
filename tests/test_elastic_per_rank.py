"""Elastic islands of several ranks that share the outer state (``shard_outer``): every rank
exchanges its own share with a torchft Manager of its own (docs/elastic.md, "Islands of
several ranks"). Lightning islands as processes (tests/elastic_lightning_island.py), each of two
ranks, with a model whose two shares are exactly half of it (``--width 0``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_swarm.transport.allreduce import ring_allreduce_bytes
from tests.dist_utils import free_port
from tests.elastic_utils import (
    finish,
    lighthouse,
    logged,
    start_island,
    start_lighthouse,
    wait_for,
)
from tests.test_elastic_strategy import SCRIPT, _kill_all, _rounds

pytest.importorskip("torchft")

# Two Linear(8, 8) layers in float32: 2 x (64 + 8) x 4 bytes; each share holds one of each.
PAYLOAD_BYTES = 2 * (64 + 8) * 4
SHARE_BYTES = PAYLOAD_BYTES // 2
OPTS = ["--devices", "2", "--width", "0", "--every", "4"]


def _by_rank(out: Path, island: str, rank: int) -> list[dict[str, Any]]:
    return [r for r in _rounds(out, island) if r["rank"] == rank]


def _bytes_per_round(rows: list[dict[str, Any]]) -> list[float]:
    """What each round added to ``swarm/bytes_sent`` (the join round logs no bytes)."""
    sent = [r["swarm/bytes_sent"] for r in rows if "swarm/bytes_sent" in r]
    return [b - a for a, b in zip([0.0, *sent], sent, strict=False)]


def _assert_equal(out: Path, names: list[str]) -> None:
    states = {name: load_file(str(out / f"{name}.safetensors")) for name in names}
    reference = states.pop(names[0])
    for name, state in states.items():
        for key, value in reference.items():
            assert value.equal(state[key]), f"{name}: {key} differs from {names[0]}'s"


@pytest.mark.timeout(400)
def test_two_rank_islands_each_rank_sends_half_and_they_end_equal(tmp_path: Path) -> None:
    """Two islands of two ranks: every rank's cross-island bytes per round are those of its
    half of the payload (a ring all-reduce over two islands moves its own size), never the
    whole payload (rank 0 exchanging for the island did), and all four ranks end equal."""
    opts = [*OPTS, "--max-steps", "24", "--step-s", "0.02"]
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
            per_round = _bytes_per_round(rows)
            assert per_round and set(per_round) == {ring_allreduce_bytes(SHARE_BYTES, 2)}, (
                name,
                rank,
                per_round,
            )
            assert ring_allreduce_bytes(SHARE_BYTES, 2) == PAYLOAD_BYTES / 2
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ab" for r in (0, 1)])


@pytest.mark.timeout(600)  # ~35 s on 2 busy cores: six Lightning processes
@pytest.mark.parametrize(
    "streaming",
    [
        # The plain heal is also covered by the resume test below; kept for -m slow.
        pytest.param([], id="plain", marks=pytest.mark.slow),
        # The same without sync_delay.
        pytest.param(
            ["--fragments", "2", "--quantize", "int8"], id="int8_fragments", marks=pytest.mark.slow
        ),
        # Each rank's round on the worker thread, the island's agreements on a gloo side group.
        pytest.param(
            ["--fragments", "2", "--quantize", "int8", "--delay", "1"],
            id="delayed",
            marks=pytest.mark.slow,  # ~27 s; the per-rank resume below heals by share too
        ),
    ],
)
def test_two_rank_joiner_is_healed_share_by_share_and_ends_equal(
    tmp_path: Path, streaming: list[str]
) -> None:
    """a and b (two ranks each) train; c (two ranks) joins the running swarm: each of its
    ranks is healed with its own share (half the anchors and momentum),
    holds a's anchors after its first round, sits on them (a new island), and every rank of
    every island ends equal. With two fragments and int8, each rank of c averages zeros of its
    own names of the swarm's fragment and adopts that round share by share."""
    fast = tmp_path / "fast"
    opts = [*OPTS, *streaming, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            wait_for(lambda: len(_by_rank(tmp_path, "a", 0)) >= 3, 180, "a's third round")
            procs["c"] = start_island(tmp_path, address, "c", *opts, script=SCRIPT)
            started.append(procs["c"])
            wait_for(lambda: len(_by_rank(tmp_path, "c", 1)) >= 2, 180, "c's rounds")
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 240, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for rank in (0, 1):
        a_anchors = {r["swarm/outer_steps"]: r["anchors"] for r in _by_rank(tmp_path, "a", rank)}
        joined = _by_rank(tmp_path, "c", rank)[0]
        assert joined["swarm/outer_steps"] >= 3  # healed into the running swarm
        # Its own share only: anchors and Nesterov momentum of half the model (the whole
        # island's state would be 2 * PAYLOAD_BYTES).
        assert joined["swarm/heal_bytes"] == 2 * SHARE_BYTES
        # Rank r's anchors (its share) are a's rank r's of that round.
        assert joined["anchors"] == a_anchors[joined["swarm/outer_steps"]]
        snap = load_file(str(tmp_path / f"c.join.rank{rank}.safetensors"))
        for key in (k for k in snap if k.startswith("anchor.")):
            assert snap[key].equal(snap["param." + key[7:]]), (rank, key)
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "abc" for r in (0, 1)])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow  # ~40 s each on 2 busy cores: six Lightning processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("victim", "streaming"),
    [
        pytest.param(1, [], id="rank1"),
        pytest.param(0, [], id="rank0"),
        pytest.param(1, ["--fragments", "2", "--quantize", "int8"], id="rank1_int8_fragments"),
    ],
)
def test_one_rank_of_an_island_killed_inside_a_round(
    tmp_path: Path, victim: int, streaming: list[str]
) -> None:
    """Three islands of two ranks; one rank of c stalls inside a round's mean (its peers wait
    on it) and is SIGKILLed there: a and b abandon that round on both ranks, commit again
    without c, and all four of their ranks end equal; c's other rank leaves too. With two
    fragments and int8 the round is one fragment's, and its abandon leaves that fragment's
    anchors and residuals as they were."""
    fast, stall = tmp_path / "fast", tmp_path / "stall"
    opts = [*OPTS, *streaming, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    faults = ["--stall-file", str(stall), "--stall-rank", str(victim)]
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
            wait_for((tmp_path / "c.stalled").exists, 60, "c's rank to stall inside a round")
            stalled_at = (tmp_path / "c.stalled").stat().st_mtime
            pids = [int((tmp_path / f"c.pid.rank{r}").read_text()) for r in (0, 1)]
            os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.time()
            # The island's other rank leaves as well (its island group broke).
            wait_for(lambda: not any(_alive(pid) for pid in pids), 120, "c's ranks to end")
            wait_for(
                lambda: any(
                    r["t"] > killed_at and r["swarm/islands_in_round"] == 2
                    for r in _by_rank(tmp_path, "a", 1)
                ),
                120,
                "a round of a and b without c",
            )
            fast.write_text("")
            procs.pop("c").wait()
            for name, proc in procs.items():
                assert finish(proc, 240, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for name in "ab":
        for rank in (0, 1):
            rows = _by_rank(tmp_path, name, rank)
            before = [r for r in rows if r["t"] < stalled_at][-1]
            first = next(r for r in rows if r["t"] > stalled_at)
            assert first["swarm/islands_in_round"] == 3, (name, rank, first)
            assert first["swarm/rounds_abandoned"] == before["swarm/rounds_abandoned"] + 1
            assert first["swarm/outer_steps"] == before["swarm/outer_steps"]
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ab" for r in (0, 1)])


def checkpoint_kill_and_resume(tmp_path: Path, island_opts: list[str]) -> None:
    """Islands a and c of two ranks (``island_opts``); c checkpoints at step 6, is SIGKILLed a
    few rounds later and resumes from that checkpoint while a goes on; both then finish. c's
    first run's rounds move to ``c.first.jsonl``."""
    fast, ckpt = tmp_path / "fast", tmp_path / "c.ckpt"
    opts = [*island_opts, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address:
        try:
            a = start_island(tmp_path, address, "a", *opts, script=SCRIPT)
            c = start_island(tmp_path, address, "c", *opts, "--checkpoint-at", "6", script=SCRIPT)
            started += [a, c]
            wait_for(ckpt.exists, 180, "c's checkpoint at step 6")
            wait_for(lambda: len(_by_rank(tmp_path, "c", 1)) >= 4, 120, "c's later rounds")
            for pid in [int((tmp_path / f"c.pid.rank{r}").read_text()) for r in (0, 1)]:
                os.kill(pid, signal.SIGKILL)
            c.wait()
            os.rename(tmp_path / "c.jsonl", tmp_path / "c.first.jsonl")
            # Alone, a cannot commit (min_islands=2): c's resume must land in a running swarm.
            c = start_island(tmp_path, address, "c", *opts, "--resume", str(ckpt), script=SCRIPT)
            started.append(c)
            wait_for(lambda: len(_by_rank(tmp_path, "c", 1)) >= 2, 180, "resumed c's rounds")
            fast.write_text("")
            for name, proc in (("a", a), ("c", c)):
                assert finish(proc, 240, tmp_path, name) == 0, name
        finally:
            _kill_all(started)


@pytest.mark.timeout(600)  # ~40 s on 2 busy cores
def test_a_sharded_island_saves_per_rank_and_resumes_into_the_swarm(tmp_path: Path) -> None:
    """c (two ranks) checkpoints at step 6: each rank writes its own share of the anchors and
    outer state. c is killed, resumes from that checkpoint while a goes on, is healed share by
    share with its own progress since the checkpointed anchors kept, and a and c end equal."""
    checkpoint_kill_and_resume(tmp_path, OPTS)
    shares = sorted(p.name for p in tmp_path.glob("c.ckpt.swarm/*/anchors-rank-*.pt"))
    assert shares == ["anchors-rank-00000.pt", "anchors-rank-00001.pt"], shares
    for rank in (0, 1):
        before = load_file(str(tmp_path / f"c.prejoin.rank{rank}.safetensors"))
        joined = load_file(str(tmp_path / f"c.join.rank{rank}.safetensors"))
        first = _by_rank(tmp_path, "c", rank)[0]
        assert first["swarm/heal_bytes"] > 0
        a_anchors = {r["swarm/outer_steps"]: r["anchors"] for r in _by_rank(tmp_path, "a", rank)}
        assert first["anchors"] == a_anchors[first["swarm/outer_steps"]]
        names = [k[6:] for k in before if k.startswith("param.")]
        owned = [n for n in names if "anchor." + n in before]
        assert owned and len(owned) < len(names)  # each rank holds its share's anchors only
        # Every parameter: the swarm's anchors plus c's progress since its saved anchors. Each
        # rank computes its own names; the other rank's arrive through the island's gather.
        other = load_file(str(tmp_path / f"c.prejoin.rank{1 - rank}.safetensors"))
        other_joined = load_file(str(tmp_path / f"c.join.rank{1 - rank}.safetensors"))
        for name in names:
            own_before, own_joined = (before, joined) if name in owned else (other, other_joined)
            progress = own_before["param." + name] - own_before["anchor." + name]
            assert progress.abs().max() > 0  # c had moved on from its anchors
            torch.testing.assert_close(
                joined["param." + name] - own_joined["anchor." + name], progress, rtol=0, atol=1e-6
            )
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ac" for r in (0, 1)])


@pytest.mark.slow  # ~22 s on a quiet machine; the refusal's wording: test_elastic_shares.py
@pytest.mark.timeout(400)  # ~30 s on 2 busy cores
def test_an_island_that_splits_the_outer_state_otherwise_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    """a and b are islands of one rank; y has two ranks sharing the outer state. Its rank 1 has
    no peers in the swarm at all (no other island has a rank 1): y is refused on both ranks,
    naming the setting, while a and b go on and end equal."""
    fast = tmp_path / "fast"
    opts = ["--width", "0", "--every", "4", "--max-steps", "400", "--step-s", "0.1"]
    opts += ["--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            wait_for(lambda: len(_rounds(tmp_path, "a")) >= 2, 120, "a's second round")
            other = start_island(tmp_path, address, "y", *opts, "--devices", "2", script=SCRIPT)
            started.append(other)
            assert finish(other, 120, tmp_path, "y") != 0
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 120, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for rank in (0, 1):
        error = (tmp_path / f"y.error.{rank}").read_text()
        assert error.startswith("SettingsMismatchError: island 'y' was refused"), (rank, error)
        assert "outer_shares is 2 here but 1 in the swarm" in error, (rank, error)
        assert "or set shard_outer=False on every island" in error
    _assert_equal(tmp_path, ["a.rank0", "b.rank0"])


@pytest.mark.slow  # ~40 s on 2 busy cores
@pytest.mark.timeout(600)
def test_two_rank_islands_go_on_when_the_lighthouse_restarts(tmp_path: Path) -> None:
    """SIGKILL the lighthouse mid-run and restart it on its port once both islands' manager
    servers failed to reach it: every rank of both islands commits rounds again (each rank's
    group set up anew for the new lighthouse's quorum) and all four end equal."""
    fast, port = tmp_path / "fast", free_port()
    opts = [*OPTS, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    first = start_lighthouse(port, tmp_path / "lighthouse.log")
    started: list[subprocess.Popen[Any]] = [first]
    try:
        address = f"http://127.0.0.1:{port}"
        procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
        started += procs.values()
        wait_for(lambda: len(_by_rank(tmp_path, "a", 1)) >= 3, 180, "a's third round")
        first.kill()
        first.wait()
        killed_at = time.time()
        for name in "ab":
            wait_for(
                lambda n=name: logged(tmp_path, n, "lighthouse quorum failed"),
                60,
                f"{name}'s quorum request to fail",
            )
        started.append(start_lighthouse(port, tmp_path / "lighthouse.log"))
        for name in "ab":
            for rank in (0, 1):
                wait_for(
                    lambda n=name, r=rank: any(
                        row["t"] > killed_at for row in _by_rank(tmp_path, n, r)
                    ),
                    120,
                    f"{name}'s rank {rank} round after the restart",
                )
        fast.write_text("")
        for name, proc in procs.items():
            assert finish(proc, 240, tmp_path, name) == 0, name
    finally:
        _kill_all(started)
    for name in "ab":
        for rank in (0, 1):
            after = [r for r in _by_rank(tmp_path, name, rank) if r["t"] > killed_at]
            assert after and after[-1]["swarm/outer_steps"] > after[0]["swarm/outer_steps"]
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ab" for r in (0, 1)])


@pytest.mark.slow  # ~19 s on a quiet machine; one-rank refusals: test_elastic_strategy.py
@pytest.mark.timeout(400)  # ~35 s on 2 busy cores
def test_a_two_rank_joiner_with_another_model_is_refused_on_every_rank(tmp_path: Path) -> None:
    """a and b: two ranks each. w: two ranks, a last layer of another shape. Each of w's ranks
    is healed with its share and refused, naming the parameter that differs (rank r of every
    island judges the same rows); a and b abandon that round, go on and end equal."""
    fast = tmp_path / "fast"
    opts = [*OPTS, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            wait_for(lambda: len(_by_rank(tmp_path, "a", 1)) >= 2, 180, "a's second round")
            wide = [*opts, "--width", "8"]  # Linear(8, 8), Linear(8, 1): not Linear(8, 8) twice
            other = start_island(tmp_path, address, "w", *wide, script=SCRIPT)
            started.append(other)
            assert finish(other, 120, tmp_path, "w") != 0
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 180, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for rank in (0, 1):
        error = (tmp_path / f"w.error.{rank}").read_text()
        assert error.startswith("ModelMismatchError: island 'w' was refused"), (rank, error)
        assert "net.1.weight is (1, 8) float32 here but (8, 8) float32 in the swarm" in error
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ab" for r in (0, 1)])


@pytest.mark.slow  # ~40 s each on 2 busy cores
@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase", ["quorum", "header", "commit"])
def test_rank_1_of_an_island_dies_at_each_phase_of_a_round(tmp_path: Path, phase: str) -> None:
    """Three islands of two ranks; rank 1 of c SIGKILLs itself as a phase of its fourth round
    starts (``tests/elastic_faults.py``): a and b abandon at most that round, commit again
    without c, and all four of their ranks end equal; both of c's processes end."""
    fast = tmp_path / "fast"
    opts = [*OPTS, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    fault = ["--fault", f"{phase}:3:kill", "--fault-rank", "1"]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address:
        try:
            procs = {
                n: start_island(
                    tmp_path, address, n, *opts, *(fault if n == "c" else ()), script=SCRIPT
                )
                for n in "abc"
            }
            started += procs.values()
            wait_for((tmp_path / "c.kill").exists, 240, f"c's rank 1 to die at {phase}")
            killed_at = time.time()
            pids = [int((tmp_path / f"c.pid.rank{r}").read_text()) for r in (0, 1)]
            wait_for(lambda: not any(_alive(pid) for pid in pids), 120, "c's ranks to end")
            for name in "ab":
                for rank in (0, 1):
                    wait_for(
                        lambda n=name, r=rank: any(
                            row["t"] > killed_at and row["swarm/islands_in_round"] == 2
                            for row in _by_rank(tmp_path, n, r)
                        ),
                        120,
                        f"{name}'s rank {rank} round without c",
                    )
            fast.write_text("")
            procs.pop("c").wait()
            for name, proc in procs.items():
                assert finish(proc, 240, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for name in "ab":
        for rank in (0, 1):
            rows = _by_rank(tmp_path, name, rank)
            # An island that was still starting up when c died had abandoned none before.
            before = [r["swarm/rounds_abandoned"] for r in rows if r["t"] < killed_at] or [0.0]
            assert rows[-1]["swarm/rounds_abandoned"] <= before[-1] + 1, (name, rank)
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in "ab" for r in (0, 1)])


@pytest.mark.slow  # ~45 s each on 2 busy cores
@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase", ["heal_recv", "heal_send"])
def test_rank_1_dies_while_a_two_rank_joiner_is_healed(tmp_path: Path, phase: str) -> None:
    """a and b (two ranks each) train; c (two ranks) joins. heal_recv: c's rank 1 dies as its
    share arrives; heal_send: rank 1 of whichever of a and b heals c dies as it sends. The
    islands left abandon that round (and, min_islands being 2, any round whose other island is
    being healed), go on and end equal (c too, when it lived)."""
    fast = tmp_path / "fast"
    opts = [*OPTS, "--max-steps", "400", "--step-s", "0.1", "--fast-file", str(fast)]
    # From round 2 on: at genesis (round 0) a and b heal each other's shares too.
    fault = [
        "--fault",
        f"{phase}:{'*' if phase == 'heal_recv' else '2+'}:kill",
        "--fault-rank",
        "1",
    ]
    victims = "c" if phase == "heal_recv" else "ab"
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address:
        try:
            procs = {
                n: start_island(
                    tmp_path, address, n, *opts, *(fault if n in "ab" else ()), script=SCRIPT
                )
                if victims == "ab"
                else start_island(tmp_path, address, n, *opts, script=SCRIPT)
                for n in "ab"
            }
            started += procs.values()
            wait_for(lambda: len(_by_rank(tmp_path, "a", 1)) >= 3, 180, "a's third round")
            extra = fault if victims == "c" else []
            procs["c"] = start_island(tmp_path, address, "c", *opts, *extra, script=SCRIPT)
            started.append(procs["c"])
            markers = [tmp_path / f"{n}.kill" for n in victims]
            wait_for(lambda: any(m.exists() for m in markers), 180, f"a death at {phase}")
            dead = next(m.name[0] for m in markers if m.exists())
            killed_at = time.time()
            pids = [int((tmp_path / f"{dead}.pid.rank{r}").read_text()) for r in (0, 1)]
            wait_for(lambda: not any(_alive(pid) for pid in pids), 120, f"{dead}'s ranks to end")
            procs.pop(dead).wait()
            live = sorted(procs)
            for name in live:
                wait_for(
                    lambda n=name: any(
                        row["t"] > killed_at and row["swarm/islands_in_round"] == len(live)
                        for row in _by_rank(tmp_path, n, 1)
                    ),
                    120,
                    f"{name}'s round after the death",
                )
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 240, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    for name in live:
        for rank in (0, 1):
            rows = _by_rank(tmp_path, name, rank)
            after = [(r["swarm/rounds_abandoned"], r) for r in rows if r["t"] > killed_at]
            before = [r["swarm/rounds_abandoned"] for r in rows if r["t"] < killed_at] or [0.0]
            # The round of the death is abandoned; so is a round whose only other island is
            # being healed (fewer participants than min_islands=2), and no other.
            seen = before[-1]
            for index, (abandoned, row) in enumerate(after):
                if abandoned > seen and index > 0:
                    assert row["swarm/islands_in_round"] < 2, (name, rank, row)
                seen = abandoned
    _assert_equal(tmp_path, [f"{n}.rank{r}" for n in live for r in (0, 1)])
