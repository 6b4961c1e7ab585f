"""Quality check: does the swarm close the gap to DDP on *your* model? (issue 40, item 4)

For one LightningModule and its data, runs at the same islands, steps and seed:
- ``ddp``: gradients averaged every step, by default over one rank per island (``--ddp ranks``):
  each rank reads the batches its island reads, so DDP, ``local`` and the swarm train on the
  same data in the same order and the share compares the syncing alone; ``--ddp one_rank``
  runs it as one rank with the islands' global batch (one process, but its own data order,
  whose luck then enters the share: docs/tuning.md);
- ``local``: the islands train alone, never syncing (``SwarmStrategy`` with no round);
- the swarm variants asked for: ``default`` is ``SwarmStrategy`` as configured, with the
  library's default outer optimizer; the others (``VARIANTS``) set the outer step;
and prints each variant's share of the gap closed, ``(local - ours) / (local - ddp)``, on the
final validation metric. 100% matches DDP; below 0% is worse than never syncing.

Each run is one ``Trainer.fit`` in a subprocess (``_run``), one CPU rank per island over gloo
(Lightning ``devices=k``), ``OMP_NUM_THREADS=1`` per rank. Results go to a JSON file, one record
per run with its validation curve, saved as each run ends; runs already there are skipped.

Usage:
    # a built-in workload (benchmarks/quality_workloads.py): demo_gpt, litgpt, cnn
    python benchmarks/quality_check.py --workload cnn --islands 2 --steps 300
    # your model: import paths of a LightningModule and a LightningDataModule
    python benchmarks/quality_check.py --module my_pkg.model:MyModule \\
        --data my_pkg.data:MyData --data-args '{"batch_size": 32}' --islands 2 --steps 300
    python benchmarks/quality_check.py --report --results quality_check.json

``--ddp one_rank`` needs the data module to take ``batch_size``. The ``litgpt``
workload needs ``pip install --no-deps litgpt==0.5.13`` (its import needs nothing else here).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


@dataclass(frozen=True)
class Variant:
    """How a run syncs: ``kind`` ddp / local / swarm; a swarm's outer SGD (``lr`` None: the
    library's default optimizer), ``lr`` times sqrt(islands) with ``lr_sqrt_islands``, and the
    ``OuterStepSchedule`` options (quality_schedules.py)."""

    kind: str
    lr: float | None = None
    momentum: float = 0.0
    nesterov: bool = False
    lr_sqrt_islands: bool = False
    lr_by_inner: bool = False
    momentum_warmup_rounds: int = 0
    momentum_by_inner: bool = False
    momentum_shares: tuple[float, float] | None = None
    warm_start_steps: int = 0
    note: str = ""


VARIANTS: dict[str, Variant] = {
    "ddp": Variant("ddp", note="gradients averaged every step"),
    "local": Variant("local", note="islands never sync"),
    "default": Variant("swarm", note="the library's default outer optimizer"),
    "paper": Variant("swarm", 0.7, 0.9, True, note="DiLoCo paper: SGD 0.7, Nesterov 0.9"),
    "avg": Variant("swarm", 1.0, note="plain averaging: SGD 1.0, no momentum"),
    "paper_inner_lr": Variant(
        "swarm", 0.7, 0.9, True, lr_by_inner=True, note="paper's, outer lr x inner lr ratio"
    ),
    "paper_momentum_warmup": Variant(
        "swarm", 0.7, 0.9, True, momentum_warmup_rounds=6, note="paper's, momentum 0->0.9 in 6"
    ),
    "paper_momentum_warmup_inner": Variant(
        "swarm",
        0.7,
        0.9,
        True,
        momentum_warmup_rounds=6,
        momentum_by_inner=True,
        note="paper's, momentum 0->0.9 in 6 rounds, x inner lr ratio",
    ),
    "nesterov_warm_half": Variant(
        "swarm",
        0.7,
        0.9,
        True,
        momentum_shares=(0.5, 0.0),
        note="paper's, momentum 0->0.9 over the first half of the rounds",
    ),
    "nesterov_warm_cool": Variant(
        "swarm",
        0.7,
        0.9,
        True,
        momentum_shares=(0.5, 0.25),
        note="paper's, momentum 0->0.9 over the first half of the rounds, ->0 over the last 1/4",
    ),
    "nesterov_warm_half_cool_half": Variant(
        "swarm",
        0.7,
        0.9,
        True,
        momentum_shares=(0.5, 0.5),
        note="paper's, momentum 0->0.9 over the first half of the rounds, ->0 over the second",
    ),
    "nesterov_warm_quarter_cool_rest": Variant(
        "swarm",
        0.7,
        0.9,
        True,
        momentum_shares=(0.25, 0.75),
        note="paper's, momentum 0->0.9 over the first quarter of the rounds, ->0 over the rest",
    ),
    "nesterov_lr1_warm_cool": Variant(
        "swarm",
        1.0,
        0.9,
        True,
        momentum_shares=(0.5, 0.25),
        note="outer lr 1.0, Nesterov, momentum 0->0.9 over the first half, ->0 over the last 1/4",
    ),
    "warm_start_50": Variant(
        "swarm", warm_start_steps=50, note="default outer step after 50 synchronous steps"
    ),
    "warm_start_100": Variant(
        "swarm", warm_start_steps=100, note="default outer step after 100 synchronous steps"
    ),
    "avg_sqrt_islands": Variant(
        "swarm", 1.0, lr_sqrt_islands=True, note="no momentum, outer lr sqrt(islands)"
    ),
    "avg_inner_lr": Variant(
        "swarm", 1.0, lr_by_inner=True, note="plain averaging, outer lr x inner lr ratio"
    ),
}


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"{path!r} is not an import path; write it as package.module:Class.")
    return getattr(importlib.import_module(module), name)


def workload_of(spec: dict[str, Any]) -> Any:
    """The spec's ``Workload``: a built-in one by name, or one built from import paths."""
    from quality_workloads import WORKLOADS, Workload

    if spec.get("workload"):
        base = WORKLOADS[spec["workload"]]
    else:
        base = Workload(_import(spec["module"]), _import(spec["data"]))
    return Workload(
        base.module,
        base.data,
        {**base.module_args, **spec.get("module_args", {})},
        {**base.data_args, **spec.get("data_args", {})},
        {**base.trainer_args, **spec.get("trainer_args", {})},
        spec.get("metric") or base.metric,
    )


