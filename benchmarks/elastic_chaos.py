"""Chaos on elastic islands: a seeded schedule of kills, freezes, restarts, joins and lighthouse
restarts for N minutes, then a check that every island that finishes holds the same model.

Four islands (a, b, c, d; each its own process running this file with ``--island``: a small
model, a deterministic per-island update, an outer round every ``--every`` inner steps through
``TorchftMembership``) meet at a lighthouse (``swarm-lighthouse`` as its own process, so it can
be SIGKILLed and restarted on its port). Every ``--event-s`` seconds the controller draws one
event from a seeded generator; at most one island is down at a time, so two or more stay live:

- kill: SIGKILL an island, restart it (same id) a few seconds later; it is healed on its join;
- freeze: SIGSTOP an island for 5-25 s, then SIGCONT; it must take its expired round as
  abandoned, be healed, and go on;
- join: stop an island for good (SIGKILL) and start a new island id in its place;
- lighthouse: SIGKILL the lighthouse and restart it on its port 2-8 s later (within the
  islands' ``quorum_timeout_s``): the islands must go on.

A survivor crash is an island process that exits before the end without having been killed by
the controller. At the end the controller waits ``--settle-s`` seconds with no events, asks every
island to stop at a round a little ahead of the swarm, and compares their final anchors and
parameters bitwise. Reported: events by kind, committed rounds (the swarm's outer steps),
abandoned rounds (summed over islands), survivor crashes, heals and their times, seconds from a
kill or a lighthouse restart to the survivors' next committed round, and whether the finishers
end equal.

Run: .venv/bin/python benchmarks/elastic_chaos.py --minutes 10 [--seed 0] [--results out.json]
[--streaming] (``--streaming``: every island runs Streaming DiLoCo, 2 fragments, ``sync_delay``
1, int8 with error feedback).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.algorithm.fragments import build_fragments
from lightning_swarm.algorithm.model_layout import model_layout
from lightning_swarm.config import SwarmConfig
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.round_header import swarm_settings
from lightning_swarm.membership.torchft_quorum import TorchftMembership
from lightning_swarm.outer.sync import OuterSync
from lightning_swarm.outer.sync_state import StreamingOptions
from lightning_swarm.outer.worker import SyncWorker

ROOT = Path(__file__).resolve().parents[1]
QUORUM_TIMEOUT_S = 30.0
ROUND_TIMEOUT_S = 10.0


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# -- one island (run as its own process) ------------------------------------------------------
def island(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    params = dict(model.named_parameters())
    out = Path(args.out)
    # --streaming: Streaming DiLoCo (2 fragments, sync_delay 1, int8 with error feedback).
    config = SwarmConfig(sync_every=args.every)
    if args.streaming:
        config = SwarmConfig(
            sync_every=args.every,
            num_fragments=2,
            sync_delay=1,
            quantize="int8",
            error_feedback=True,
        )
    membership = TorchftMembership(
        ElasticConfig(
            args.lighthouse,
            args.island,
            min_islands=2,
            quorum_timeout_s=QUORUM_TIMEOUT_S,
            round_timeout_s=ROUND_TIMEOUT_S,
        ),
        layout=model_layout(params),
        codec=codec_for(config.quantize),
    )
    sgd = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterSync(
        params,
        outer_optimizer=sgd,
        transport=membership,
        sync_every=args.every,
        streaming=StreamingOptions(
            fragments=build_fragments(list(params), config.num_fragments),
            sync_delay=config.sync_delay,
            codec=codec_for(config.quantize),
            error_feedback=config.error_feedback,
            worker=SyncWorker() if config.sync_delay > 0 else None,
        ),
    )
    membership.agree_on(swarm_settings(config, outer.outer_optimizer))
    seed = int(hashlib.sha256(args.island.encode()).hexdigest()[:8], 16)
    stop_file, last_round = out / "stop", None
    with (out / f"{args.island}.jsonl").open("a") as log:

        def record(applied: bool, joined: bool) -> None:
            totals = membership.totals
            row = {"t": time.time(), "outer_steps": outer.outer_steps, "applied": applied}
            row.update(joined=joined, islands=totals.islands_in_round, heals=totals.heals)
            row.update(heal_time_s=totals.heal_time_s, pid=os.getpid())
            log.write(json.dumps(row) + "\n")
            log.flush()

        record(outer.join().applied, joined=True)
        while last_round is None or outer.outer_steps < last_round:
            gen = torch.Generator().manual_seed(seed * 100_003 + outer.inner_steps)
            with torch.no_grad():
                for p in params.values():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.01 - 0.05 * p)
            time.sleep(args.step_s)
            report = outer.on_inner_step()
            if report is not None:
                record(report.applied, joined=False)
                if stop_file.exists():
                    last_round = int(stop_file.read_text())
    # With fragments the other fragment's parameters hold local progress: compare the global
    # model, as an elastic fit ends (land_on_anchors); no round is in flight after an apply.
    outer.land_on_anchors()
    final = {"anchors": _digest(outer.anchors), "params": _digest(params)}
    (out / f"{args.island}.final.json").write_text(json.dumps(final))
    membership.close()
    os._exit(0)


# -- the controller ----------------------------------------------------------------------------
@dataclass
class Swarm:
    out: Path
    port: int
    every: int
    step_s: float
    streaming: bool = False
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)  # pids the controller killed
    crashes: list[str] = field(default_factory=list)
    lighthouse: subprocess.Popen[str] | None = None
    joined: int = 0  # new island ids started so far (n0, n1, ...)

    def start_lighthouse(self) -> float:
        cmd = [sys.executable, "-m", "lightning_swarm.membership.lighthouse", "--bind"]
        cmd += ["127.0.0.1", "--port", str(self.port), "--min-islands", "2"]
        cmd += ["--heartbeat-timeout-ms", "2000"]
        with (self.out / "lighthouse.log").open("a") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        assert proc.stdout is not None and proc.stdout.readline().startswith("lighthouse at")
        self.lighthouse = proc
        return time.time()

    def start(self, name: str) -> None:
        cmd = [sys.executable, __file__, "--island", name, "--out", str(self.out)]
        cmd += ["--lighthouse", f"http://127.0.0.1:{self.port}", "--every", str(self.every)]
        cmd += ["--step-s", str(self.step_s)] + (["--streaming"] if self.streaming else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with (self.out / f"{name}.stderr").open("ab") as err:
            self.procs[name] = subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL, env=env)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        self.killed.add(proc.pid)
        proc.kill()
        proc.wait()

    def check_crashes(self) -> None:
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                tail = (self.out / f"{name}.stderr").read_text(errors="replace")[-600:]
                self.crashes.append(f"{name} exited {proc.returncode}: {tail}")
                del self.procs[name]

    def rows(self, name: str) -> list[dict[str, Any]]:
        path = self.out / f"{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _first_commit_after(swarm: Swarm, names: list[str], t: float) -> float | None:
    times = [r["t"] for n in names for r in swarm.rows(n) if r["applied"] and r["t"] > t]
    return min(times) - t if times else None


def _wait(seconds: float, swarm: Swarm) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        swarm.check_crashes()
        time.sleep(0.2)


Mark = tuple[str, float, list[str]]
"""(kind, when, the islands expected to commit next): recovery times are read at the end."""


def _event(swarm: Swarm, rng: random.Random, kind: str, victim: str, event_s: float) -> Mark | None:
    """Run one event of the schedule; returns what to measure the recovery from."""
    mark: Mark | None = None
    if kind in ("kill", "join"):
        swarm.kill(victim)
        at = time.time()
        _wait(rng.uniform(2, 8), swarm)
        others = sorted(swarm.procs)
        if kind == "join":
            victim = f"n{swarm.joined}"
            swarm.joined += 1
        swarm.start(victim)
        mark = ("kill", at, others)
    elif kind == "freeze":
        proc = swarm.procs[victim]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(5, 25))  # the schedule itself: how long it stays stopped
        proc.send_signal(signal.SIGCONT)
    else:
        assert swarm.lighthouse is not None
        swarm.lighthouse.kill()
        swarm.lighthouse.wait()
        _wait(rng.uniform(2, 8), swarm)
        mark = ("lighthouse", swarm.start_lighthouse(), sorted(swarm.procs))
    _wait(event_s, swarm)
    return mark


def _finish(swarm: Swarm) -> dict[str, dict[str, str]]:
    """Stop every running island at one round a little ahead; their final digests."""
    finishers = sorted(swarm.procs)
    last = max((r["outer_steps"] for n in finishers for r in swarm.rows(n)), default=0)
    (swarm.out / "stop").write_text(str(last + 5))
    deadline = time.monotonic() + 120
    for name in finishers:
        code = swarm.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            swarm.crashes.append(f"{name} exited {code} at the end")
    assert swarm.lighthouse is not None
    swarm.lighthouse.kill()
    swarm.lighthouse.wait()
    finals = {n: swarm.out / f"{n}.final.json" for n in finishers}
    # An island that crashed at the end is in swarm.crashes and has no final digests.
    return {n: json.loads(path.read_text()) for n, path in finals.items() if path.exists()}


def chaos(
    minutes: float, seed: int, event_s: float, settle_s: float, out: Path, streaming: bool = False
) -> dict[str, Any]:
    rng = random.Random(seed)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    swarm = Swarm(out, port, every=4, step_s=0.05, streaming=streaming)
    swarm.start_lighthouse()
    for name in "abcd":
        swarm.start(name)
    events: dict[str, int] = {}
    marks: list[Mark] = []
    end = time.monotonic() + minutes * 60
    _wait(event_s, swarm)
    while time.monotonic() < end:
        kind = rng.choice(["kill", "freeze", "join", "lighthouse"])
        events[kind] = events.get(kind, 0) + 1
        victim = rng.choice(sorted(swarm.procs))
        with (out / "events.log").open("a") as log:
            log.write(f"{time.time():.3f} {kind} {victim if kind != 'lighthouse' else ''}\n")
        mark = _event(swarm, rng, kind, victim, event_s)
        if mark is not None:
            marks.append(mark)
    _wait(settle_s, swarm)
    finals = _finish(swarm)
    return _report(swarm, marks, events, finals) | {"minutes": minutes, "seed": seed}


def _report(
    swarm: Swarm, marks: list[Mark], events: dict[str, int], finals: dict[str, dict[str, str]]
) -> dict[str, Any]:
    every_rows = [r for p in swarm.out.glob("*.jsonl") for r in _rows(p)]
    heal_times = _heal_times(swarm.out)
    recovery = {
        kind: [_first_commit_after(swarm, names, t) for k, t, names in marks if k == kind]
        for kind in ("kill", "lighthouse")
    }
    return {
        "events": events,
        "committed_rounds": max(r["outer_steps"] for r in every_rows),
        "abandoned_rounds": sum(1 for r in every_rows if not r["applied"] and not r["joined"]),
        "survivor_crashes": len(swarm.crashes),
        "crash_tails": swarm.crashes,
        "heals": len(heal_times),
        "heal_s_median": statistics.median(heal_times) if heal_times else None,
        "heal_s_max": max(heal_times) if heal_times else None,
        # seconds to the next commit of a survivor (None: none committed after it)
        "kill_to_commit_s": recovery["kill"],
        "lighthouse_back_to_commit_s": recovery["lighthouse"],
        "finishers": sorted(finals),
        "finishers_equal": len({json.dumps(f, sort_keys=True) for f in finals.values()}) == 1,
    }


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _heal_times(out: Path) -> list[float]:
    """Each heal's receive time, from the growth of each process's heal totals."""
    times = []
    for path in out.glob("*.jsonl"):
        last: dict[int, tuple[int, float]] = {}
        for row in _rows(path):
            heals, spent = last.get(row["pid"], (0, 0.0))
            if row["heals"] > heals:
                times.append((row["heal_time_s"] - spent) / (row["heals"] - heals))
            last[row["pid"]] = (row["heals"], row["heal_time_s"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--event-s", type=float, default=15.0, help="between events")
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--results", default=None, help="write the figures as JSON here")
    parser.add_argument("--keep", default=None, help="keep the islands' logs in this directory")
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="Streaming DiLoCo: 2 fragments, sync_delay 1, int8 with error feedback",
    )
    parser.add_argument("--island", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--every", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--step-s", type=float, default=0.05, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.island is not None:
        island(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        results = chaos(
            args.minutes, args.seed, args.event_s, args.settle_s, out, streaming=args.streaming
        )
    print(json.dumps(results, indent=2))
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
