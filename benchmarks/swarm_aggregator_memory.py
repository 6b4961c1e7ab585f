"""Aggregator host memory of the swarm transport against the number of peers, offload on/off.

For each number of islands (2, 4, 8) and each transport setting, forks that many ranks over
gloo, gives each a ~256 MiB pseudo-gradient (a GPT-like layout: one 128 MiB embedding plus
32 matrices of 4 MiB) and runs one round with island 0 as the aggregator. Island 0 samples its
own VmRSS from /proc/self/status every millisecond in a thread (and resets VmHWM before the
round, then reads it after), so the figures are the aggregator's real peak resident memory.

Also reported: the spool's peak disk use, and the wall time of one sync for the swarm
transport and for the all-reduce transport on the same payload and ranks (max over ranks).

``--kinds ... swarm_sharded`` adds the sharded swarm transport (``swarm.aggregator="sharded"``),
where every island aggregates its shard; island 0 is measured all the same.

Run: .venv/bin/python benchmarks/swarm_aggregator_memory.py [--peers 2 4 8] [--chunk-mb 4]
     [--kinds swarm_offload swarm_sharded]
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

from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from tests.transport_rounds import average

MIB = 2**20


def payload(seed: int) -> dict[str, torch.Tensor]:
    """~256 MiB of float32: a 128 MiB embedding and 8 layers of four 4 MiB matrices + biases."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.randn(32768, 1024, generator=g)}
    for layer in range(8):
        for name in ("q", "k", "v", "o"):
            tensors[f"h{layer}.{name}.weight"] = torch.randn(1024, 1024, generator=g)
            tensors[f"h{layer}.{name}.bias"] = torch.randn(1024, generator=g)
    return tensors


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Samples VmRSS every ``period_s`` in a daemon thread; ``peak`` is the largest seen."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.peak = vm_rss()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, vm_rss())
            self.samples += 1

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, vm_rss())


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
    tensors = payload(seed=rank)
    dist.barrier()
    result: dict[str, Any] = {}
    if rank == 0:
        # Writing 5 to clear_refs resets VmHWM, so it reports this round's peak only.
        Path("/proc/self/clear_refs").write_text("5")
        result["baseline_rss"] = vm_rss()
        with PeakSampler() as sampler:
            stats = average(transport, tensors, round_index=0)
        result.update(peak_rss=sampler.peak, hwm=vm_hwm(), samples=sampler.samples)
    else:
        stats = average(transport, tensors, round_index=0)
    wall = torch.tensor([stats.wall_s])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    if rank == 0:
        spool = getattr(transport, "spool", None)  # none: all-reduce, or a sharded mean
        peak_spool = spool.peak_disk_bytes if spool is not None else 0
        result.update(
            wall_s=float(wall),
            peak_spool_bytes=peak_spool,
            payload_bytes=sum(t.numel() * 4 for t in tensors.values()),
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
        f"{'islands':>7} {'transport':>14} {'base MiB':>9} {'peak MiB':>9} {'HWM MiB':>8} "
        f"{'extra MiB':>9} {'spool MiB':>9} {'sync s':>7}"
    )
    print(header)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="swarm-bench-", dir=os.getcwd()) as tmp:
        for world in args.peers:
            for kind in args.kinds:
                r = measure(kind, world, args.chunk_mb, Path(tmp))
                results[f"{kind}-{world}"] = r
                base = r.get("baseline_rss", 0) / MIB
                peak = r.get("peak_rss", 0) / MIB
                print(
                    f"{world:>7} {kind:>14} {base:>9.0f} {peak:>9.0f} {r['hwm'] / MIB:>8.0f} "
                    f"{peak - base:>9.0f} {r['peak_spool_bytes'] / MIB:>9.0f} "
                    f"{r['wall_s']:>7.2f}",
                    flush=True,
                )
    print(f"payload per island: {results[next(iter(results))]['payload_bytes'] / MIB:.1f} MiB")
    for kind in ("swarm_offload", "swarm_memory", "swarm_sharded"):
        lo, hi = min(args.peers), max(args.peers)
        if f"{kind}-{lo}" in results and f"{kind}-{hi}" in results:
            ratio = results[f"{kind}-{hi}"]["peak_rss"] / results[f"{kind}-{lo}"]["peak_rss"]
            print(f"{kind}: peak RSS at {hi} islands / at {lo} islands = {ratio:.3f}")
    print("json:", json.dumps(results))


if __name__ == "__main__":
    main()