def run_spec(spec: dict[str, Any]) -> None:
    """One ``Trainer.fit`` as ``spec`` says (every rank runs this; Lightning relaunches the
    command for ranks 1..k-1). Global rank 0 writes the result to ``spec["out"]``."""
    import torch
    from lightning.pytorch.strategies import DDPStrategy, Strategy
    from quality_schedules import OuterStepSchedule

    from lightning_swarm import SwarmStrategy

    variant, islands = Variant(**spec["variant"]), int(spec["islands"])
    work = workload_of(spec)
    data_args = dict(work.data_args)
    recorder = _Recorder(work.metric)
    devices, callbacks = islands, list[Callback]([recorder])
    strategy: str | Strategy = "auto"
    if variant.kind == "ddp" and spec["ddp"] == "one_rank":
        # DDP averages equal per-rank mean gradients: one rank with the global batch takes
        # the same update without a per-step all-reduce between starved CPU processes.
        if "batch_size" not in data_args:
            raise ValueError("--ddp one_rank needs the data module's batch_size in --data-args.")
        devices = 1
        data_args["batch_size"] = data_args["batch_size"] * islands
    elif variant.kind == "ddp":
        strategy = DDPStrategy(process_group_backend="gloo", start_method="popen")
    elif variant.kind == "local":
        strategy = SwarmStrategy(sync_every=10**9, sync_at_end=False, **spec["swarm_args"])
    else:
        outer = None
        if variant.lr is not None:
            lr = variant.lr * (math.sqrt(islands) if variant.lr_sqrt_islands else 1.0)
            outer = partial(
                torch.optim.SGD, lr=lr, momentum=variant.momentum, nesterov=variant.nesterov
            )
        swarm_args = dict(spec["swarm_args"])
        if variant.warm_start_steps:
            swarm_args.setdefault("warm_start_steps", variant.warm_start_steps)
        if outer is not None:  # today's presets and the candidates: momentum as given
            swarm_args.setdefault("outer_momentum_warmup", 0.0)
            swarm_args.setdefault("outer_momentum_cooldown", 0.0)
        strategy = SwarmStrategy(sync_every=spec["sync_every"], outer_optimizer=outer, **swarm_args)
        if (
            variant.lr_by_inner
            or variant.momentum_warmup_rounds
            or variant.momentum_by_inner
            or variant.momentum_shares
        ):
            shares = variant.momentum_shares
            schedule = OuterStepSchedule(
                variant.lr_by_inner,
                variant.momentum_warmup_rounds,
                variant.momentum_by_inner,
                None if shares is None else (float(shares[0]), float(shares[1])),
            )
            callbacks.append(schedule)
    pl.seed_everything(spec["seed"], workers=True)
    module = work.module(**work.module_args)
    data = work.data(**data_args)
    trainer = quiet_trainer(work, devices, strategy, spec["steps"], spec["eval_every"], callbacks)
    start = time.perf_counter()
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        result = {"curve": recorder.curve, "fit_s": time.perf_counter() - start}
        Path(spec["out"]).write_text(json.dumps(result))


