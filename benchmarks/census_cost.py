"""Cost of one per-step HostMemoryCensus call at 0, 1, 4 and 8 GiB resident.

For each size, this process allocates and touches that many bytes (one uint8 tensor filled with
ones, so every page is resident anonymous memory), then times:
- ``census step``: ``HostMemoryCensus.on_train_batch_end`` on a fresh step, as the Trainer calls
  it between slow-cadence steps (status + meminfo + metric dict + logger loop with no loggers);
- ``status read`` / ``meminfo read``: the two constant-cost procfs reads alone;
- ``smaps_rollup read``: the page-walking read the census runs only every
  ``smaps_every_n_steps`` steps, shown beside it so its growth with resident memory is visible.

For the "< 1% of a training step" target, the same run times the main job's inner step
(``conf/model/gpt.yaml`` + ``.../data/stdlib.yaml`` shapes: byte-level GPT,
4 layers, 128 wide, batch 16 x 128 tokens, AdamW, one thread as each of the two CPU ranks
gets) on random bytes.

Sizes run one after another and the memory is freed before the next; a size is skipped (and
said so) when MemAvailable leaves less than 2 GiB of headroom, since the machine is shared.

Run: .venv/bin/python benchmarks/census_cost.py [--sizes-gib 0 1 4 8] [--calls 2000]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from lightning_swarm import SwarmStrategy
from lightning_swarm.callbacks import HostMemoryCensus
from lightning_swarm.demo.gpt import GPT
from lightning_swarm.memory.procfs import ProcReader

GIB = 2**30


def timings_ms(fn: Callable[[], Any], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - start) / 1e6)
    return out


def describe(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    return f"median {statistics.median(samples):8.4f}  p90 {q[89]:8.4f}  p99 {q[98]:8.4f}"


def census_step_timer(census: HostMemoryCensus) -> Callable[[], None]:
    """A stand-in Trainer whose global_step advances by one per call (never a slow step)."""
    trainer: Any = SimpleNamespace(
        global_step=0, global_rank=0, loggers=[], strategy=SwarmStrategy(sync_every=2)
    )

    def one_step() -> None:
        trainer.global_step += 1
        if trainer.global_step % census.smaps_every_n_steps == 0:
            trainer.global_step += 1  # time the per-step path only
        census.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]

    return one_step


def main_job_step_ms(steps: int) -> list[float]:
    """Forward, backward and AdamW step of the main job's GPT at its configured shapes."""
    model = GPT(256, 128, 4, 4, 128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (16, 128))

    def step() -> None:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    timings_ms(step, 3)  # warm up
    return timings_ms(step, steps)


def measure(size_gib: float, calls: int, smaps_reads: int) -> float | None:
    reader = ProcReader()
    meminfo = reader.meminfo() or {}
    need = size_gib * GIB + 2 * GIB
    if meminfo.get("MemAvailable", need) < need:
        print(f"{size_gib:g} GiB: skipped, MemAvailable {meminfo['MemAvailable'] / GIB:.1f} GiB")
        return None
    block = torch.ones(int(size_gib * GIB), dtype=torch.uint8) if size_gib else None
    try:
        status = reader.status() or {}
        census = HostMemoryCensus(every_n_steps=1, smaps_every_n_steps=500)
        step = census_step_timer(census)
        timings_ms(step, 200)  # warm up
        print(
            f"{size_gib:g} GiB requested: VmRSS {status.get('VmRSS', 0) / GIB:.2f} GiB, "
            f"RssAnon {status.get('RssAnon', 0) / GIB:.2f} GiB"
        )
        census_ms = timings_ms(step, calls)
        print(f"  census step       {describe(census_ms)}  ms")
        print(f"  status read       {describe(timings_ms(reader.status, calls))}  ms")
        print(f"  meminfo read      {describe(timings_ms(reader.meminfo, calls))}  ms")
        print(f"  smaps_rollup read {describe(timings_ms(reader.smaps_rollup, smaps_reads))}  ms")
        return statistics.median(census_ms)
    finally:
        del block
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[0, 1, 4, 8])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--smaps-reads", type=int, default=20)
    parser.add_argument("--main-job-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    main_ms = statistics.median(main_job_step_ms(args.main_job_steps))
    print(f"main-job inner step (GPT 4x128, batch 16x128, 1 thread): median {main_ms:.1f} ms")
    worst = 0.0
    for size in args.sizes_gib:
        worst = max(worst, measure(size, args.calls, args.smaps_reads) or 0.0)
    print(
        f"worst census step median {worst:.4f} ms = {100 * worst / main_ms:.3f}% "
        "of a main-job inner step"
    )


if __name__ == "__main__":
    main()
