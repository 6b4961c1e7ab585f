"""Per-rank cost of DDP islands against FSDP islands (2 islands x dp ranks, CPU, gloo).

For each island layout, ``2 * dp`` gloo processes on this machine hold a stack of ``--layers``
square linear layers of about ``--params`` parameters in all:

- ``ddp``: every rank holds the whole model (as DDP leaves it) and the outer loop runs with
  the default ``shard_outer`` (each rank owns 1/dp of the anchors and outer state, then the
  island gathers the new parameters);
- ``fsdp``: the model is built on the meta device, sharded with ``fully_shard`` over the
  island's own data-parallel mesh (``build_island_mesh``), materialised shard by shard, and the
  outer loop gets each rank's local shards (``island_parallel="fsdp"``).

Each island then moves its parameters by an island-dependent step (no backward pass: the
figures are the outer round's), and the outer loop syncs (all-reduce transport, outer SGD lr
0.7 / Nesterov 0.9, the streamed round). Per rank: anchor and outer-state bytes, bytes sent per
round, peak resident memory (VmHWM from /proc/self/status) and the round's wall time (the
slowest rank's median over ``--reps`` rounds).

Run:   PYTHONPATH=. .venv/bin/python benchmarks/fsdp_islands.py [--params 100e6] [--dp 1 2 4]
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from lightning_swarm.config import SwarmConfig
from lightning_swarm.outer import OuterLoop
from lightning_swarm.outer.loop import transport_for
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.groups import build_groups, build_island_mesh


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def _model(args: argparse.Namespace) -> torch.nn.Sequential:
    width = int((args.params / args.layers) ** 0.5)
    return torch.nn.Sequential(
        *(torch.nn.Linear(width, width, bias=False) for _ in range(args.layers))
    )


def _build(
    layout: str, topology: IslandTopology, args: argparse.Namespace
) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The module as this layout holds it on this rank, and the cleanup of its mesh."""
    if layout == "ddp":
        return _model(args), lambda: None
    mesh = build_island_mesh(topology, 1, device_type="cpu")
    with torch.device("meta"):
        model = _model(args)
    for layer in model:
        fully_shard(layer, mesh=mesh.mesh["data_parallel"])
    fully_shard(model, mesh=mesh.mesh["data_parallel"])
    model.to_empty(device="cpu")  # only this rank's shards get memory
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)  # type: ignore[attr-defined]
    return model, mesh.destroy


def _run_layout(rank: int, world: int, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    dp = world // 2
    topology = IslandTopology(world_size=world, island_size=dp, global_rank=rank)
    groups = build_groups(topology)
    model, destroy_mesh = _build(layout, topology, args)
    config = SwarmConfig(island_size=dp, sync_every=1, island_parallel=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = OuterLoop(
        [optimizer],
        {id(p): n for n, p in model.named_parameters()},
        config=config,
        transport=transport_for(
            config,
            groups.peers,
            num_islands=2,
            island_index=topology.island_index,
            device=torch.device("cpu"),
            # as the strategy does: one finite verdict per model-sharded island
            island_group=groups.island if layout == "fsdp" else None,
        ),
        num_islands=2,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        island_group=groups.island if layout == "ddp" else None,
        island_position=topology.local_index,
    )
    shards = list(loop.outer_syncs[0].params.values())
    times = []
    try:
        for rep in range(args.reps + 1):
            with torch.no_grad():
                for p in shards:
                    p.add_(0.001 * (topology.island_index + 1) * (rep + 1))
            dist.barrier()
            start = time.perf_counter()
            loop.on_inner_step(optimizer)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep:  # the first round allocates the outer state
                times.append(float(elapsed))
    finally:
        loop.close()
        destroy_mesh()
        groups.destroy()
    return {
        "bytes_sent_per_round": loop.totals.bytes_sent // loop.totals.outer_steps,
        "anchor_bytes": loop.anchor_bytes(),
        "outer_state_bytes": loop.outer_state_bytes(),
        "peak_rss_bytes": _peak_rss_bytes(),
        "round_s": statistics.median(times),
    }


def _model_sizes(args: argparse.Namespace) -> list[torch.Tensor]:
    with torch.device("meta"):
        return list(_model(args).parameters())


def _rank(rank: int, world: int, port: int, layout: str, args: Any, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(_run_layout(rank, world, layout, args), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _measure(layout: str, dp: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One fresh set of processes per layout and size, so that peak RSS is that layout's."""
    world = 2 * dp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank, args=(world, port, layout, args, out), nprocs=world, start_method="spawn"
        )
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6, help="parameters in the model")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="ranks per island")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mib = 2**20
    header = (
        f"{'layout':<6}{'dp':>4}{'anchors MiB':>13}{'outer state MiB':>17}"
        f"{'sent/round MiB':>16}{'peak RSS MiB':>14}{'round s':>9}"
    )
    print(f"2 islands, model of {sum(p.numel() for p in _model_sizes(args)):,} float32 params")
    print("per rank: the largest value over the ranks; round: slowest rank, median")
    print(header)
    for dp in args.dp:
        for layout in ("ddp", "fsdp"):
            ranks = _measure(layout, dp, args)
            print(
                f"{layout:<6}{dp:>4}"
                f"{max(r['anchor_bytes'] for r in ranks) / mib:>13.1f}"
                f"{max(r['outer_state_bytes'] for r in ranks) / mib:>17.1f}"
                f"{max(r['bytes_sent_per_round'] for r in ranks) / mib:>16.1f}"
                f"{max(r['peak_rss_bytes'] for r in ranks) / mib:>14.0f}"
                f"{ranks[0]['round_s']:>9.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