def quiet_trainer(
    work: Any,
    devices: int,
    strategy: Any,
    steps: int,
    eval_every: int,
    callbacks: list[Callback],
    **options: Any,
) -> pl.Trainer:
    """A CPU Trainer for ``steps`` optimizer steps of ``work`` (its own Trainer options on top),
    validating every ``eval_every`` optimizer steps, with no logger, checkpoint or bars."""
    accumulate = int(work.trainer_args.get("accumulate_grad_batches", 1))
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        val_check_interval=eval_every * accumulate,  # batches, not optimizer steps
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **options,
        **work.trainer_args,
    )


class _Recorder(Callback):
    """(optimizer step, metric) at each validation."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.curve: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            raise KeyError(f"no {self.metric!r} logged in validation; pass --metric.")
        self.curve.append((int(trainer.global_step), float(value)))


def run_key(spec: dict[str, Any]) -> str:
    name = spec.get("workload") or spec["module"]
    return f"{name}/{spec['variant_name']}@{spec['islands']}x{spec['steps']}-s{spec['seed']}"


def run_one(spec: dict[str, Any], work_dir: Path) -> dict[str, Any]:
    """Run ``spec`` in a subprocess; its record (spec, curve, final value, wall time)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tag = run_key(spec).replace("/", "_").replace(":", "_")
    spec = {**spec, "out": str(work_dir / f"{tag}.out.json")}
    spec_path = work_dir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    one_rank = spec["variant"]["kind"] == "ddp" and spec["ddp"] == "one_rank"
    threads = min(int(spec["islands"]), os.cpu_count() or 1) if one_rank else 1
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.getcwd(), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "_run", str(spec_path)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"run {run_key(spec)} failed:\n{done.stderr[-4000:]}")
    result = json.loads(Path(spec["out"]).read_text())
    curve = [tuple(p) for p in result["curve"]]
    spec.pop("out")
    return {**spec, "curve": curve, "final": curve[-1][1], "wall_s": wall}


def load(path: Path) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else {}


