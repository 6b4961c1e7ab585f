"""Elastic islands on one laptop: islands fail, restart and join while the swarm trains.

    .venv/bin/python examples/elastic_islands.py [--out elastic_demo] [--max-steps 600]

A lighthouse and three islands (a, b, c; one CPU process each) train the demo GPT with
``SwarmStrategy(membership="torchft")``. Mid-run, island c is killed with SIGKILL and restarted
(it is healed from a live island), and a fourth island d joins. Each island logs its rounds
and losses to ``<out>/<island>.jsonl``; at the end this script prints a timeline (round,
islands in the round, loss per island) and writes ``<out>/timeline.png`` (needs matplotlib).
Takes about two minutes on a laptop CPU (``pip install 'lightning-swarm[elastic,plots]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger

from lightning_swarm import SwarmStrategy
from lightning_swarm.demo.gpt import GPTLightningModule
from lightning_swarm.demo.text import StdlibTextDataModule


class JsonLines(Logger):
    """Appends every logged metric with its step and time to one file."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {**metrics, "step": step, "t": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def run_island(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every island builds the same initial model
    model = GPTLightningModule(block_size=64, n_layer=2, n_head=2, n_embd=64, warmup_steps=20)
    data = StdlibTextDataModule(block_size=64, batch_size=8, max_bytes=2_000_000)
    pl.seed_everything(sum(args.island.encode()))  # but each island sees its own batches
    strategy = SwarmStrategy(
        sync_every=args.sync_every,
        membership="torchft",
        lighthouse=args.lighthouse,
        island_id=args.island,
        min_islands=2,
        quorum_timeout_s=60,
        round_timeout_s=30,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=JsonLines(Path(args.out) / f"{args.island}.jsonl"),
        log_every_n_steps=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)


def rows(out: Path, island: str) -> list[dict[str, Any]]:
    path = out / f"{island}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def rounds(out: Path, island: str) -> list[dict[str, Any]]:
    return [r for r in rows(out, island) if "swarm/islands_in_round" in r]


def wait_rounds(out: Path, island: str, count: int) -> None:
    while len(rounds(out, island)) < count:
        time.sleep(0.2)


def timeline(out: Path, islands: list[str]) -> dict[int, dict[str, Any]]:
    """Round -> islands in it and each island's last training loss before it."""
    table: dict[int, dict[str, Any]] = {}
    for island in islands:
        loss = None
        for row in rows(out, island):
            if "train_loss" in row:
                loss = row["train_loss"]
            if "swarm/islands_in_round" in row:
                entry = table.setdefault(int(row["swarm/outer_steps"]), {"losses": {}})
                entry["islands"] = int(row["swarm/islands_in_round"])
                if loss is not None:
                    entry["losses"][island] = loss
    return dict(sorted(table.items()))


def plot(table: dict[int, dict[str, Any]], events: list[tuple[int, str]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install 'lightning-swarm[plots]' for the PNG")
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for island in "abcd":
        points: list[tuple[float, float]] = []
        for r, e in table.items():
            if island in e["losses"]:
                if points and r - points[-1][0] > 1:  # gone between these rounds: a gap
                    points.append((r - 0.5, float("nan")))
                points.append((r, e["losses"][island]))
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=f"island {island}")
    for round_index, label in events:
        ax.axvline(round_index, color="grey", linestyle="--", linewidth=0.8)
        ax.text(round_index, ax.get_ylim()[1], f" {label}", rotation=90, va="top", fontsize=8)
    ax.set_xlabel("outer round (the swarm's committed rounds)")
    ax.set_ylabel("training loss before the round")
    ax.set_title("Elastic islands on torchft: c killed and restarted, d joining")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def drive(args: argparse.Namespace) -> None:
    from torchft._torchft import LighthouseServer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    server = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=3000
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(island: str) -> subprocess.Popen[bytes]:
        command = [
            sys.executable,
            __file__,
            "--island",
            island,
            "--lighthouse",
            server.address(),
            "--out",
            str(out),
            "--max-steps",
            str(args.max_steps),
            "--sync-every",
            str(args.sync_every),
        ]
        log = (out / f"{island}.log").open("ab")
        return subprocess.Popen(command, env=env, stdout=log, stderr=log)

    events: list[tuple[int, str]] = []
    try:
        procs = {island: start(island) for island in "abc"}
        wait_rounds(out, "c", 6)
        procs["c"].send_signal(signal.SIGKILL)
        procs["c"].wait()
        killed_at = int(rounds(out, "a")[-1]["swarm/outer_steps"])
        events.append((killed_at, "c killed"))
        print(f"round {killed_at}: island c killed (SIGKILL); restarting it")
        os.replace(out / "c.jsonl", out / "c.before_kill.jsonl")
        procs["c"] = start("c")
        wait_rounds(out, "a", killed_at + 4)
        procs["d"] = start("d")
        print(f"round {int(rounds(out, 'a')[-1]['swarm/outer_steps'])}: island d starts")
        for island, proc in procs.items():
            if proc.wait() != 0:
                print(f"island {island} failed: see {out / (island + '.log')}")
    finally:
        server.shutdown()
    for island, label in (("c", "c healed"), ("d", "d healed")):
        joined = rounds(out, island)
        if joined:
            events.append((int(joined[0]["swarm/outer_steps"]), label))
    table = timeline(out, ["a", "b", "c", "d"])
    before = timeline(out, ["c.before_kill"])
    for r, entry in before.items():
        if "c.before_kill" in entry["losses"]:
            table.setdefault(r, {"losses": {}, "islands": entry.get("islands", 0)})
            table[r]["losses"].setdefault("c", entry["losses"]["c.before_kill"])
    table = dict(sorted(table.items()))
    print("round  islands  " + "  ".join(f"loss {i:>4}" for i in "abcd"))
    for r, entry in table.items():
        losses = "  ".join(
            f"{entry['losses'][i]:9.3f}" if i in entry["losses"] else " " * 9 for i in "abcd"
        )
        print(f"{r:5d}  {entry.get('islands', 0):7d}  {losses}")
    plot(table, events, out / "timeline.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="elastic_demo")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--island", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.island is None:
        drive(args)
    else:
        run_island(args)


if __name__ == "__main__":
    main()
