"""Cost of one outer round, side by side in one run: this project (each path), torchft, floors.

CPU mode (default): ``--ranks`` gloo processes (2) on this machine, each holding the same MLP of
``--mb`` MiB (128) of float32 parameters, one island per rank, outer SGD lr 0.7 / Nesterov 0.9.
Each repetition moves every rank's parameters by a rank-dependent step (not timed), then times
one sync of every method in turn (interleaved, so machine noise spreads over all of them):

- ``ours: held`` -- ``OuterSync`` over the same all-reduce seen through ``average`` only
  (``Held``): the held form that delayed rounds and non-pipelined transports take
  (the whole fragment's pseudo-gradient in one buffer, the transport's bucketed all-reduce, the
  outer step per bucket, merge);
- ``ours: streamed`` -- ``OuterSync`` as the strategy builds it now: one bucketed pass;
- ``torchft DiLoCo`` -- torchft 0.2.0's ``DiLoCo`` on its own Manager and Lighthouse (per-param
  all-reduce, its default), inner optimizer a no-op so only its sync is timed (the quorum it
  takes every round is part of its round);
- ``floor`` -- one gloo all-reduce of the whole payload plus the element-wise work on flat
  tensors (``anchor - local``, divide, the Nesterov step, copy back), nothing else.

A sync's time is the slowest rank's. Reported: median and min-max over ``--reps`` repetitions
after ``--warmup``. GPU mode (``--gpu``) is in ``benchmarks/sync_cost_gpu.py``.

Run:   PYTHONPATH=. .venv/bin/python benchmarks/sync_cost.py [--reps 7] [--json out.json]
GPU:   PYTHONPATH=. .venv/bin/python benchmarks/sync_cost.py --gpu [--stand-in]
Needs: torchft==0.2.0 for its column (``pip install -e .[bench]``); without it the column is
skipped and the run says so.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_swarm.outer import OuterSync
from lightning_swarm.transport import AllReduceTransport, RoundStats, Transport
from lightning_swarm.transport.base import Bucket, Handle, Opening, RoundRequest

OUTER_SGD = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def mlp(mib: float, seed: int = 0) -> nn.Module:
    """A stack of square Linear layers holding about ``mib`` MiB of float32 parameters."""
    width = 2048 if mib >= 16 else 64
    layers = max(1, round(mib * 2**20 / 4 / (width * width + width)))
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def move(model: nn.Module, rank: int, rep: int) -> None:
    """Stand-in for inner steps: a small rank- and repetition-dependent move of every weight."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.001 * (rank + 1) * ((rep + i) % 3 - 1))


class Held:
    """A transport seen as not pipelined: the round engine holds its rounds (the whole fragment
    formed into one buffer, every bucket started before any wait)."""

    pipelined = False
    heals = False
    every_rank_in_round = False

    def __init__(self, transport: AllReduceTransport) -> None:
        self.transport = transport
        self.bucket_numel, self.block_size = transport.bucket_numel, transport.block_size

    def open(self, request: RoundRequest) -> Opening:
        return self.transport.open(request)

    def start(self, bucket: Bucket) -> Handle:
        return self.transport.start(bucket)

    def agree(self) -> RoundStats:
        return self.transport.agree()

    def close(self) -> None:
        self.transport.close()


class Ours:
    def __init__(self, mib: float, world: int, bucket_numel: int, *, held: bool) -> None:
        self.model = mlp(mib)
        transport: Transport = AllReduceTransport(
            None, num_islands=world, bucket_numel=bucket_numel
        )
        self.outer = OuterSync(
            dict(self.model.named_parameters()),
            outer_optimizer=OUTER_SGD,
            transport=Held(transport) if held else transport,
            sync_every=1,
        )

    def sync(self) -> None:
        assert self.outer.on_inner_step() is not None


