"""Learning quality of DiLoCo settings on the main job, against DDP and no-sync at equal steps.

Runs the Hydra app (the README's main job: byte-level GPT on the standard library's sources, one
CPU rank per island) once per (setting, islands, steps), sequentially, and records for each run
the final validation loss, the bytes sent across islands per rank, the wall time and the exact
command. ``ddp`` (gradients every step) and ``no_sync`` (islands that never sync) at the same
islands and steps are the two ends: a setting's quality is the share of the no-sync-to-DDP gap
it closes, ``(loss_no_sync - loss) / (loss_no_sync - loss_ddp)``.

The model is the issue's: 2 layers, width 128, AdamW 3e-3 (``MODEL``). Settings live in
``SETTINGS`` (outer optimizer, H, schedules from ``quality_schedules``); a plan is a list of
names. Results go to a JSON file, one record per run, written as each run ends; a run whose key
is already there is skipped, so an interrupted sweep resumes where it stopped.

Usage:
    python benchmarks/quality_sweep.py --steps 600 --islands 2 --only ddp no_sync paper
    python benchmarks/quality_sweep.py --report   # table + plot from the results file
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from mainjob import run_main_job  # noqa: E402

RESULTS = ROOT / "docs" / "quality_results.json"
PLOT = ROOT / "docs" / "quality_loss_vs_bytes.png"
MODEL = ["model.n_layer=2", "model.n_embd=128", "model.lr=3e-3"]
SCHEDULES = "benchmarks.quality_schedules"
SEED = 1234  # conf/train.yaml's seed: runs at another seed carry it in their key
BATCH = 16  # sequences per rank per step: conf/data/stdlib.yaml


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: a strategy group and its overrides."""

    group: str  # ddp | no_sync | swarm
    outer: tuple[float, float, bool] = (0.7, 0.9, True)  # SGD lr, momentum, Nesterov
    sync_every: int = 50
    outer_schedule: dict[str, Any] = field(default_factory=dict)
    inner_schedule: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    # DDP measured in one process with the islands' global batch (see ``command``)
    one_rank: bool = False

    def overrides(self) -> list[str]:
        out = [f"strategy={self.group}"]
        if self.group == "swarm":
            lr, momentum, nesterov = self.outer
            out += [
                f"strategy.sync_every={self.sync_every}",
                f"strategy.outer_optimizer.lr={lr}",
                f"strategy.outer_optimizer.momentum={momentum}",
                f"strategy.outer_optimizer.nesterov={str(nesterov).lower()}",
                # The settings recorded here ran with a constant outer momentum (issue 40's
                # schedule came later): keep them reproducible.
                "strategy.outer_momentum_warmup=0.0",
                "strategy.outer_momentum_cooldown=0.0",
            ]
        for key, cls, options in (
            ("outer_lr", "OuterLrSchedule", self.outer_schedule),
            ("inner_lr", "InnerLrSchedule", self.inner_schedule),
        ):
            if options:
                out.append(f"+callbacks.{key}._target_={SCHEDULES}.{cls}")
                out.append(f"+callbacks.{key}.sync_every={self.sync_every}")
                out += [f"+callbacks.{key}.{k}={v}" for k, v in options.items()]
        return out


