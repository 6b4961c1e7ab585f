"""SwarmStrategy(membership="torchft") end to end: Lightning islands as processes, one lighthouse.

Each island runs tests/elastic_lightning_island.py (a tiny regression model, its own data).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.elastic_utils import finish, lighthouse, start_island, wait_for

pytest.importorskip("torchft")

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


def test_lightning_islands_survive_a_kill_and_heal_a_restart(tmp_path: Path) -> None:
    """Three islands; c is SIGKILLed mid-run: a and b go on and end equal; c restarts as an
    island of two ranks and a new island d joins: both are healed and end with the same global
    model as a and b."""
    fast = tmp_path / "fast"
    opts = ["--max-steps", "400", "--every", "4", "--step-s", "0.1", "--fast-file", str(fast)]
    with lighthouse(heartbeat_timeout_ms=1500) as address:
        procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "abc"}
        wait_for(lambda: len(_rounds(tmp_path, "c")) >= 3, 90, "c's third round")
        procs["c"].send_signal(signal.SIGKILL)
        procs["c"].wait()
        killed_at = time.time()
        os.rename(tmp_path / "c.jsonl", tmp_path / "c.first.jsonl")
        restarted = start_island(tmp_path, address, "c", *opts, "--devices", "2", script=SCRIPT)
        joiner = start_island(tmp_path, address, "d", *opts, script=SCRIPT)
        for name in "cd":
            wait_for(lambda n=name: len(_rounds(tmp_path, n)) >= 2, 120, f"{name}'s first rounds")
        fast.write_text("")
        procs.update(c=restarted, d=joiner)
        for name, proc in procs.items():
            assert finish(proc, 150, tmp_path, name) == 0, name

    after = [r for r in _rounds(tmp_path, "a") if r["t"] > killed_at]
    committed = [r for r in after if r["swarm/islands_in_round"] == 2]
    assert committed and committed[0]["t"] - killed_at < 20 + 5  # quorum + round timeouts
    assert any(r["swarm/islands_in_round"] == 4 for r in after)  # c came back, d joined
    for name in "cd":
        joined = _rounds(tmp_path, name)
        assert joined[0]["swarm/heal_bytes"] > 0 and joined[0]["swarm/heal_time_s"] > 0
        assert joined[0]["swarm/outer_steps"] > 3  # healed into the running swarm
        last = _rounds(tmp_path, "a")[-1]["swarm/outer_steps"]
        assert joined[-1]["swarm/outer_steps"] == last
    final = {
        name: load_file(str(tmp_path / name))
        for name in (
            "a.rank0.safetensors",
            "b.rank0.safetensors",
            "c.rank0.safetensors",
            "c.rank1.safetensors",
        )
    }
    reference = final.pop("a.rank0.safetensors")
    for name, state in final.items():
        for key, value in reference.items():
            assert value.equal(state[key]), f"{name}: {key} differs from a's"


def test_lightning_joiners_with_another_model_or_a_taken_id_are_refused(tmp_path: Path) -> None:
    """Refused on every rank of the joining island, while a and b go on and end equal."""
    fast = tmp_path / "fast"
    opts = ["--max-steps", "400", "--every", "4", "--step-s", "0.1", "--fast-file", str(fast)]
    with lighthouse() as address:
        procs = {n: start_island(tmp_path, address, n, *opts, script=SCRIPT) for n in "ab"}
        wait_for(lambda: len(_rounds(tmp_path, "a")) >= 2, 90, "a's second round")
        wide = start_island(tmp_path, address, "w", *opts, "--width", "6", script=SCRIPT)
        (tmp_path / "twin").mkdir()
        twin = start_island(tmp_path / "twin", address, "a", *opts, "--devices", "2", script=SCRIPT)
        assert finish(wide, 90, tmp_path, "w") != 0
        assert finish(twin, 90, tmp_path / "twin", "a") != 0
        fast.write_text("")
        for name, proc in procs.items():
            assert finish(proc, 120, tmp_path, name) == 0, name
    error = (tmp_path / "w.error.0").read_text()
    assert "ModelMismatchError" in error
    assert "net.0.weight is (6, 8) float32 here but (4, 8) float32 in the swarm" in error
    for rank in (0, 1):
        twin_error = (tmp_path / "twin" / f"a.error.{rank}").read_text()
        assert twin_error.startswith("DuplicateIslandError: island_id 'a' is already taken")
    a, b = (load_file(str(tmp_path / f"{n}.rank0.safetensors")) for n in "ab")
    assert all(a[k].equal(b[k]) for k in a)
