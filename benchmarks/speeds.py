"""Tables and a plot from runs of the slow-link harness with one slow island (docs/speeds.md).

Each input is the JSON ``benchmarks/wan.py`` prints for one run (``python benchmarks/wan.py
--rate unlimited --slow-island 1 --cpu-quota 0.4 ... > RUN.json``), named ``LABEL=RUN.json``.

Usage: .venv/bin/python benchmarks/speeds.py fixed2=/tmp/fixed2.json budget2=/tmp/budget2.json
Adds (or replaces) the named runs in docs/speeds_results.json, then prints the Markdown table
and draws docs/speeds.png (one panel per island count) from every run recorded there.

Per run and island: inner steps, rounds, fit seconds, the seconds spent inside outer rounds
(the harness's ``sync_in_inner_s`` plus the last step's round), their share of the fit (for
the fast island: its idle fraction, since a round it enters waits for the slowest island), and
the validation losses with their times since the fit started.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def summary(run: dict[str, Any]) -> dict[str, Any]:
    islands = []
    for island in run["islands"]:
        in_rounds = island["sync_in_inner_s"] + island["sync_last_step_s"]
        islands.append(
            {
                "steps": island["steps"],
                "rounds": island["outer_steps"],
                "fit_s": round(island["fit_s"], 1),
                "in_rounds_s": round(in_rounds, 1),
                "in_rounds_share": round(in_rounds / island["fit_s"], 3),
                "val": [
                    (round(t, 1), step, round(loss, 4)) for t, step, loss in island["val_points"]
                ],
            }
        )
    return {"wall_s": round(run["wall_s"], 1), "islands": islands}


def main(argv: list[str]) -> None:
    results = DOCS / "speeds_results.json"
    runs = json.loads(results.read_text()) if results.exists() else {}
    for item in argv:
        label, _, path = item.partition("=")
        runs[label] = summary(json.loads(Path(path).read_text()))
    results.write_text(json.dumps(runs, indent=1) + "\n")
    print(
        "| run | island | inner steps | rounds | fit (s) | in rounds (s) | share | last val loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, run in runs.items():
        for k, island in enumerate(run["islands"]):
            last = island["val"][-1] if island["val"] else None
            val = f"{last[2]} at {last[0]} s" if last else "-"
            print(
                f"| {label} | {k} | {island['steps']} | {island['rounds']} | {island['fit_s']} "
                f"| {island['in_rounds_s']} | {island['in_rounds_share']:.0%} | {val} |"
            )
    counts = sorted({len(run["islands"]) for run in runs.values()})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4), squeeze=False)
    for ax, count in zip(axes[0], counts, strict=True):
        for label, run in runs.items():
            if len(run["islands"]) != count:
                continue
            for k, island in enumerate(run["islands"]):
                if island["val"]:
                    t, _, loss = zip(*island["val"], strict=True)
                    ax.plot(t, loss, marker="o", markersize=2, label=f"{label}, island {k}")
        ax.set_title(f"{count} islands, the last one slow")
        ax.set_xlabel("seconds since the fit started")
        ax.set_ylabel("validation loss (each island's own)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS / "speeds.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
