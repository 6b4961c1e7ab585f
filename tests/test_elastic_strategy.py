"""SwarmStrategy(membership="torchft") end to end: Lightning islands as processes, one lighthouse.

Each island runs tests/elastic_lightning_island.py (a tiny regression model, its own data).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_swarm.algorithm.outer_schedule import MomentumSchedule
from tests.dist_utils import free_port
from tests.elastic_utils import finish, lighthouse, start_island, start_lighthouse, wait_for

pytest.importorskip("torchft")

Row = dict[str, float]  # one logged row ("anchors" holds a str digest)
SCRIPT = "tests/elastic_lightning_island.py"
# Islands step slowly (0.1 s) until the test writes the "fast" file: long enough for a restarted
# or refused island to start up on a busy machine while the others still run; then they finish
# their remaining rounds quickly.


def _rows(out: Path, island: str) -> list[dict[str, float]]:
    path = out / f"{island}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rounds(out: Path, island: str) -> list[dict[str, float]]:
    return [r for r in _rows(out, island) if "swarm/islands_in_round" in r]


def _anchors_by_outer_step(out: Path, island: str) -> dict[float, set[str]]:
    """Outer step -> the anchor digests ``island`` logged at it (one, unless anchors diverged)."""
    seen: dict[float, set[str]] = {}
    for row in _rounds(out, island):
        seen.setdefault(row["swarm/outer_steps"], set()).add(str(row["anchors"]))
    return seen


def _first_row_after(rows: list[Row], t: float) -> tuple[Row, Row]:
    """The last row logged before ``t`` and the first one after it."""
    before = [r for r in rows if r["t"] < t]
    after = [r for r in rows if r["t"] > t]
    assert before and after, f"no rows around {t}"
    return before[-1], after[0]


def _assert_momentum_follows_the_ramp(out: Path, islands: tuple[str, ...]) -> None:
    """The default momentum ramp is a function of the swarm's round count (the islands run
    400 steps with a round every 4: 100 rounds): every applied round's outer momentum is the
    ramp's at that round, on every island, restarted, resumed and healed ones included."""
    ramp, used = MomentumSchedule(), set()
    for name in islands:
        applied = [r for r in _rows(out, name) if "swarm/outer_momentum" in r]
        assert applied, name
        for row in applied:
            expected = 0.9 * ramp.factor(int(row["swarm/outer_steps"]) - 1, 100)
            assert row["swarm/outer_momentum"] == pytest.approx(expected), (name, row)
            used.add(row["swarm/outer_momentum"])
    assert len(used) > 3, used  # the ramp moved over the rounds seen


