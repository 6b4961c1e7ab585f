"""torchft 0.2.0's own DiLoCo on the main job, one island per torchrun node, for benchmarks/wan.py.

``wan.py --trainer torchft`` launches this module instead of the Hydra app in each island's
network namespace. It trains the main job's model and data (``conf/model/gpt.yaml``,
``conf/data/stdlib.yaml``: byte-level GPT, AdamW with warm-up, gradient clipping at 1.0) in a
plain loop wrapped in ``torchft.local_sgd.DiLoCo`` with the ``swarm`` preset's outer optimizer
(SGD lr 0.7, Nesterov momentum 0.9). Island 0 runs the Lighthouse; every island's Manager
advertises its own veth address. The torch.distributed world that torchrun sets up is used
twice, for a barrier at the start (the Lighthouse is up) and one at the end (nobody leaves
mid-round); nothing crosses islands between DiLoCo's rounds but torchft's own traffic.
Validation (every ``--val-every`` steps, 16 batches) is each island's own, unsynced.
Writes ``OUT/steps.json`` in ``wan_steps.StepTimes``'s format.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from itertools import cycle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from wan_steps import schedstat, thread_cpu

LIGHTHOUSE_PORT = 29590


def _validate(module: Any, loader: DataLoader[Any]) -> float:
    module.eval()
    losses = []
    with torch.no_grad():
        for x, y in loader:
            losses.append(float(F.cross_entropy(module(x).flatten(0, 1), y.flatten())))
    module.train()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--val-every", type=int, default=25)
    args = parser.parse_args()

    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from lightning_swarm.demo.gpt import GPTLightningModule
    from lightning_swarm.demo.text import StdlibTextDataModule

    torch.set_num_threads(1)
    island, islands = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = os.environ["WAN_ADDR"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    server = None
    if island == 0:
        server = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=islands)
    dist.barrier()

    torch.manual_seed(1234)  # the same initial model on every island
    module = GPTLightningModule()
    data = StdlibTextDataModule()
    data.setup("fit")
    assert data.train_set is not None
    sampler: DistributedSampler[Any] = DistributedSampler(
        data.train_set, num_replicas=islands, rank=island, seed=1234
    )
    train = DataLoader(data.train_set, batch_size=data.batch_size, sampler=sampler, drop_last=True)
    val = data.val_dataloader()
    config = module.configure_optimizers()
    inner, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    outer = torch.optim.SGD(module.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=islands,
        load_state_dict=lambda sd: module.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": module.state_dict()},
        replica_id=f"wan_{island}",
        store_addr=address,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=f"http://{os.environ['MASTER_ADDR']}:{LIGHTHOUSE_PORT}",
        hostname=address,
        use_async_quorum=False,
        timeout=timeout,
        # Every island starts from the same seed. A step-0 heal would fetch island 0's weights
        # from torchft's HTTP checkpoint server, which advertises socket.gethostname()
        # ("localhost" here): unreachable from another namespace.
        init_sync=False,
    )
    record: dict[str, Any] = {k: [] for k in ("step_end_s", "global_step", "thread_cpu_s")}
    record.update({k: [] for k in ("thread_wait_s", "process_cpu_s", "sync_wall_s")})
    record.update({"val_spans": [], "val_points": []})
    sync_s = 0.0
    batches = cycle(train)
    t0 = time.perf_counter()
    with DiLoCo(manager, [module], inner, outer, args.sync_every, pin_memory=False):
        for step in range(1, args.steps + 1):
            x, y = next(batches)
            loss = F.cross_entropy(module(x).flatten(0, 1), y.flatten())
            inner.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            before = time.perf_counter()
            inner.step()  # DiLoCo's post-step hook runs the round every sync_every steps
            if step % args.sync_every == 0:
                sync_s += time.perf_counter() - before
            scheduler.step()
            on_cpu, waiting = schedstat("/proc/thread-self/schedstat")
            record["step_end_s"].append(time.perf_counter() - t0)
            record["global_step"].append(step)
            record["thread_cpu_s"].append(on_cpu)
            record["thread_wait_s"].append(waiting)
            record["process_cpu_s"].append(time.process_time())
            record["sync_wall_s"].append(sync_s)
            if step % args.val_every == 0:
                start = time.perf_counter() - t0
                loss_val = _validate(module, val)
                end = time.perf_counter() - t0
                record["val_spans"].append((start, end))
                record["val_points"].append((end, step, loss_val))
    record.update(
        {
            "global_rank": island,
            "fit_s": time.perf_counter() - t0,
            "outer_steps": args.steps // args.sync_every,
            "bytes_sent": 0,
            "threads_cpu_s": thread_cpu(),
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "steps.json").write_text(json.dumps(record))
    dist.barrier()
    manager.shutdown(wait=False)
    if server is not None:
        server.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
