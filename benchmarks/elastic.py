"""Elastic islands on torchft: the three figures of docs/elastic.md, on this machine's CPU.

1. overhead: the same 2-island workload (``--mb`` MiB of float32 parameters, ``--rounds``
   rounds, no inner compute) averaged once with ``membership="static"`` (``AllReduceTransport``
   over a 2-rank gloo world) and once with ``membership="torchft"`` (``TorchftMembership``:
   quorum, round header, the same bucketed mean, commit gate). Per-round wall time of
   ``average`` as the training thread sees it; median over the rounds after the first.
2. heal: islands a and b train; c starts mid-run and is healed from a live island: anchors
   plus the outer optimizer's momentum (2x the anchor bytes). Reported: bytes moved, seconds
   (``swarm/heal_time_s``: the receive, inside the quorum), seconds per GB.
3. kill: three islands with ``--kill-step-s`` seconds of inner steps per round; c is SIGKILLed
   mid-run; reported: seconds from the kill to a's next committed round (the lighthouse's
   heartbeat timeout, here 2 s, bounds most of it).

Run: .venv/bin/python benchmarks/elastic.py [--mb 64] [--rounds 12] [--heal-mb 256]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_swarm.algorithm.model_layout import model_layout
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.torchft_quorum import TorchftMembership
from lightning_swarm.outer.sync import OuterSync
from lightning_swarm.transport import AllReduceTransport

BUCKET = 8 << 20


def _params(mb: float) -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(0)
    numel = int(mb * 2**20) // 4
    return {f"p{i}": torch.nn.Parameter(torch.randn(numel // 4)) for i in range(4)}


def _outer(params: dict[str, torch.nn.Parameter], transport: Any, every: int) -> OuterSync:
    sgd = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    return OuterSync(params, outer_optimizer=sgd, transport=transport, sync_every=every)


def _train(outer: OuterSync, rounds: int, step_s: float, log: Path) -> None:
    times: list[float] = []
    with log.open("a") as f:
        while outer.outer_steps < rounds:
            with torch.no_grad():
                for p in outer.params.values():
                    p.add_(1e-3)
            time.sleep(step_s)
            report = outer.on_inner_step()
            if report is not None:
                times.append(report.transport_s)
                row = {"t": time.time(), "applied": report.applied, "s": report.transport_s}
                f.write(json.dumps(row) + "\n")
                f.flush()


def elastic_island(
    name: str, address: str, mb: float, rounds: int, step_s: float, min_islands: int, out: str
) -> None:
    torch.set_num_threads(1)
    params = _params(mb)
    membership = TorchftMembership(
        ElasticConfig(
            address, name, min_islands=min_islands, quorum_timeout_s=120, round_timeout_s=60
        ),
        layout=model_layout(params),
        bucket_numel=BUCKET,
    )
    outer = _outer(params, membership, every=1)
    outer.join()
    _train(outer, rounds, step_s, Path(out) / f"{name}.jsonl")
    totals = membership.totals
    Path(out, f"{name}.heal.json").write_text(
        json.dumps({"bytes": totals.heal_bytes, "s": totals.heal_time_s})
    )
    membership.close()


def static_rank(rank: int, port: int, mb: float, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    transport = AllReduceTransport(None, num_islands=2, bucket_numel=BUCKET)
    _train(_outer(_params(mb), transport, every=1), rounds, 0.0, Path(out) / f"static{rank}.jsonl")
    dist.destroy_process_group()


def _lighthouse(min_islands: int) -> Any:
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_islands,
        join_timeout_ms=2000,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=2000,
    )


def _round_times(path: Path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["s"] for r in rows[1:] if r["applied"]]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(procs: list[Any]) -> None:
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a benchmark process exited with {proc.exitcode}")


def overhead(mb: float, rounds: int, out: Path) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    _run([ctx.Process(target=static_rank, args=(r, port, mb, rounds, str(out))) for r in (0, 1)])
    server = _lighthouse(2)
    try:
        _run(
            [
                ctx.Process(
                    target=elastic_island, args=(n, server.address(), mb, rounds, 0.0, 2, str(out))
                )
                for n in "ab"
            ]
        )
    finally:
        server.shutdown()
    static = statistics.median(_round_times(out / "static0.jsonl"))
    elastic = statistics.median(_round_times(out / "a.jsonl"))
    return {
        "mb": mb,
        "static_round_s": static,
        "torchft_round_s": elastic,
        "overhead_s": elastic - static,
    }


def heal(mb: float, out: Path) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    server = _lighthouse(2)
    try:
        live = [
            ctx.Process(target=elastic_island, args=(n, server.address(), mb, 30, 0.2, 2, str(out)))
            for n in ("ha", "hb")
        ]
        for proc in live:
            proc.start()
        while not (out / "ha.jsonl").exists() or len((out / "ha.jsonl").read_text().split()) < 3:
            time.sleep(0.05)
        _run(
            [
                ctx.Process(
                    target=elastic_island, args=("hc", server.address(), mb, 30, 0.2, 2, str(out))
                )
            ]
        )
        for proc in live:
            proc.join()
    finally:
        server.shutdown()
    healed = json.loads((out / "hc.heal.json").read_text())
    return {
        "heal_bytes": healed["bytes"],
        "heal_s": healed["s"],
        "s_per_gb": healed["s"] / (healed["bytes"] / 1e9),
    }


def kill(out: Path, step_s: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    server = _lighthouse(2)
    try:
        procs = {
            n: ctx.Process(
                target=elastic_island, args=(n, server.address(), 1.0, 60, step_s, 2, str(out))
            )
            for n in ("ka", "kb", "kc")
        }
        for proc in procs.values():
            proc.start()
        while not (out / "kc.jsonl").exists() or len((out / "kc.jsonl").read_text().split()) < 5:
            time.sleep(0.05)
        assert procs["kc"].pid is not None
        os.kill(procs["kc"].pid, signal.SIGKILL)
        killed = time.time()
        procs["ka"].join()
        procs["kb"].join()
    finally:
        server.shutdown()
    rows = [json.loads(line) for line in (out / "ka.jsonl").read_text().splitlines()]
    after = [r for r in rows if r["t"] > killed and r["applied"]]
    return {"kill_to_commit_s": after[0]["t"] - killed, "round_s_before_kill": step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--heal-mb", type=float, default=256.0)
    parser.add_argument("--kill-step-s", type=float, default=0.2)
    parser.add_argument("--results", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results["overhead"] = overhead(args.mb, args.rounds, out)
        print("overhead", results["overhead"], flush=True)
        results["heal"] = heal(args.heal_mb, out)
        print("heal", results["heal"], flush=True)
        results["kill"] = kill(out, args.kill_step_s)
        print("kill", results["kill"], flush=True)
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
