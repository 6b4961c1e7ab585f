"""Streaming DiLoCo under torchft, without Lightning: fragments, overlapped rounds, int8.

Each island runs tests/elastic_island.py with 2 fragments, ``sync_delay`` 1 and int8 with error
feedback: every fragment's round is a torchft round of its own (quorum, header, quantized mean,
commit gate). The finishers must end bitwise equal: anchors and parameters.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.elastic_utils import (
    anchors_by_round,
    finish,
    finish_all,
    lighthouse,
    reaped,
    rounds,
    start_island,
    wait_for,
)

pytest.importorskip("torchft")

STREAM = ["--fragments", "2", "--delay", "1", "--quantize", "int8", "--every", "4"]
TIMEOUTS = ["--quorum-timeout", "20", "--round-timeout", "5"]


def _assert_equal(out: Path, names: str) -> None:
    final = {name: load_file(str(out / f"{name}.safetensors")) for name in names}
    first = names[0]
    for name in names[1:]:
        for key, value in final[first].items():
            assert value.equal(final[name][key]), f"{name}: {key} differs from {first}'s"


@pytest.mark.timeout(240)
def test_streaming_int8_islands_end_bitwise_equal(tmp_path: Path) -> None:
    """Three islands, 2 fragments, sync_delay 1, int8 + error feedback, merge_alpha 0.5: every
    fragment's round commits, bytes move, residuals are kept, and the islands end equal. With
    ``round_timeout_s`` unset, each island measures its link from its first round with others
    and bounds these small rounds by the 60 s floor."""
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(min_islands=3) as address, reaped(started):
        derived = ["--quorum-timeout", "20", "--round-timeout", "0"]
        opts = [*STREAM, "--alpha", "0.5", *derived, "--rounds", "8", "--step-s", "0.02"]
        procs = {n: start_island(tmp_path, address, n, *opts, "--min-islands", "3") for n in "abc"}
        started.extend(procs.values())
        finish_all(procs, tmp_path, 200)
    _assert_equal(tmp_path, "abc")
    for name in "abc":
        log = [r for r in rounds(tmp_path, name) if not r["joined"]]
        applied = [r for r in log if r["applied"]]
        assert len(applied) >= 8 - 1, log  # the join round is the genesis: 8 rounds after it
        assert all(r["islands"] == 3 and r["bytes_sent"] > 0 for r in applied), applied
        assert len({r["residuals"] for r in applied}) > 1  # error feedback kept a residual
        assert all(r["round_timeout_s"] == 60.0 for r in applied), applied
        assert all(r["rate_bps"] is not None and r["rate_bps"] > 0 for r in applied), applied
    by_round = [anchors_by_round(tmp_path, n) for n in "abc"]
    assert by_round[0] == by_round[1] == by_round[2]  # bitwise-equal anchors every round


def _committed(out: Path, island: str) -> list[dict[str, Any]]:
    return [r for r in rounds(out, island) if r["applied"] and not r["joined"]]


@pytest.mark.parametrize(
    "quantize",
    # The float32 mean of a torchft round is also covered by test_membership_torchft.py.
    ["int8", pytest.param("none", marks=pytest.mark.slow)],
)
@pytest.mark.timeout(300)
def test_kill_mid_fragment_round_then_a_joiner_heals_mid_stream(
    tmp_path: Path, quantize: str
) -> None:
    """c is SIGKILLed in the quantized mean of a fragment round (its 5th round, sync_delay 1:
    a round in flight on the worker); a and b abandon it and go on. A new island d then joins
    mid-stream: healed with every fragment's anchors and outer state, it adopts the swarm's
    fragment round in flight, holds a's anchors after it, and a, b and d end bitwise equal.
    With ``quantize="none"`` the same runs over torchft's float32 all-reduce."""
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address, reaped(started):
        stop = tmp_path / "stop"
        opts = [*STREAM, *TIMEOUTS, "--rounds", "10000", "--step-s", "0.03"]
        opts += ["--stop-file", str(stop), "--quantize", quantize]
        procs = {n: start_island(tmp_path, address, n, *opts) for n in "ab"}
        procs["c"] = start_island(tmp_path, address, "c", *opts, "--fault", "mean:5:kill")
        started.extend(procs.values())
        assert finish(procs["c"], 120, tmp_path, "c") == -signal.SIGKILL
        killed_at = time.time()
        wait_for(
            lambda: any(float(r["t"]) > killed_at for r in _committed(tmp_path, "a")),
            60,
            "a round committed after the kill",
        )
        joiner = start_island(tmp_path, address, "d", *opts)
        started.append(joiner)
        wait_for(lambda: len(rounds(tmp_path, "d")) >= 4, 90, "d to join and commit")
        stop.write_text(str(rounds(tmp_path, "a")[-1]["outer_steps"] + 4))
        finish_all({"a": procs["a"], "b": procs["b"], "d": joiner}, tmp_path, 120)
    _assert_equal(tmp_path, "abd")
    # The survivors in the round c died in abandoned it. Which survivors were in it depends on
    # when each started: b and c may have met before a came (a then joined later, healed).
    abandoned = [
        (name, r)
        for name in "ab"
        for r in rounds(tmp_path, name)
        if not r["applied"] and not r["joined"] and float(r["t"]) <= killed_at + 30
    ]
    assert abandoned, "no survivor abandoned the round c died in"
    heal = [r for r in rounds(tmp_path, "d") if r["joined"]][-1]
    assert heal["heals"] >= 1 and heal["applied"], heal
    assert heal["anchors"] == anchors_by_round(tmp_path, "a")[heal["outer_steps"]]


