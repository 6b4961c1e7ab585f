"""Sync time against the block size: why ``bucket_mb`` and ``swarm.chunk_mb`` have a floor.

Forks 2 ranks over gloo on this machine, gives each a 16 MiB float32 pseudo-gradient, and times
one round of the all-reduce transport at several ``bucket_mb`` and of the swarm transport
(offload on, island 0 aggregates) at several ``chunk_mb``; the median of 3 rounds, max over
ranks. Tiny blocks pay a fixed cost per message (a gloo round trip, a Python loop turn, a
positional write), so the time grows about as payload / block once blocks fall below ~1 MiB.

Run: PYTHONPATH=. .venv/bin/python benchmarks/block_size_cost.py [--sizes-mb 0.0625 0.25 1 4 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_swarm.transport import AllReduceTransport, SwarmAggregator
from tests.dist_utils import free_port
from tests.transport_rounds import average

MIB = 2**20
PAYLOAD_MIB = 16


def _rank(rank: int, world: int, port: int, sizes: list[float], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    tensors = {"w": torch.randn(PAYLOAD_MIB * MIB // 4)}
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as spool_dir:
        for size in sizes:
            for kind in ("allreduce", "swarm"):
                if kind == "allreduce":
                    t = AllReduceTransport(
                        None, num_islands=world, bucket_numel=int(size * MIB) // 4
                    )
                else:
                    t = SwarmAggregator(
                        None,
                        num_islands=world,
                        island_index=rank,
                        spool_dir=spool_dir,
                        chunk_bytes=int(size * MIB),
                    )
                times = []
                for _ in range(3):
                    x = {k: v.clone() for k, v in tensors.items()}
                    dist.barrier()
                    start = time.perf_counter()
                    average(t, x, round_index=0)
                    times.append(time.perf_counter() - start)
                t.close()
                results[f"{kind} {size}"] = statistics.median(times)
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sizes-mb", type=float, nargs="+", default=[1 / 64, 1 / 16, 0.25, 1, 4, 32]
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank, args=(2, free_port(), args.sizes_mb, out), nprocs=2, start_method="fork"
        )
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    print(f"payload {PAYLOAD_MIB} MiB, 2 gloo ranks, torch {torch.__version__}")
    print("| block MiB | all-reduce s (bucket_mb) | swarm s (chunk_mb) |\n|---|---|---|")
    for size in args.sizes_mb:
        a = max(r[f"allreduce {size}"] for r in ranks)
        s = max(r[f"swarm {size}"] for r in ranks)
        print(f"| {size:g} | {a:.3f} | {s:.3f} |")


if __name__ == "__main__":
    main()