_COS_INNER = {"kind": "cosine", "final": 0.1}
SETTINGS: dict[str, Setting] = {
    "ddp": Setting("ddp", one_rank=True, note="gradients averaged every step, one rank"),
    "ddp_ranks": Setting("ddp", note="gradients averaged every step, one rank per island"),
    "no_sync": Setting("no_sync", note="islands never sync"),
    "paper": Setting("swarm", note="DiLoCo paper: outer SGD 0.7, Nesterov 0.9"),
    "sgd1.0_m0.5": Setting("swarm", (1.0, 0.5, False), note="issue's best so far"),
    "avg": Setting("swarm", (1.0, 0.0, False), note="plain model averaging (outer lr 1)"),
    "avg_lr1.2": Setting("swarm", (1.2, 0.0, False), note="outer lr above 1, no momentum"),
    "avg_h25": Setting("swarm", (1.0, 0.0, False), sync_every=25),
    "avg_h100": Setting("swarm", (1.0, 0.0, False), sync_every=100),
    "sgd1.0_n0.5": Setting("swarm", (1.0, 0.5, True)),
    "sgd1.2_m0.5": Setting("swarm", (1.2, 0.5, False)),
    "sgd0.7_n0.5": Setting("swarm", (0.7, 0.5, True)),
    "sgd1.0_m0.5_h25": Setting("swarm", (1.0, 0.5, False), sync_every=25),
    "sgd1.0_m0.5_h100": Setting("swarm", (1.0, 0.5, False), sync_every=100),
    "paper_h25": Setting("swarm", sync_every=25),
    "sgd1.0_m0.5_owarm": Setting(
        "swarm",
        (1.0, 0.5, False),
        outer_schedule={"kind": "warmup", "final": 0.3, "warmup_rounds": 4},
    ),
    "sgd1.0_m0.5_odecay": Setting(
        "swarm", (1.0, 0.5, False), outer_schedule={"kind": "cosine", "final": 0.5}
    ),
    "sgd1.0_m0.5_oramp": Setting(
        "swarm", (1.0, 0.5, False), outer_schedule={"kind": "linear", "final": 1.5}
    ),
    "paper_odecay": Setting("swarm", outer_schedule={"kind": "cosine", "final": 0.1}),
    "ddp_icos": Setting("ddp", inner_schedule=_COS_INNER, one_rank=True, note="inner cosine"),
    "no_sync_icos": Setting("no_sync", inner_schedule=_COS_INNER, note="inner lr cosine to 10%"),
    "sgd1.0_m0.5_icos": Setting("swarm", (1.0, 0.5, False), inner_schedule=_COS_INNER),
}
# Which baselines a setting is measured against (an inner schedule changes both ends).
BASELINES = {"icos": ("ddp_icos", "no_sync_icos")}


def run_key(name: str, islands: int, steps: int, seed: int = SEED) -> str:
    return f"{name}@{islands}x{steps}" + ("" if seed == SEED else f"-s{seed}")


def seed_of(record: dict[str, Any]) -> int:
    return int(record.get("seed", SEED))


def group_of(record: dict[str, Any]) -> tuple[int, int, int]:
    """Runs comparable with each other: same islands, steps and seed."""
    return record["islands"], record["steps"], seed_of(record)


