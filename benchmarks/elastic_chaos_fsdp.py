"""Chaos on elastic FSDP islands: single ranks killed and frozen, islands restarted, then a
check that every island that finishes holds the same full parameters.

Three islands (a, b, c) of two ranks each, ``membership="torchft"`` with
``island_parallel="fsdp"``: each a Lightning launch of ``tests/elastic_lightning_island.py
--fsdp --devices 2`` (two Linear(8, 8) layers sharded 4 + 4 rows over the island's two ranks,
SGD inside, Nesterov outside, a round every 4 inner steps). Every ``--event-s`` seconds the
controller draws one event from a seeded generator, on one island at a time:

- kill: SIGKILL one rank (drawn) of an island; its other rank must leave too (never half an
  island in a round); the island is launched again 2-8 s later and heals shard by shard;
- freeze: SIGSTOP one rank for 5-25 s, then SIGCONT; its island must rejoin (abandoning or
  healing as needed) and go on.

A survivor crash is an island process that exits before the end without one of its ranks
having been killed by the controller. At the end the controller waits ``--settle-s`` seconds
with no events, names a round a few rounds ahead in a stop file, waits for every island to end
there, and compares the finishers' full parameters (each rank's gathered copy) bitwise.

Run: PYTHONPATH=. .venv/bin/python benchmarks/elastic_chaos_fsdp.py --minutes 5 [--seed 0]
[--results out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from tests.elastic_utils import lighthouse, rounds, start_island

SCRIPT = "tests/elastic_lightning_island.py"
ISLANDS = "abc"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


@dataclass
class Swarm:
    out: Path
    address: str
    options: list[str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)  # launches with a rank the controller killed
    crashes: list[str] = field(default_factory=list)
    launches: dict[str, int] = field(default_factory=dict)

    def start(self, name: str) -> None:
        for rank in (0, 1):  # a fresh launch writes its own
            (self.out / f"{name}.pid.rank{rank}").unlink(missing_ok=True)
        self.procs[name] = start_island(self.out, self.address, name, *self.options, script=SCRIPT)
        self.launches[name] = self.launches.get(name, 0) + 1

    def pids(self, name: str, timeout_s: float = 120.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        files = [self.out / f"{name}.pid.rank{r}" for r in (0, 1)]
        while not all(f.exists() and f.read_text() for f in files):
            if time.monotonic() > deadline:
                raise AssertionError(f"island {name} did not start its two ranks")
            time.sleep(0.1)
        return [int(f.read_text()) for f in files]

    def check_crashes(self) -> None:
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None and name not in self.killed:
                tail = (self.out / f"{name}.stderr").read_text(errors="replace")[-800:]
                self.crashes.append(f"{name} exited {proc.returncode}: {tail}")
                del self.procs[name]


def _wait(seconds: float, swarm: Swarm) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        swarm.check_crashes()
        time.sleep(0.2)


def _event(swarm: Swarm, rng: random.Random, kind: str, victim: str, rank: int) -> dict:
    pids = swarm.pids(victim)
    record: dict[str, Any] = {"kind": kind, "island": victim, "rank": rank, "t": time.time()}
    if kind == "kill":
        swarm.killed.add(victim)
        os.kill(pids[rank], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        record["island_left_s"] = time.time() - record["t"]
        record["half_left_behind"] = any(_alive(p) for p in pids)
        for pid in pids:  # a rank that did not leave is taken out, and counted above
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        swarm.procs.pop(victim).wait()
        _wait(rng.uniform(2, 8), swarm)
        swarm.killed.discard(victim)
        swarm.start(victim)
    else:
        os.kill(pids[rank], signal.SIGSTOP)
        time.sleep(rng.uniform(5, 25))
        os.kill(pids[rank], signal.SIGCONT)
    return record


def chaos(minutes: float, seed: int, event_s: float, settle_s: float, out: Path) -> dict:
    rng = random.Random(seed)
    stop = out / "stop"
    options = ["--devices", "2", "--width", "0", "--every", "4", "--fsdp", "--max-steps"]
    options += ["1000000", "--step-s", "0.1", "--quorum-timeout", "60", "--stop-file", str(stop)]
    events: list[dict] = []
    with lighthouse(heartbeat_timeout_ms=2000) as address:
        swarm = Swarm(out, address, options)
        try:
            for name in ISLANDS:
                swarm.start(name)
            _wait(event_s, swarm)
            end = time.monotonic() + minutes * 60
            while time.monotonic() < end:
                kind = rng.choice(["kill", "freeze"])
                victim, rank = rng.choice(sorted(swarm.procs)), rng.choice([0, 1])
                events.append(_event(swarm, rng, kind, victim, rank))
                _wait(event_s, swarm)
            _wait(settle_s, swarm)
            last = max((r["swarm/outer_steps"] for n in ISLANDS for r in rounds(out, n)), default=0)
            stop.write_text(str(int(last) + 5))
            finishers = sorted(swarm.procs)
            for name in finishers:
                code = swarm.procs[name].wait(timeout=300)
                if code != 0:
                    swarm.crashes.append(f"{name} exited {code} at the end")
        finally:
            for proc in swarm.procs.values():
                proc.kill()
    states = {
        f"{n}.rank{r}": load_file(str(out / f"{n}.rank{r}.safetensors"))
        for n in finishers
        for r in (0, 1)
        if (out / f"{n}.rank{r}.safetensors").exists()
    }
    reference = next(iter(states.values()))
    equal = len(states) == 2 * len(finishers) and all(
        all(v.equal(s[k]) for k, v in reference.items()) for s in states.values()
    )
    every = [r for n in ISLANDS for r in rounds(out, n)]
    return {
        "minutes": minutes,
        "seed": seed,
        "events": {k: sum(e["kind"] == k for e in events) for k in ("kill", "freeze")},
        "event_log": events,
        "launches": swarm.launches,
        "committed_rounds": max(int(r["swarm/outer_steps"]) for r in every),
        "survivor_crashes": len(swarm.crashes),
        "crash_tails": swarm.crashes,
        "half_islands_left_behind": sum(bool(e.get("half_left_behind")) for e in events),
        "finishers": finishers,
        "finishers_equal_full_parameters": equal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--event-s", type=float, default=15.0)
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--results", default=None)
    parser.add_argument("--keep", default=None, help="keep the islands' logs in this directory")
    args = parser.parse_args()
    if args.keep:
        out = Path(args.keep)
        out.mkdir(parents=True, exist_ok=True)
        report = chaos(args.minutes, args.seed, args.event_s, args.settle_s, out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = chaos(args.minutes, args.seed, args.event_s, args.settle_s, Path(tmp))
    text = json.dumps(report, indent=2)
    print(text)
    if args.results:
        Path(args.results).write_text(text + "\n")


if __name__ == "__main__":
    main()