class Floor:
    """All-reduce of the payload plus the element-wise work, on flat tensors.

    The model's parameters are views into one flat buffer, so the floor reads and writes the
    parameters themselves with no packing.
    """

    def __init__(self, mib: float, world: int) -> None:
        self.world = world
        self.model = mlp(mib)
        self.params = list(self.model.parameters())
        self.local = torch.cat([p.detach().reshape(-1) for p in self.params])
        offset = 0
        for p in self.params:
            p.data = self.local[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.anchor = self.local.clone()
        self.momentum, self.delta = torch.zeros_like(self.local), torch.empty_like(self.local)

    def sync(self) -> None:
        with torch.no_grad():
            torch.sub(self.anchor, self.local, out=self.delta)
            dist.all_reduce(self.delta)
            self.delta.div_(self.world)
            self.momentum.mul_(0.9).add_(self.delta)
            self.anchor.add_(self.delta.add(self.momentum, alpha=0.9), alpha=-0.7)
            self.local.copy_(self.anchor)


class Torchft:
    """torchft 0.2.0's DiLoCo, one replica group per rank, on a shared Lighthouse."""

    def __init__(self, mib: float, rank: int, lighthouse: str) -> None:
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.model = mlp(mib)
        timeout = datetime.timedelta(seconds=120)
        self.store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            min_replica_size=2,
            load_state_dict=lambda sd: self.model.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": self.model.state_dict()},
            replica_id=f"bench_{rank}",
            store_addr="localhost",
            store_port=self.store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            use_async_quorum=False,
            timeout=timeout,
        )
        # No gradients: the inner step is a no-op and its post-hook runs DiLoCo's sync.
        self.inner = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.diloco = DiLoCo(
            self.manager, [self.model], self.inner, OUTER_SGD(self.model.parameters()), 1
        )
        self.diloco.__enter__()

    def sync(self) -> None:
        self.inner.step()

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def _rank(rank: int, world: int, port: int, opts: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mib, bucket = opts["mb"], max(1, int(opts["bucket_mb"] * 2**20) // 4)
    methods: dict[str, Any] = {
        "ours: held": Ours(mib, world, bucket, held=True),
        "ours: streamed": Ours(mib, world, bucket, held=False),
        "floor: all-reduce + element-wise": Floor(mib, world),
    }
    server = None
    if opts["torchft"]:
        # The Lighthouse lives in rank 0, not in the parent: torchft's runtime does not survive
        # a fork, and the parent then stays free of it whatever the start method.
        from torchft._torchft import LighthouseServer

        address = [None]
        if rank == 0:
            server = LighthouseServer(bind="[::]:0", min_replicas=world)
            address = [server.address()]
        dist.broadcast_object_list(address, src=0)
        methods["torchft 0.2.0 DiLoCo"] = Torchft(mib, rank, str(address[0]))
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(opts["warmup"] + opts["reps"]):
        for name, method in methods.items():
            move(method.model, rank, rep)
            dist.barrier()
            start = time.perf_counter()
            method.sync()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if rep >= opts["warmup"]:
                times[name].append(float(took))
    payload = sum(p.numel() * 4 for p in methods["floor: all-reduce + element-wise"].params)
    for method in methods.values():
        if hasattr(method, "close"):
            method.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"times_s": times, "payload_bytes": payload}))
    dist.barrier()
    if server is not None:
        server.shutdown()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cpu(
    *,
    mb: float,
    ranks: int,
    reps: int,
    warmup: int,
    bucket_mb: float,
    torchft: bool,
    start_method: str = "spawn",
) -> dict[str, Any]:
    """Run the CPU comparison; returns times per method and the run's settings."""
    note = ""
    if torchft and importlib.util.find_spec("torchft") is None:
        torchft = False
        note = "torchft is not installed (pip install -e .[bench]): its column is skipped"
        print(note, file=sys.stderr)
    opts = {"mb": mb, "reps": reps, "warmup": warmup, "bucket_mb": bucket_mb, "torchft": torchft}
    out = Path(f"/tmp/sync_cost_{_free_port()}.json")
    mp.start_processes(
        _rank,
        args=(ranks, _free_port(), opts, str(out)),
        nprocs=ranks,
        join=True,
        start_method=start_method,
    )
    result = json.loads(out.read_text())
    out.unlink()
    result.update(mode="cpu", mb=mb, ranks=ranks, reps=reps, bucket_mb=bucket_mb, note=note)
    result["load_average_after"] = os.getloadavg()
    return result


