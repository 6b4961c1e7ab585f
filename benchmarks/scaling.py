"""Bytes per rank and round time of each wire against the number of islands, on CPU over gloo.

For each island count in ``--islands`` (2 3 4 8), spawns that many processes (one rank per
island) on this machine, connected over loopback gloo, each holding a different pseudo-gradient
of ``--mb`` MiB of float32 (a few tensors of uneven sizes). Per repetition every method runs one
round in turn (interleaved, so machine noise spreads over all of them), on a fresh copy of the
rank's payload, after a barrier:

- ``fp32 allreduce``: ``AllReduceTransport`` (``quantize="none"``);
- ``int8 rs`` / ``int4 rs``: ``ReduceScatterTransport``, what ``quantize="int8"`` / ``"int4"``
  builds (block 128);
- ``swarm``: ``SwarmAggregator`` (``transport="swarm"``: the rotating aggregator, spool on
  disk, float32, default options);
- ``swarm sharded``: ``SwarmAggregator(owners="sharded")`` (``swarm.aggregator="sharded"``): every
  island aggregates 1/n of the payload, same spool and defaults.

A round's time is the slowest rank's ``average`` wall time; reported: the median over
``--reps`` repetitions after ``--warmup``, and min-max. Before the rounds, ranks 0 and 1
measure the loopback link itself (a ping-pong of 1 byte and of 16 MiB): the latency and
bandwidth the model takes as given. Bytes are the transports' own
``RoundStats`` (what the collectives move to and from other ranks); for each method the
busiest rank's. ``benchmarks/scaling_model.py`` fits a latency + bandwidth model to the JSON this
writes and projects it to many islands (docs/scaling.md).

Run:   PYTHONPATH=. .venv/bin/python benchmarks/scaling.py --json docs/scaling_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport import (
    AllReduceTransport,
    ReduceScatterTransport,
    SwarmAggregator,
    Transport,
)
from tests.transport_rounds import average

METHODS = ("fp32 allreduce", "int8 rs", "int4 rs", "swarm", "swarm sharded")
BLOCK_SIZE = 128
BUCKET_MB = 32.0  # the strategy's default bucket_mb
PROBE_BYTES = 16 * 2**20


def payload(mib: float, rank: int) -> dict[str, torch.Tensor]:
    """About ``mib`` MiB of float32 in four tensors of uneven sizes, different on each rank."""
    total = int(mib * 2**20 / 4)
    sizes = [total // 2, total // 4, total // 4 - 1001, 1001]
    g = torch.Generator().manual_seed(1000 + rank)
    return {f"t{i}": torch.randn(n, generator=g) * 1e-3 for i, n in enumerate(sizes)}


def build(method: str, world: int, rank: int, spool_dir: str) -> Transport:
    bucket_numel = int(BUCKET_MB * 2**20) // 4
    if method == "fp32 allreduce":
        return AllReduceTransport(None, num_islands=world, bucket_numel=bucket_numel)
    if method == "swarm":
        return SwarmAggregator(None, num_islands=world, island_index=rank, spool_dir=spool_dir)
    if method == "swarm sharded":
        return SwarmAggregator(
            None, owners="sharded", num_islands=world, island_index=rank, spool_dir=spool_dir
        )
    codec = Codec(method.split()[0], BLOCK_SIZE)
    return ReduceScatterTransport(
        None, num_islands=world, island_index=rank, codec=codec, bucket_numel=bucket_numel
    )


def probe_link(rank: int, tiny_reps: int = 50, big_reps: int = 3) -> list[float]:
    """Ranks 0 and 1 ping-pong: [one-way latency (s), bandwidth (bytes/s)] of this loopback
    link, measured with one message of 1 byte and one of ``PROBE_BYTES``; the others wait."""
    result = [0.0, 0.0]
    if rank in (0, 1):
        peer = 1 - rank
        for size, reps in ((1, tiny_reps), (PROBE_BYTES, big_reps)):
            buf = torch.zeros(size, dtype=torch.uint8)
            start = time.perf_counter()
            for _ in range(reps):
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            one_way = (time.perf_counter() - start) / (2 * reps)
            if size == 1:
                result[0] = one_way
            else:
                result[1] = size / max(one_way - result[0], 1e-9)
    dist.barrier()
    return result


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)  # n processes share this machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        link = probe_link(rank)
        base = payload(args["mb"], rank)
        with tempfile.TemporaryDirectory(prefix="scaling-spool-") as spool_dir:
            transports = {m: build(m, world, rank, spool_dir) for m in args["methods"]}
            rows: dict[str, list[list[float]]] = {m: [] for m in args["methods"]}
            for rep in range(args["warmup"] + args["reps"]):
                for method, transport in transports.items():
                    tensors = {k: v.clone() for k, v in base.items()}
                    dist.barrier()
                    start = time.perf_counter()
                    stats = average(transport, tensors, round_index=rep)
                    wall = time.perf_counter() - start
                    mine = torch.tensor(
                        [wall, stats.bytes_sent, stats.bytes_received], dtype=torch.float64
                    )
                    every = [torch.empty_like(mine) for _ in range(world)]
                    dist.all_gather(every, mine)
                    if rep >= args["warmup"]:
                        rows[method].append([float(x) for e in every for x in e])
            for transport in transports.values():
                transport.close()
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "link": link}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One spawned run at ``world`` islands; per method its round times and busiest bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.start_processes(
            _worker, args=(world, _free_port(), args, out), nprocs=world, start_method="spawn"
        )
        measured = json.loads(Path(out).read_text())
    rows = measured["rows"]
    result: dict[str, Any] = {
        "link": {"latency_s": measured["link"][0], "bytes_per_s": measured["link"][1]}
    }
    for method, reps in rows.items():
        times = [max(rep[3 * r] for r in range(world)) for rep in reps]
        sent = [rep[3 * r + 1] for r in range(world) for rep in reps[:1]]
        received = [rep[3 * r + 2] for r in range(world) for rep in reps[:1]]
        result[method] = {
            "time_s": statistics.median(times),
            "time_min_s": min(times),
            "time_max_s": max(times),
            "bytes_sent_per_rank": sent,
            "bytes_received_per_rank": received,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--islands", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--mb", type=float, default=16.0, help="float32 payload per rank, MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    args = {"mb": ns.mb, "reps": ns.reps, "warmup": ns.warmup, "methods": ns.methods}
    payload_bytes = sum(t.numel() * 4 for t in payload(ns.mb, 0).values())
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores, shared with other work; loopback gloo",
        "torch": torch.__version__,
        "payload_bytes": payload_bytes,
        "block_size": BLOCK_SIZE,
        "bucket_mb": BUCKET_MB,
        "args": args,
        "islands": {},
    }
    for world in ns.islands:
        result = measure(world, args)
        report["islands"][str(world)] = result
        link = result["link"]
        print(
            f"n={world} link: one-way latency {1e6 * link['latency_s']:.0f} us, "
            f"{link['bytes_per_s'] / 1e9:.2f} GB/s",
            flush=True,
        )
        for method in ns.methods:
            r = result[method]
            busiest = max(max(r["bytes_sent_per_rank"]), max(r["bytes_received_per_rank"]))
            print(
                f"n={world} {method:15s} round {r['time_s']:.3f} s "
                f"[{r['time_min_s']:.3f}-{r['time_max_s']:.3f}]  busiest rank "
                f"{busiest / payload_bytes:.3f} x fp32 payload",
                flush=True,
            )
    if ns.json is not None:
        ns.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