def gap_closed(record: dict[str, Any], results: dict[str, dict[str, Any]]) -> float | None:
    """``(local - ours) / (local - ddp)`` on the final value; None until both ends exist."""
    ends = []
    for end in ("ddp", "local"):
        key = run_key({**record, "variant_name": end})
        if key not in results:
            return None
        ends.append(results[key]["final"])
    ddp, local = ends
    return None if local == ddp else (local - record["final"]) / (local - ddp)


def with_ddp_from(
    results: dict[str, dict[str, Any]], baselines: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``results`` with its DDP runs replaced by the DDP runs of ``baselines`` (a point whose
    DDP run ``baselines`` lacks has none, so no share)."""
    kept = {k: r for k, r in results.items() if r["variant"]["kind"] != "ddp"}
    return kept | {k: r for k, r in baselines.items() if r["variant"]["kind"] == "ddp"}


def summary(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, islands, steps, variant): final values and shares by seed."""
    rows: dict[tuple[str, int, int, str], dict[str, Any]] = {}
    for record in results.values():
        name = record.get("workload") or record["module"]
        key = (name, record["islands"], record["steps"], record["variant_name"])
        row = rows.setdefault(key, {"finals": {}, "shares": {}})
        row["finals"][record["seed"]] = record["final"]
        share = gap_closed(record, results)
        if share is not None and record["variant"]["kind"] == "swarm":
            row["shares"][record["seed"]] = share
    out = []
    for (name, islands, steps, variant), row in sorted(rows.items()):
        shares = list(row["shares"].values())
        mean = sum(shares) / len(shares) if shares else None
        spread = (max(shares) - min(shares)) / 2 if len(shares) > 1 else None
        out.append(
            {"workload": name, "islands": islands, "steps": steps, "variant": variant, **row}
            | {"mean_share": mean, "half_range": spread, "min_share": min(shares, default=None)}
        )
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| workload | islands | steps | variant | final loss by seed | share of gap by seed "
        "| mean share (± half range) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary(results):
        finals = ", ".join(f"{v:.4f}" for _, v in sorted(row["finals"].items()))
        shares = ", ".join(f"{100 * v:.0f}%" for _, v in sorted(row["shares"].items())) or "—"
        mean = "—" if row["mean_share"] is None else f"{100 * row['mean_share']:.0f}%"
        if row["half_range"] is not None:
            mean += f" (± {100 * row['half_range']:.0f})"
        lines.append(
            f"| {row['workload']} | {row['islands']} | {row['steps']} | {row['variant']} | "
            f"{finals} | {shares} | {mean} |"
        )
    return "\n".join(lines)


def pivot(results: dict[str, dict[str, Any]]) -> str:
    """Share of the gap, one row per swarm variant, one column per (workload, islands, steps):
    the mean over seeds, each seed's share in brackets."""
    rows = [r for r in summary(results) if r["mean_share"] is not None]
    points = sorted({(r["workload"], r["islands"], r["steps"]) for r in rows})
    variants = list(dict.fromkeys(v for v in VARIANTS for r in rows if r["variant"] == v))
    cells = {(r["variant"], (r["workload"], r["islands"], r["steps"])): r for r in rows}
    head = " | ".join(f"{w}, {k} islands, {n} steps" for w, k, n in points)
    lines = [f"| variant | {head} |", "|---" * (len(points) + 1) + "|"]
    for variant in variants:
        out = []
        for point in points:
            row = cells.get((variant, point))
            if row is None:
                out.append("not run")
                continue
            seeds = ", ".join(f"{100 * v:.0f}" for _, v in sorted(row["shares"].items()))
            out.append(f"{100 * row['mean_share']:.0f}% ({seeds})")
        lines.append(f"| {variant} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Validation curves, one panel per (workload, islands, steps), mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def name(r: dict[str, Any]) -> str:
        return str(r.get("workload") or r["module"])

    panels = sorted({(name(r), r["islands"], r["steps"]) for r in results.values()})
    cols = min(2, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        curves: dict[str, list[list[tuple[int, float]]]] = {}
        for r in results.values():
            if (name(r), r["islands"], r["steps"]) == panel:
                curves.setdefault(r["variant_name"], []).append(r["curve"])
        for variant, runs in sorted(curves.items()):
            steps = [s for s, _ in runs[0]]
            mean = [sum(c[i][1] for c in runs) / len(runs) for i in range(len(steps))]
            style = {"ddp": "k-", "local": "k--"}.get(variant, "-")
            ax.plot(steps, mean, style, label=variant, lw=1.2)
        ax.set_title(f"{panel[0]}, {panel[1]} islands, {panel[2]} steps")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (mean over seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_run"]:
        run_spec(json.loads(Path(argv[1]).read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=["demo_gpt", "litgpt", "cnn"])
    parser.add_argument("--module", help="your LightningModule, package.module:Class")
    parser.add_argument("--data", help="your LightningDataModule, package.module:Class")
    for what in ("module", "data", "trainer", "swarm"):
        parser.add_argument(f"--{what}-args", type=json.loads, default={}, help="JSON object")
    parser.add_argument("--metric", default=None, help="validation metric (default val_loss)")
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=50, help="optimizer steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--variants", nargs="+", default=["ddp", "local", "default"])
    parser.add_argument("--ddp", choices=["ranks", "one_rank"], default="ranks")
    parser.add_argument("--results", type=Path, default=Path("quality_check.json"))
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the curves")
    parser.add_argument("--work", type=Path, default=Path("/tmp/quality_check"))
    parser.add_argument("--report", action="store_true", help="only print table and plot")
    parser.add_argument(
        "--ddp-from",
        type=Path,
        default=None,
        help="score against the DDP runs of this results file (e.g. --ddp ranks runs) in "
        "place of those in --results",
    )
    args = parser.parse_args(argv)
    if not args.report:
        if bool(args.workload) == bool(args.module and args.data):
            parser.error("give --workload, or --module and --data")
        if args.module and args.ddp == "one_rank" and "batch_size" not in args.data_args:
            parser.error(
                "--ddp one_rank runs DDP as one rank with the islands' global batch: give the "
                "per-island batch in --data-args (e.g. '{\"batch_size\": 32}'), or --ddp ranks."
            )
        unknown = [v for v in args.variants if v not in VARIANTS]
        if unknown:
            parser.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
        base = {
            "workload": args.workload,
            "module": args.module,
            "data": args.data,
            "module_args": args.module_args,
            "data_args": args.data_args,
            "trainer_args": args.trainer_args,
            "swarm_args": args.swarm_args,
            "metric": args.metric,
            "islands": args.islands,
            "steps": args.steps,
            "sync_every": args.sync_every,
            "eval_every": args.eval_every,
            "ddp": args.ddp,
        }
        for seed in args.seeds:
            for name in args.variants:
                spec = {**base, "seed": seed, "variant_name": name}
                spec["variant"] = asdict(VARIANTS[name])
                old = load(args.results).get(run_key(spec))
                if old is not None:
                    if name == "ddp" and old.get("ddp", "one_rank") != args.ddp:
                        parser.error(
                            f"{args.results} holds {run_key(spec)} made with --ddp {old['ddp']}; "
                            f"give another --results file for --ddp {args.ddp} (a share "
                            "compares the runs of one file)."
                        )
                    continue
                record = run_one(spec, args.work)
                done = load(args.results)  # re-read: another check may have written meanwhile
                done[run_key(spec)] = record
                args.results.write_text(json.dumps(done, indent=1) + "\n")
                share = gap_closed(record, done)
                text = "" if share is None else f", {100 * share:.0f}% of the gap"
                print(f"{run_key(spec)}: {record['final']:.4f}{text}, {record['wall_s']:.0f} s")
    results = load(args.results)
    if args.ddp_from is not None:
        results = with_ddp_from(results, load(args.ddp_from))
    print(table(results))
    print(f"\nshare of the gap closed, mean over seeds (each seed)\n{pivot(results)}")
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
