"""Per-rank cost of the outer round with and without ``shard_outer`` (2 islands x k ranks, CPU).

Runs ``2 * k`` gloo processes on this machine. Each holds an MLP of ``--mb`` MiB of float32
parameters in ``--layers`` equal layers (so a share can be even); each island moves its
parameters by an island-dependent step (identical on its ranks, as DDP would leave them), then
the outer loop syncs (``OuterLoop``, all-reduce transport, outer SGD lr 0.7 / Nesterov 0.9, the
streamed round). For ``shard_outer`` off and on, per rank: bytes the transport counted per
round, anchor bytes, outer-state bytes, and the round's wall time (the slowest rank's median
over ``--reps`` rounds, the island gather included).

Run:   PYTHONPATH=. .venv/bin/python benchmarks/shard_outer.py [--k 2] [--mb 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import functools
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

from lightning_swarm.config import SwarmConfig
from lightning_swarm.outer import OuterLoop
from lightning_swarm.outer.loop import transport_for
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.groups import build_groups


def _one_setting(rank: int, world: int, k: int, args: argparse.Namespace, shard: bool) -> dict:
    config = SwarmConfig(island_size=k, shard_outer=shard, sync_every=1)
    topology = IslandTopology(world_size=world, island_size=k, global_rank=rank)
    groups = build_groups(topology)
    numel = int(args.mb * 2**20 / 4 / args.layers)
    params = {f"layer{i}": torch.nn.Parameter(torch.zeros(numel)) for i in range(args.layers)}
    optimizer = torch.optim.SGD(list(params.values()), lr=0.1)
    loop = OuterLoop(
        [optimizer],
        {id(p): n for n, p in params.items()},
        config=config,
        transport=transport_for(
            config,
            groups.peers,
            num_islands=topology.num_islands,
            island_index=topology.island_index,
            device=torch.device("cpu"),
        ),
        num_islands=topology.num_islands,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        island_group=groups.island,
        island_position=topology.local_index,
    )
    times = []
    try:
        for rep in range(args.reps + 1):
            with torch.no_grad():
                for p in params.values():
                    p.add_(0.01 * (topology.island_index + 1) * (rep + 1))
            dist.barrier()
            start = time.perf_counter()
            loop.on_inner_step(optimizer)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep:  # the first round allocates the outer state
                times.append(float(elapsed))
    finally:
        loop.close()
        groups.destroy()
    rounds = loop.totals.outer_steps
    return {
        "bytes_sent_per_round": loop.totals.bytes_sent // rounds,
        "anchor_bytes": loop.anchor_bytes(),
        "outer_state_bytes": loop.outer_state_bytes(),
        "round_s": statistics.median(times),
    }


def _rank(rank: int, world: int, port: int, k: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {s: _one_setting(rank, world, k, args, s) for s in (False, True)}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2, help="ranks per island")
    parser.add_argument("--mb", type=float, default=64.0, help="MiB of float32 parameters")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    world = 2 * args.k
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.start_processes(
            _rank, args=(world, port, args.k, args, out), nprocs=world, start_method="fork"
        )
        ranks: list[dict[bool, Any]] = [
            torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(world)
        ]
    print(f"2 islands x {args.k} ranks, {args.mb:g} MiB float32 model in {args.layers} layers")
    print(
        f"{'shard_outer':<12}{'rank':>5}{'sent/round MiB':>16}{'anchors MiB':>13}"
        f"{'outer state MiB':>17}{'round s':>9}"
    )
    for shard in (False, True):
        for r, info in enumerate(ranks):
            row = info[shard]
            print(
                f"{shard!s:<12}{r:>5}{row['bytes_sent_per_round'] / 2**20:>16.2f}"
                f"{row['anchor_bytes'] / 2**20:>13.2f}{row['outer_state_bytes'] / 2**20:>17.2f}"
                f"{row['round_s']:>9.3f}"
            )


if __name__ == "__main__":
    main()