@pytest.mark.slow  # ~12 s; a heal mid-stream runs by default (the kill test above)
@pytest.mark.timeout(300)
def test_a_frozen_island_with_a_fragment_round_in_flight_is_healed(tmp_path: Path) -> None:
    """c stops itself (SIGSTOP) in the quantized mean of a fragment round running on its
    worker; a and b commit rounds without it. Continued, c takes that round as abandoned, is
    healed at another fragment of the swarm's schedule, adopts the swarm's round, commits
    again, and a, b and c end bitwise equal."""
    started: list[subprocess.Popen[bytes]] = []
    with lighthouse(heartbeat_timeout_ms=1500) as address, reaped(started):
        stop = tmp_path / "stop"
        opts = [*STREAM, *TIMEOUTS, "--rounds", "10000", "--step-s", "0.03"]
        opts += ["--stop-file", str(stop)]
        procs = {n: start_island(tmp_path, address, n, *opts) for n in "ab"}
        procs["c"] = start_island(tmp_path, address, "c", *opts, "--fault", "mean:5:freeze")
        started.extend(procs.values())
        wait_for((tmp_path / "c.freeze").exists, 90, "c to stop itself in the mean")
        frozen_at = time.time()
        wait_for(
            lambda: len([r for r in _committed(tmp_path, "a") if float(r["t"]) > frozen_at]) >= 3,
            60,
            "a's rounds without c",
        )
        heals_before = rounds(tmp_path, "c")[-1]["heals"]
        procs["c"].send_signal(signal.SIGCONT)
        continued_at = time.time()
        wait_for(
            lambda: any(
                r["heals"] > heals_before and float(r["t"]) > continued_at
                for r in _committed(tmp_path, "c")
            ),
            90,
            "c to be healed and commit again",
        )
        stop.write_text(str(max(r["outer_steps"] for r in rounds(tmp_path, "a")) + 4))
        finish_all(procs, tmp_path, 90)
    _assert_equal(tmp_path, "abc")
    c_log = rounds(tmp_path, "c")
    after = [r for r in c_log if float(r["t"]) > continued_at]
    assert not after[0]["applied"]  # the round frozen in flight was abandoned
