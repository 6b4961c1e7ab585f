"""Aggregator host memory of the swarm transport against the number of peers, and all-reduce's.

For each number of islands (2, 4, 8) and each transport setting, forks that many ranks over
gloo, gives each a ~256 MiB pseudo-gradient (a GPT-like layout: one 128 MiB embedding plus
32 matrices of 4 MiB and their biases) and runs one round with island 0 as the aggregator.

What is measured is what the transport adds during one round, nothing else: the payload is
built as the one flat float32 buffer the round engine holds (``tests.transport_rounds.
average_flat`` runs the round on it in place) and the transport is built, before the window.
Island 0 then resets its VmHWM (``/proc/self/clear_refs``), reads its VmRSS and RssAnon (the
*baseline*), samples both every millisecond in a thread during the round, and reads VmHWM
after it. *extra RSS* is the larger of the sampled peak and VmHWM, above the baseline;
*extra anon* is the sampled RssAnon peak above its baseline: the part the kernel cannot drop
(the rest of RSS is file pages, e.g. spool files mapped for reading).

Also reported: the spool's peak disk use, and the wall time of the round for each transport on
the same payload and ranks (max over ranks).

``--kinds ... swarm_sharded`` adds the sharded swarm transport (``swarm.aggregator="sharded"``),
where every island aggregates its part; island 0 is measured all the same.

Run from the repository root (it imports ``tests``):
    PYTHONPATH=. .venv/bin/python benchmarks/swarm_aggregator_memory.py [--peers 2 4 8]
        [--chunk-mb 4] [--kinds swarm_offload swarm_sharded allreduce]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_swarm.memory.procfs import ProcReader
from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from tests.transport_rounds import average_flat

MIB = 2**20


def payload(seed: int) -> tuple[torch.Tensor, dict[str, torch.Size]]:
    """~256 MiB of float32 as one flat buffer and the shapes packed in it, in order: a 128 MiB
    embedding and 8 layers of four 4 MiB matrices + biases. Filled in place, so building it
    never holds a second copy."""
    shapes = {"embed.weight": torch.Size((32768, 1024))}
    for layer in range(8):
        for name in ("q", "k", "v", "o"):
            shapes[f"h{layer}.{name}.weight"] = torch.Size((1024, 1024))
            shapes[f"h{layer}.{name}.bias"] = torch.Size((1024,))
    flat = torch.empty(sum(shape.numel() for shape in shapes.values()))
    flat.normal_(generator=torch.Generator().manual_seed(seed))
    return flat, shapes


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon... of this process, in bytes (the benchmark needs /proc)."""
    fields = ProcReader().status()
    assert fields is not None, "this benchmark reads /proc/self/status (Linux)"
    return fields


class PeakSampler:
    """Samples VmRSS and RssAnon every ``period_s`` in a daemon thread; ``peak`` holds the
    largest of each seen, from the moment of construction to the end of the ``with``."""

    FIELDS = ("VmRSS", "RssAnon")

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.peak = {k: status()[k] for k in self.FIELDS}
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = status()
        for k in self.FIELDS:
            self.peak[k] = max(self.peak[k], now[k])

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()
            self.num_samples += 1

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


KINDS = ("swarm_offload", "swarm_memory", "allreduce", "swarm_sharded")


def build(kind: str, rank: int, world: int, chunk_mb: float, spool_dir: str) -> Any:
    if kind == "allreduce":
        return AllReduceTransport(None, num_islands=world, bucket_numel=32 * MIB // 4)
    if kind == "swarm_sharded":  # every island aggregates its part; island 0 is measured
        return SwarmAggregator(
            None,
            owners="sharded",
            num_islands=world,
            island_index=rank,
            spool_dir=spool_dir,
            chunk_bytes=int(chunk_mb * MIB),
        )
    return SwarmAggregator(
        None,
        num_islands=world,
        island_index=rank,
        offload=(kind == "swarm_offload"),
        spool_dir=spool_dir,
        chunk_bytes=int(chunk_mb * MIB),
    )


def rank_main(rank: int, world: int, port: int, kind: str, chunk_mb: float, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    spool_dir = str(Path(out).parent / "spool")
    transport = build(kind, rank, world, chunk_mb, spool_dir)
    flat, shapes = payload(seed=rank)
    payload_bytes = flat.numel() * flat.element_size()
    dist.barrier()
    result: dict[str, Any] = {}
    if rank == 0:
        # Writing 5 to clear_refs resets VmHWM to the current RSS: it then reports this
        # round's peak only. Nothing is allocated between here and the round but the sampler.
        Path("/proc/self/clear_refs").write_text("5")
        with PeakSampler() as sampler:
            before = dict(sampler.peak)
            stats = average_flat(transport, flat, shapes, round_index=0)
        hwm = status()["VmHWM"]
        result.update(
            baseline_rss=before["VmRSS"],
            baseline_anon=before["RssAnon"],
            peak_rss=max(sampler.peak["VmRSS"], hwm),
            peak_anon=sampler.peak["RssAnon"],
            hwm=hwm,
            num_samples=sampler.num_samples,
        )
    else:
        stats = average_flat(transport, flat, shapes, round_index=0)
    wall = torch.tensor([stats.wall_s])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    if rank == 0:
        spool = getattr(transport, "spool", None)  # none: all-reduce, or a sharded mean
        peak_spool = spool.peak_disk_bytes if spool is not None else 0
        result.update(
            wall_s=float(wall),
            peak_spool_bytes=peak_spool,
            payload_bytes=payload_bytes,
            bytes_received=stats.bytes_received,
            bytes_sent=stats.bytes_sent,
        )
        Path(out).write_text(json.dumps(result))
    transport.close()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(kind: str, world: int, chunk_mb: float, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{kind}-{world}.json"
    mp.start_processes(
        rank_main,
        args=(world, free_port(), kind, chunk_mb, str(out)),
        nprocs=world,
        start_method="fork",
    )
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS[:3]), choices=KINDS)
    args = parser.parse_args()
    print(f"cpu cores: {os.cpu_count()}, chunk_mb: {args.chunk_mb}, torch {torch.__version__}")
    header = (
        f"{'islands':>7} {'transport':>14} {'base MiB':>9} {'extra RSS':>9} {'extra anon':>10} "
        f"{'samples':>7} {'spool MiB':>9} {'round s':>7}"
    )
    print(header)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="swarm-bench-", dir=os.getcwd()) as tmp:
        for world in args.peers:
            for kind in args.kinds:
                r = measure(kind, world, args.chunk_mb, Path(tmp))
                r["extra_rss"] = r["peak_rss"] - r["baseline_rss"]
                r["extra_anon"] = r["peak_anon"] - r["baseline_anon"]
                results[f"{kind}-{world}"] = r
                print(
                    f"{world:>7} {kind:>14} {r['baseline_rss'] / MIB:>9.0f} "
                    f"{r['extra_rss'] / MIB:>9.0f} {r['extra_anon'] / MIB:>10.0f} "
                    f"{r['num_samples']:>7} {r['peak_spool_bytes'] / MIB:>9.0f} "
                    f"{r['wall_s']:>7.2f}",
                    flush=True,
                )
    print(f"payload per island: {results[next(iter(results))]['payload_bytes'] / MIB:.1f} MiB")
    print("json:", json.dumps(results))


if __name__ == "__main__":
    main()