def _kill_all(procs: list[subprocess.Popen[Any]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(400)
def test_lightning_islands_survive_a_kill_and_heal_a_restart(tmp_path: Path) -> None:
    """Three islands; c is SIGKILLed inside a round: a and b abandon that round, go on and end
    equal; c restarts as an island of two ranks and a new island d joins: both are healed, hold
    the others' anchors after their first round, and end with the same global model."""
    fast, stall = tmp_path / "fast", tmp_path / "stall"
    opts = ["--max-steps", "400", "--every", "4", "--step-s", "0.1", "--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address:
        try:
            procs = {
                n: start_island(
                    tmp_path, address, n, *opts, "--stall-file", str(stall), script=SCRIPT
                )
                if n == "c"
                else start_island(tmp_path, address, n, *opts, script=SCRIPT)
                for n in "abc"
            }
            started += procs.values()
            wait_for(lambda: len(_rounds(tmp_path, "c")) >= 3, 90, "c's third round")
            stall.write_text("")  # c's next round stalls after its quorum: kill it there
            wait_for((tmp_path / "c.stalled").exists, 30, "c to stall inside a round")
            # a's row of that round comes after the stall, its previous row before it.
            stalled_at = (tmp_path / "c.stalled").stat().st_mtime
            procs["c"].send_signal(signal.SIGKILL)
            procs["c"].wait()
            killed_at = time.time()
            os.rename(tmp_path / "c.jsonl", tmp_path / "c.first.jsonl")
            # Two ranks beside one-rank islands: rank 0 exchanges for c (shard_outer=False).
            restarted = start_island(
                tmp_path, address, "c", *opts, "--devices", "2", "--no-shard-outer", script=SCRIPT
            )
            joiner = start_island(tmp_path, address, "d", *opts, script=SCRIPT)
            started += [restarted, joiner]
            for name in "cd":
                wait_for(lambda n=name: len(_rounds(tmp_path, n)) >= 2, 120, f"{name}'s rounds")
            fast.write_text("")
            procs.update(c=restarted, d=joiner)
            for name, proc in procs.items():
                assert finish(proc, 150, tmp_path, name) == 0, name
        finally:
            _kill_all(started)

    for name in "ab":  # the round c died in: three islands in it, abandoned by both survivors
        last, first = _first_row_after(_rounds(tmp_path, name), stalled_at)
        assert first["swarm/islands_in_round"] == 3, (name, first)
        assert first["swarm/rounds_abandoned"] == last["swarm/rounds_abandoned"] + 1, name
        assert first["swarm/outer_steps"] == last["swarm/outer_steps"]  # anchors unchanged
    after = [r for r in _rounds(tmp_path, "a") if r["t"] > killed_at]
    committed = [r for r in after if r["swarm/islands_in_round"] == 2]
    assert committed and committed[0]["t"] - killed_at < 20 + 5  # quorum + round timeouts
    assert any(r["swarm/islands_in_round"] == 4 for r in after)  # c came back, d joined
    a_anchors = _anchors_by_outer_step(tmp_path, "a")
    assert all(len(digests) == 1 for digests in a_anchors.values())
    last = _rounds(tmp_path, "a")[-1]["swarm/outer_steps"]
    for name, ranks in (("c", (0, 1)), ("d", (0,))):
        for rank in ranks:
            joined = [r for r in _rounds(tmp_path, name) if r["rank"] == rank]
            assert joined[0]["swarm/heal_bytes"] > 0 and joined[0]["swarm/heal_time_s"] > 0
            assert joined[0]["swarm/outer_steps"] > 3  # healed into the running swarm
            # After its first round (the heal) the joiner holds a's anchors of that round ...
            assert a_anchors[joined[0]["swarm/outer_steps"]] == {joined[0]["anchors"]}
            # ... and, being new, sits exactly on them (the catch-up adds no progress).
            snap = load_file(str(tmp_path / f"{name}.join.rank{rank}.safetensors"))
            for key in (k for k in snap if k.startswith("param.")):
                assert snap[key].equal(snap["anchor." + key[6:]]), (name, rank, key)
            assert joined[-1]["swarm/outer_steps"] == last
    final = {
        name: load_file(str(tmp_path / name))
        for name in (
            "a.rank0.safetensors",
            "b.rank0.safetensors",
            "c.rank0.safetensors",
            "c.rank1.safetensors",
            "d.rank0.safetensors",
        )
    }
    reference = final.pop("a.rank0.safetensors")
    for name, state in final.items():
        for key, value in reference.items():
            assert value.equal(state[key]), f"{name}: {key} differs from a's"
    _assert_momentum_follows_the_ramp(tmp_path, ("a", "b", "c.first", "c", "d"))


@pytest.mark.slow  # ~23 s; the membership-level refusals run by default (test_membership_torchft)
@pytest.mark.timeout(400)
def test_lightning_joiners_with_another_model_or_a_taken_id_are_refused(tmp_path: Path) -> None:
    """Refused on every rank of the joining island, while a and b go on and end equal."""
    fast = tmp_path / "fast"
    opts = ["--max-steps", "400", "--every", "4", "--step-s", "0.1", "--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            wait_for(lambda: len(_rounds(tmp_path, "a")) >= 2, 90, "a's second round")
            wide = start_island(tmp_path, address, "w", *opts, "--width", "6", script=SCRIPT)
            (tmp_path / "twin").mkdir()
            twin = start_island(
                tmp_path / "twin", address, "a", *opts, "--devices", "2", script=SCRIPT
            )
            started += [wide, twin]
            assert finish(wide, 90, tmp_path, "w") != 0
            assert finish(twin, 90, tmp_path / "twin", "a") != 0
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 120, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    error = (tmp_path / "w.error.0").read_text()
    assert "ModelMismatchError" in error
    assert "net.0.weight is (6, 8) float32 here but (4, 8) float32 in the swarm" in error
    for rank in (0, 1):
        twin_error = (tmp_path / "twin" / f"a.error.{rank}").read_text()
        assert twin_error.startswith("DuplicateIslandError: island_id 'a' is already taken")
    a, b = (load_file(str(tmp_path / f"{n}.rank0.safetensors")) for n in "ab")
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow  # ~23 s; a kill and a heal run by default (test_lightning_islands_survive_...)
@pytest.mark.timeout(480)  # ~40 s on 2 busy cores
def test_lightning_kill_during_heal_and_resume_into_a_swarm_of_another_size(
    tmp_path: Path,
) -> None:
    """c checkpoints while the swarm is {a, c}; b joins; c is killed. A joiner d is SIGKILLed
    while being healed: a and b abandon that round and go on. c resumes from its checkpoint
    into the swarm {a, b}: healed to the swarm's anchors, its own progress since its
    checkpointed anchors kept (the catch-up), and all three end equal."""
    fast, ckpt = tmp_path / "fast", tmp_path / "c.ckpt"
    opts = ["--max-steps", "400", "--every", "4", "--step-s", "0.1", "--fast-file", str(fast)]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address:
        try:
            a = start_island(tmp_path, address, "a", *opts, script=SCRIPT)
            c = start_island(tmp_path, address, "c", *opts, "--checkpoint-at", "6", script=SCRIPT)
            started += [a, c]
            wait_for(ckpt.exists, 120, "c's checkpoint at step 6")
            b = start_island(tmp_path, address, "b", *opts, script=SCRIPT)
            started.append(b)
            wait_for(lambda: len(_rounds(tmp_path, "b")) >= 2, 120, "b's rounds")
            c.send_signal(signal.SIGKILL)
            c.wait()
            os.rename(tmp_path / "c.jsonl", tmp_path / "c.first.jsonl")
            d = start_island(tmp_path, address, "d", *opts, "--stall-in-heal", script=SCRIPT)
            started.append(d)
            wait_for((tmp_path / "d.stalled").exists, 120, "d to stall while being healed")
            stalled_at = (tmp_path / "d.stalled").stat().st_mtime
            d.send_signal(signal.SIGKILL)
            d.wait()
            wait_for(  # the healing peer did not hang: a and b commit rounds without d
                lambda: any(r["t"] > stalled_at for r in _rounds(tmp_path, "b")[1:]),
                60,
                "b's rounds after d died",
            )
            c = start_island(tmp_path, address, "c", *opts, "--resume", str(ckpt), script=SCRIPT)
            started.append(c)
            wait_for(lambda: len(_rounds(tmp_path, "c")) >= 2, 120, "resumed c's rounds")
            fast.write_text("")
            for name, proc in (("a", a), ("b", b), ("c", c)):
                assert finish(proc, 150, tmp_path, name) == 0, name
        finally:
            _kill_all(started)

    # The round d was being healed in: abandoned by a and b (d never got past the heal).
    assert not _rounds(tmp_path, "d")
    for name in "ab":
        last, first = _first_row_after(_rounds(tmp_path, name), stalled_at)
        assert first["swarm/rounds_abandoned"] == last["swarm/rounds_abandoned"] + 1, name
        assert first["swarm/outer_steps"] == last["swarm/outer_steps"]
    # The checkpoint was written in a swarm of two; c resumed into a swarm of three.
    first_life = [r for r in _rows(tmp_path, "c.first") if "swarm/islands_in_round" in r]
    assert {r["swarm/islands_in_round"] for r in first_life if r["step"] <= 6} == {2}
    resumed = _rounds(tmp_path, "c")
    assert any(r["swarm/islands_in_round"] == 3 for r in resumed)
    # Before its first round c holds its checkpoint: parameters ahead of its old anchors.
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    before = load_file(str(tmp_path / "c.prejoin.rank0.safetensors"))
    params = [k[6:] for k in before if k.startswith("param.")]
    assert all(before["param." + k].equal(saved[k]) for k in params)
    assert not all(before["param." + k].equal(before["anchor." + k]) for k in params)
    # After it: the swarm's anchors (healed) plus its own progress (the catch-up).
    joined = load_file(str(tmp_path / "c.join.rank0.safetensors"))
    assert resumed[0]["swarm/heal_bytes"] > 0
    assert _anchors_by_outer_step(tmp_path, "a")[resumed[0]["swarm/outer_steps"]] == {
        resumed[0]["anchors"]
    }
    for k in params:
        assert not joined["anchor." + k].equal(before["anchor." + k])  # the swarm moved on
        progress = before["param." + k] - before["anchor." + k]
        torch.testing.assert_close(
            joined["param." + k] - joined["anchor." + k], progress, rtol=0, atol=1e-6
        )
    final = [load_file(str(tmp_path / f"{n}.rank0.safetensors")) for n in "abc"]
    for state in final[1:]:
        assert all(final[0][k].equal(state[k]) for k in final[0])
    _assert_momentum_follows_the_ramp(tmp_path, ("a", "b", "c.first", "c"))  # c resumed


@pytest.mark.slow  # ~12 s; in the suite: the streaming joiner ends equal with merge_alpha 0.5,
# and test_membership_torchft.py refuses other settings by name
@pytest.mark.timeout(300)
def test_lightning_merge_alpha_ends_equal_and_other_settings_are_refused(tmp_path: Path) -> None:
    """With merge_alpha=0.5 the islands still end bitwise equal (on the global model); an
    island with another outer learning rate is refused, naming it, while a and b go on."""
    fast = tmp_path / "fast"
    opts = ["--max-steps", "400", "--every", "4", "--step-s", "0.1", "--fast-file", str(fast)]
    opts += ["--merge-alpha", "0.5"]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            wait_for(lambda: len(_rounds(tmp_path, "a")) >= 2, 90, "a's second round")
            other = start_island(tmp_path, address, "x", *opts, "--outer-lr", "0.1", script=SCRIPT)
            started.append(other)
            assert finish(other, 90, tmp_path, "x") != 0
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 120, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    error = (tmp_path / "x.error.0").read_text()
    assert error.startswith("SettingsMismatchError: island 'x' was refused"), error
    assert "outer_optimizer.lr is 0.1 here but 0.7 in the swarm" in error
    a, b = (load_file(str(tmp_path / f"{n}.rank0.safetensors")) for n in "ab")
    assert all(a[k].equal(b[k]) for k in a), {k: (a[k] - b[k]).abs().max() for k in a}


@pytest.mark.slow  # ~30 s on 2 cores: a quorum timeout after the refusal
def test_the_partner_of_a_refused_island_names_the_refusal_when_its_quorum_times_out(
    tmp_path: Path,
) -> None:
    """x (another outer lr) waits first; a joins, x is refused in their first round and stops,
    and a's quorum (min_islands=2) times out with an error that says x was refused."""
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            x = start_island(tmp_path, address, "x", "--outer-lr", "0.1", script=SCRIPT)
            started.append(x)
            a = start_island(tmp_path, address, "a", "--quorum-timeout", "6", script=SCRIPT)
            started.append(a)
            assert finish(x, 90, tmp_path, "x") != 0
            assert finish(a, 90, tmp_path, "a") != 0
        finally:
            _kill_all(started)
    refused = (tmp_path / "x.error.0").read_text()
    assert refused.startswith("SettingsMismatchError: island 'x' was refused"), refused
    error = (tmp_path / "a.error.0").read_text()
    assert error.startswith("QuorumTimeoutError: island 'a'"), error
    assert "island_id hash" in error and "was refused in round 0" in error, error
    assert "its DiLoCo settings differ from the swarm's" in error, error


@pytest.mark.slow  # ~60 s on 2 busy cores; test_membership_torchft.py names the error in seconds
@pytest.mark.timeout(400)
def test_lightning_islands_stop_cleanly_when_the_lighthouse_stays_gone(tmp_path: Path) -> None:
    """The lighthouse dies for good: every island stops after quorum_timeout_s with an error
    naming the lighthouse, and the checkpoint each wrote before still loads, whole."""
    fast, port = tmp_path / "fast", free_port()
    opts = ["--max-steps", "400", "--every", "4", "--step-s", "0.1", "--fast-file", str(fast)]
    opts += ["--checkpoint-at", "8", "--quorum-timeout", "10"]
    server = start_lighthouse(port, tmp_path / "lighthouse.log")
    started: list[subprocess.Popen[Any]] = [server]
    try:
        address = f"http://127.0.0.1:{port}"
        # Each island its own checkpoint folder: a save prunes the folder's other .swarm
        # directories that have no checkpoint yet, which includes another island's save in
        # progress (see docs/elastic.md).
        outs = {n: tmp_path / n for n in "ab"}
        for out in outs.values():
            out.mkdir()
        procs = {n: start_island(outs[n], address, n, *opts, script=SCRIPT) for n in "ab"}
        started += procs.values()
        for name in "ab":
            wait_for((outs[name] / f"{name}.ckpt").exists, 120, f"{name}'s checkpoint")
        server.kill()
        server.wait()
        for name, proc in procs.items():
            assert finish(proc, 10 + 60, outs[name], name) != 0, name
    finally:
        _kill_all(started)
    for name in "ab":
        error = (outs[name] / f"{name}.error.0").read_text()
        assert error.startswith(f"LighthouseLostError: island {name!r}: the lighthouse at"), error
        assert f"{address} stopped answering" in error
        saved = torch.load(outs[name] / f"{name}.ckpt", map_location="cpu", weights_only=True)
        assert saved["global_step"] == 8 and saved["state_dict"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_lightning_islands_on_cuda(tmp_path: Path) -> None:
    """Two one-rank islands training on a GPU (NCCL worlds of one rank each; the elastic traffic
    on gloo over CPU copies) commit rounds together and end bitwise equal. The one command for a
    GPU machine: `pytest tests/test_elastic_strategy.py -k cuda`."""
    opts = ["--max-steps", "40", "--every", "4", "--step-s", "0.05", "--accelerator", "cuda"]
    started: list[subprocess.Popen[Any]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            for name, proc in procs.items():
                assert finish(proc, 240, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    assert max(r["swarm/islands_in_round"] for r in _rounds(tmp_path, "a")) == 2
    a, b = (load_file(str(tmp_path / f"{n}.rank0.safetensors")) for n in "ab")
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow  # ~20 s; two-rank islands in a swarm run by default (test_elastic_per_rank)
@pytest.mark.timeout(400)
def test_lightning_streaming_int8_joiner_of_two_ranks_ends_equal(tmp_path: Path) -> None:
    """Streaming DiLoCo under torchft through Lightning: 2 fragments, sync_delay 1 (rounds on
    the sync worker), int8 with error feedback, merge_alpha 0.5. A new island d of two ranks
    joins mid-stream: healed and adopting the swarm's fragment round on both its ranks, it
    holds a's anchors after its first round; every island stops at the same committed round
    (ceil(max_steps / sync_every) * num_fragments) and a, b and both ranks of d end bitwise
    equal; bytes moved are counted."""
    fast = tmp_path / "fast"
    opts = ["--max-steps", "400", "--every", "8", "--step-s", "0.1", "--fast-file", str(fast)]
    opts += ["--fragments", "2", "--delay", "1", "--quantize", "int8", "--merge-alpha", "0.5"]
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse() as address:
        try:
            procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
            started += procs.values()
            wait_for(lambda: len(_rounds(tmp_path, "a")) >= 4, 90, "a's fourth round")
            # Rank 0 exchanges for d and fans out (the fan-out path; a sharded two-rank
            # joiner with sync_delay > 0: test_elastic_per_rank.py, delayed).
            procs["d"] = start_island(
                tmp_path, address, "d", *opts, "--devices", "2", "--no-shard-outer", script=SCRIPT
            )
            started.append(procs["d"])
            wait_for(lambda: len(_rounds(tmp_path, "d")) >= 4, 150, "d to join and commit")
            fast.write_text("")
            for name, proc in procs.items():
                assert finish(proc, 150, tmp_path, name) == 0, name
        finally:
            _kill_all(started)
    finals = [load_file(str(tmp_path / f"{n}.safetensors")) for n in ("a.rank0", "b.rank0")]
    finals += [load_file(str(tmp_path / f"d.rank{r}.safetensors")) for r in (0, 1)]
    for other in finals[1:]:
        assert all(finals[0][k].equal(other[k]) for k in finals[0])
    a_rounds = _rounds(tmp_path, "a")
    assert a_rounds[-1]["swarm/outer_steps"] == 400 // 8 * 2
    assert a_rounds[-1]["swarm/bytes_sent"] > 0
    a_anchors = _anchors_by_outer_step(tmp_path, "a")
    for rank in (0, 1):
        joined = next(r for r in _rounds(tmp_path, "d") if r["rank"] == rank)
        assert joined["swarm/heal_bytes"] > 0, joined
        assert a_anchors[joined["swarm/outer_steps"]] == {joined["anchors"]}, joined