def command(
    name: str, islands: int, steps: int, extra: tuple[str, ...] = (), seed: int = SEED
) -> list[str]:
    """The main job's overrides of one run (what a user would type after ``swarm-train``).

    ``one_rank`` DDP runs as one rank whose batch is the islands' global batch: the same
    update (DDP averages equal-sized per-rank mean gradients, then clips the average), the
    same samples per step, in another order. On a shared CPU it avoids DDP's per-step
    all-reduce, where a starved rank stalls the others (measured here: a 600-step 2-rank DDP
    run took over 16 minutes at load 11, under nice 19).
    """
    setting = SETTINGS[name]
    ranks = [f"trainer.devices={islands}"]
    if setting.one_rank:
        ranks = ["trainer.devices=1", f"data.batch_size={BATCH * islands}"]
    return [
        *setting.overrides(),
        *MODEL,
        *ranks,
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={max(1, steps // 10)}",  # a validation curve, ~2% cost
        "trainer.enable_progress_bar=false",
        "logger=csv",
        *([] if seed == SEED else [f"seed={seed}"]),  # initialisation and data order
        *extra,
    ]


def run_one(
    name: str, islands: int, steps: int, work: Path, extra: tuple[str, ...] = (), seed: int = SEED
) -> dict[str, Any]:
    overrides = command(name, islands, steps, extra, seed)
    run_dir = work / run_key(name, islands, steps, seed)
    shutil.rmtree(run_dir, ignore_errors=True)  # a killed earlier attempt's logs
    # A one-rank DDP run does the islands' work in one process: give it their threads.
    threads = min(islands, os.cpu_count() or 1) if SETTINGS[name].one_rank else 1
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        summary = run_main_job(overrides, run_dir)
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    return {
        "name": name,
        "islands": islands,
        "steps": steps,
        "seed": seed,
        "sync_every": SETTINGS[name].sync_every if SETTINGS[name].group == "swarm" else None,
        "overrides": overrides,
        "val_loss": summary["val_loss"],
        "bytes_sent_per_rank": summary.get("bytes_sent_per_rank"),
        "ddp_bytes_per_rank": summary.get("ddp_bytes_per_rank"),
        "outer_steps": summary.get("outer_steps"),
        "val_curve": val_curve(run_dir),
        "wall_s": summary["wall_s"],
        "threads_per_rank": threads,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss) at every validation of the run, from the CSV logger."""
    files = sorted(run_dir.glob("logs/version_*/metrics.csv"))
    if not files:
        return []
    with open(files[-1]) as f:
        rows = list(csv.DictReader(f))
    return [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]


def load(path: Path) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else {}


def sweep(
    names: list[str],
    islands: int,
    steps: int,
    results: Path,
    work: Path,
    extra: tuple[str, ...] = (),
    seed: int = SEED,
) -> None:
    """Run each missing (name, islands, steps, seed), saving the file after every run."""
    for name in names:
        if name not in SETTINGS:
            raise ValueError(f"unknown setting {name!r}; known: {sorted(SETTINGS)}")
    todo = [n for n in names if run_key(n, islands, steps, seed) not in load(results)]
    print(f"{len(names) - len(todo)} of {len(names)} already in {results}", flush=True)
    start = time.perf_counter()
    for i, name in enumerate(todo, 1):
        elapsed = time.perf_counter() - start
        eta = f"{elapsed / (i - 1) * (len(todo) - i + 1) / 60:.1f} min" if i > 1 else "?"
        print(
            f"[{i}/{len(todo)}] {run_key(name, islands, steps, seed)}: "
            f"elapsed {elapsed / 60:.1f} min, ETA {eta}",
            flush=True,
        )
        record = run_one(name, islands, steps, work, extra, seed)
        done = load(results)  # re-read: another sweep may have written meanwhile
        done[run_key(name, islands, steps, seed)] = record
        results.write_text(json.dumps(done, indent=1) + "\n")
        print(f"    val_loss {record['val_loss']:.4f}, {record['wall_s']:.0f} s", flush=True)


def with_curve_ends(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Add missing DDP / no-sync ends read off a longer run's validation curve.

    The inner schedule of a setting without schedules does not depend on ``max_steps``
    (warm-up, then constant), so a baseline's state after ``n`` steps of a longer run is the
    state a run of ``n`` steps ends in; its validation at step ``n`` stands in for that run.
    Such records carry ``derived_from`` (the longer run's key) and no wall time.
    """
    out = dict(results)
    ends = {"ddp", "no_sync", *(n for pair in BASELINES.values() for n in pair)}
    for islands, steps, seed in {group_of(r) for r in results.values()}:
        have = {r["name"] for r in results.values() if group_of(r) == (islands, steps, seed)}
        for name in sorted(ends - have):
            if SETTINGS[name].inner_schedule:
                continue  # a round schedule depends on max_steps
            for key, longer in results.items():
                curve = dict(map(tuple, longer.get("val_curve") or []))
                same = (longer["name"], longer["islands"], seed_of(longer)) == (name, islands, seed)
                if same and longer["steps"] > steps and steps - 1 in curve:
                    out[run_key(name, islands, steps, seed)] = {
                        **longer,
                        "steps": steps,
                        "val_loss": curve[steps - 1],
                        "val_curve": [p for p in longer["val_curve"] if p[0] < steps],
                        "derived_from": key,
                        "wall_s": None,
                    }
                    break
    return out


def gap_closed(record: dict[str, Any], results: dict[str, dict[str, Any]]) -> float | None:
    """Share of the no-sync-to-DDP gap the run closes (None until both ends are measured)."""
    suffix = next((s for s in BASELINES if record["name"].endswith(s)), None)
    ddp_name, floor_name = BASELINES[suffix] if suffix else ("ddp", "no_sync")
    where = (record["islands"], record["steps"], seed_of(record))
    ddp, floor = results.get(run_key(ddp_name, *where)), results.get(run_key(floor_name, *where))
    if ddp is None or floor is None or floor["val_loss"] == ddp["val_loss"]:
        return None
    return (floor["val_loss"] - record["val_loss"]) / (floor["val_loss"] - ddp["val_loss"])


def bytes_sent(record: dict[str, Any], results: dict[str, dict[str, Any]]) -> float | None:
    """Bytes per rank across islands; DDP's is the strategy's ring count at every step."""
    if record["bytes_sent_per_rank"] is not None and SETTINGS[record["name"]].group != "ddp":
        return float(record["bytes_sent_per_rank"])
    for other in results.values():
        same = (other["islands"], other["steps"]) == (record["islands"], record["steps"])
        if same and other.get("ddp_bytes_per_rank"):
            return float(other["ddp_bytes_per_rank"])
    return None


def describe(name: str) -> str:
    s = SETTINGS[name]
    if s.group != "swarm":
        text = s.group
    else:
        lr, momentum, nesterov = s.outer
        text = f"H={s.sync_every}, SGD {lr} {'Nesterov' if nesterov else 'momentum'} {momentum}"
    for label, options in (("outer lr", s.outer_schedule), ("inner lr", s.inner_schedule)):
        if options:
            text += f", {label} {'/'.join(str(v) for v in options.values())}"
    return text


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| run | islands | steps | setting | val loss | gap closed | bytes sent / rank "
        "| wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = list(SETTINGS)
    records = sorted(results.values(), key=lambda r: (*group_of(r), order.index(r["name"])))
    for r in records:
        gap, sent = gap_closed(r, results), bytes_sent(r, results)
        origin = f" (step {r['steps']} of {r['derived_from']})" if "derived_from" in r else ""
        origin += "" if seed_of(r) == SEED else f", seed {seed_of(r)}"
        wall = "—" if r["wall_s"] is None else f"{r['wall_s']:.0f}"
        rows.append(
            f"| {r['name']} | {r['islands']} | {r['steps']} | {describe(r['name'])}{origin} | "
            f"{r['val_loss']:.4f} | {'—' if gap is None else f'{100 * gap:.0f}%'} | "
            f"{'—' if sent is None else f'{sent / 1e6:,.1f} MB'} | {wall} |"
        )
    return "\n".join(rows)


def merged_curve(results: dict[str, dict[str, Any]], name: str, islands: int) -> dict[int, float]:
    """Every validation point of ``name`` at ``islands`` (default seed), over all its runs' curves.

    Runs of one setting differ only in length; without a round schedule they follow one
    trajectory, so their curves agree where they overlap and together extend each other.
    """
    points: dict[int, float] = {}
    for r in results.values():
        same = (r["name"], r["islands"], seed_of(r)) == (name, islands, SEED)
        if same and "derived_from" not in r:
            points.update((int(step), float(loss)) for step, loss in r.get("val_curve") or [])
    return points


def curve_table(results: dict[str, dict[str, Any]], islands: int, steps: int) -> str:
    """Gap closed at each validation of the runs at (islands, steps), from their curves."""
    lows, highs = merged_curve(results, "ddp", islands), merged_curve(results, "no_sync", islands)
    marks = [m for m in sorted(lows) if m in highs and m < steps and highs[m] != lows[m]]
    runs = [
        r
        for r in results.values()
        if group_of(r) == (islands, steps, SEED)
        and SETTINGS[r["name"]].group == "swarm"
        and not SETTINGS[r["name"]].inner_schedule
    ]
    # only the validations these runs made (the ends' curves may come from other lengths)
    marks = [m for m in marks if any(m in dict(map(tuple, r.get("val_curve", []))) for r in runs)]
    if not marks or not runs:
        return ""
    head = "| run | " + " | ".join(f"step {m + 1}" for m in marks) + " |"
    rows = [head, "|---|" + "---|" * len(marks)]
    for r in runs:
        curve = dict(map(tuple, r.get("val_curve", [])))
        cells = [
            f"{100 * (highs[m] - curve[m]) / (highs[m] - lows[m]):.0f}%" if m in curve else "—"
            for m in marks
        ]
        rows.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Final validation loss against bytes sent, one panel per (islands, steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # panels only where some setting synced: a lone baseline has nothing to compare with
    groups = sorted(
        {
            (r["islands"], r["steps"])
            for r in results.values()
            if SETTINGS[r["name"]].group == "swarm" and seed_of(r) == SEED
        }
    )
    cols = min(2, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.8 * rows), squeeze=False)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    for ax, (islands, steps) in zip(axes.flat, groups, strict=False):
        runs = [r for r in results.values() if group_of(r) == (islands, steps, SEED)]
        runs.sort(key=lambda r: r["val_loss"])
        for i, r in enumerate(runs):
            sent = bytes_sent(r, results)
            scheduled = bool(SETTINGS[r["name"]].inner_schedule)  # against its own ends
            if not sent or r["name"].startswith("no_sync"):
                style = {"ls": ":" if scheduled else "--", "color": "grey", "lw": 1}
                ax.axhline(r["val_loss"], **style)  # type: ignore[arg-type]
                ax.annotate(r["name"], (0.01, r["val_loss"]), xycoords=("axes fraction", "data"))
                continue
            color = "C3" if SETTINGS[r["name"]].group == "ddp" else "C0"
            ax.scatter([sent], [r["val_loss"]], color=color, marker="x" if scheduled else "o")
            # points at equal bytes sit on one vertical line: label them left and right in turn
            left = i % 2 == 1
            ax.annotate(
                r["name"],
                (sent, r["val_loss"]),
                xytext=(-6 if left else 6, -3),
                textcoords="offset points",
                ha="right" if left else "left",
                fontsize=7,
            )
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent across islands per rank")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"{islands} islands, {steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def seed_table(results: dict[str, dict[str, Any]]) -> str:
    """Gap closed by each setting measured at more than one seed, per seed and on average."""
    gaps: dict[tuple[str, int, int], dict[int, float]] = {}
    for r in results.values():
        gap = gap_closed(r, results)
        if gap is not None and SETTINGS[r["name"]].group == "swarm":
            gaps.setdefault((r["name"], r["islands"], r["steps"]), {})[seed_of(r)] = gap
    rows = ["| run | islands | steps | gap closed by seed | mean |", "|---|---|---|---|---|"]
    for (name, islands, steps), by_seed in sorted(gaps.items()):
        if len(by_seed) < 2:
            continue
        cells = ", ".join(f"{100 * g:.0f}% (seed {s})" for s, g in sorted(by_seed.items()))
        mean = 100 * sum(by_seed.values()) / len(by_seed)
        rows.append(f"| {name} | {islands} | {steps} | {cells} | {mean:.0f}% |")
    return "\n".join(rows) if len(rows) > 2 else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=["ddp", "no_sync", "paper"])
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--work", type=Path, default=Path("/tmp/quality_runs"))
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the runs (and their ends)")
    parser.add_argument("--report", action="store_true", help="only print the table and plot")
    args = parser.parse_args(argv)
    if not args.report:
        sweep(
            args.only,
            args.islands,
            args.steps,
            args.results,
            args.work,
            tuple(args.extra),
            args.seed,
        )
    results = with_curve_ends(load(args.results))
    print(table(results))
    seeds = seed_table(results)
    if seeds:
        print(f"\nsettings measured at several seeds\n{seeds}")
    for islands, steps in sorted({(r["islands"], r["steps"]) for r in results.values()}):
        curves = curve_table(results, islands, steps)
        if curves:
            print(f"\nshare of the gap closed along the run, {islands} islands, {steps} steps")
            print(curves)
    if any(SETTINGS[r["name"]].group == "swarm" for r in results.values()):
        plot(results, args.plot)


if __name__ == "__main__":
    main()