def summarize(times: dict[str, list[float]], floor: str) -> list[dict[str, Any]]:
    """Median, min and max per method, and the median's ratio to the floor's median."""
    base = statistics.median(times[floor]) if times.get(floor) else float("nan")
    rows = []
    for name, values in times.items():
        if not values:
            continue
        median = statistics.median(values)
        rows.append(
            {
                "method": name,
                "median_s": median,
                "min_s": min(values),
                "max_s": max(values),
                "vs_floor": median / base,
            }
        )
    return rows


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the samples of several runs; keep each run's own ratio to its floor.

    ``rows``: median, min and max over all samples; ``vs_floor`` is the median over runs of
    (method's median / floor's median in the same run), with its range in ``vs_floor_range``.
    """
    result = dict(runs[0])
    floor = result.get("floor", FLOOR)
    names = list(runs[0]["times_s"])
    result["times_s"] = {n: [t for r in runs for t in r["times_s"][n]] for n in names}
    result["runs"] = [
        {"times_s": r["times_s"], "load_average_after": r.get("load_average_after")} for r in runs
    ]
    rows = summarize(result["times_s"], floor)
    for row in rows:
        ratios = [
            statistics.median(r["times_s"][row["method"]]) / statistics.median(r["times_s"][floor])
            for r in runs
        ]
        row["vs_floor"] = statistics.median(ratios)
        row["vs_floor_range"] = [min(ratios), max(ratios)]
    result["rows"] = rows
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'method':<50} {'median s':>9} {'min s':>8} {'max s':>8} {'x floor':>8} {'range':>12}"
    print(head)
    for r in rows:
        lo, hi = r.get("vs_floor_range", [r["vs_floor"], r["vs_floor"]])
        print(
            f"{r['method']:<50} {r['median_s']:9.4f} {r['min_s']:8.4f} {r['max_s']:8.4f} "
            f"{r['vs_floor']:8.2f} {lo:5.2f}-{hi:5.2f}"
        )


def title(result: dict[str, Any]) -> str:
    """A one-line chart title: the mode, the workload and the date."""
    if result["mode"] == "cpu":
        what = f"{result['ranks']} gloo ranks, {result['mb']:g} MiB MLP"
    else:
        what = f"{result['device']}, {result['num_params'] / 1e9:.2f}B parameters"
    runs = len(result.get("runs", [])) or 1
    return f"one outer round, {what}: {runs} run(s), {result['date'][:10]}"


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """A horizontal bar chart of the medians with min-max whiskers (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    names = [r["method"] for r in rows][::-1]
    med = [r["median_s"] for r in rows][::-1]
    err = [
        [m - r["min_s"] for m, r in zip(med, rows[::-1], strict=True)],
        [r["max_s"] - m for m, r in zip(med, rows[::-1], strict=True)],
    ]
    ax.barh(names, med, xerr=err, color="tab:blue", ecolor="black", capsize=3)
    ax.set_xlabel("seconds per outer round (median, min-max)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the 1.21B GPT on one GPU")
    parser.add_argument("--stand-in", action="store_true", help="--gpu on a small CPU model")
    parser.add_argument("--mb", type=float, default=128.0, help="MiB of parameters (CPU mode)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--runs", type=int, default=1, help="fresh runs (processes) in a row")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=32.0)
    parser.add_argument("--no-torchft", action="store_true")
    parser.add_argument(
        "--start-method",
        default="spawn",
        choices=["spawn", "fork"],
        help="how ranks start; fork skips re-importing (the smoke test uses it)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, help="write a bar chart here (matplotlib)")
    args = parser.parse_args(argv)
    runner: Callable[[], dict[str, Any]]
    if args.gpu:
        from benchmarks.sync_cost_gpu import run_gpu

        runner = functools.partial(run_gpu, stand_in=args.stand_in, reps=args.reps)
    else:
        runner = functools.partial(
            run_cpu,
            mb=args.mb,
            ranks=args.ranks,
            reps=args.reps,
            warmup=args.warmup,
            bucket_mb=args.bucket_mb,
            torchft=not args.no_torchft,
            start_method=args.start_method,
        )
    runs = [runner() for _ in range(args.runs)]
    result = combine(runs)
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["command"] = " ".join(["benchmarks/sync_cost.py", *(argv or sys.argv[1:])])
    print_table(result["rows"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.png:
        plot(result["rows"], title(result), args.png)
    return result


FLOOR = "floor: all-reduce + element-wise"

if __name__ == "__main__":
    main()
