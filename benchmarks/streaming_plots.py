"""Tables and PNG plots from docs/streaming_results.json (written by streaming_main_job.py).

Usage: .venv/bin/python benchmarks/streaming_plots.py
Writes docs/streaming_loss_curves.png and docs/streaming_loss_vs_bytes.png and prints the
Markdown tables quoted in docs/streaming.md.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LABELS = {
    "ddp": "DDP",
    "no_sync": "no sync",
    "diloco_h25": "DiLoCo H=25",
    "diloco_h50": "DiLoCo H=50",
    "diloco_h100": "DiLoCo H=100",
    "streaming_none": "Streaming F=4 tau=1 fp32",
    "streaming_bf16": "Streaming F=4 tau=1 bf16",
    "streaming_int8": "Streaming F=4 tau=1 int8",
    "streaming_int4": "Streaming F=4 tau=1 int4",
    "streaming_int4_ef": "Streaming F=4 tau=1 int4 + EF",
    "streaming_int4_delay0": "Streaming F=4 tau=0 int4",
}


def _ddp_per_step(results: dict[str, Any]) -> float:
    ref = next(r for r in results.values() if r.get("ddp_bytes"))
    return float(ref["ddp_bytes"]) / ref["steps"]


def quality_table(results: dict[str, Any]) -> str:
    base = results.get("diloco_h100", {}).get("val_loss")
    ddp_step = _ddp_per_step(results)
    lines = [
        "| run | final val loss | vs DiLoCo H=100 | bytes sent / rank | bytes per inner step "
        "| DDP / run bytes per step | wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in LABELS.items():
        r = results.get(name)
        if r is None:
            continue
        loss = r.get("val_loss", float("nan"))
        rel = f"{100 * (loss / base - 1):+.2f}%" if base else ""
        if name == "ddp":
            sent, per_step = ddp_step * r["steps"], ddp_step
        elif name == "no_sync":
            sent, per_step = 0.0, 0.0
        else:
            sent, per_step = r.get("bytes_sent", 0.0), r.get("bytes_per_step", float("nan"))
        ratio = f"{ddp_step / per_step:,.0f}x" if per_step else "-"
        lines.append(
            f"| {label} | {loss:.4f} | {rel} | {sent:,.0f} | {per_step:,.0f} | {ratio} | "
            f"{r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def sync_table(results: dict[str, Any]) -> str:
    lines = [
        "| run | rounds | blocked per round, median (ms) | max (ms) | exchange per round, "
        "median (ms) | blocked total (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("diloco_h100", "streaming_int4_delay0", "streaming_int4"):
        r = results.get(name)
        if r is None or not r.get("round_sync_s"):
            continue
        blocked, exchange = r["round_sync_s"], r["round_transport_s"]
        lines.append(
            f"| {LABELS[name]} | {len(blocked)} | {1e3 * statistics.median(blocked):.2f} | "
            f"{1e3 * max(blocked):.2f} | {1e3 * statistics.median(exchange):.2f} | "
            f"{sum(blocked):.3f} |"
        )
    return "\n".join(lines)


def plot_curves(results: dict[str, Any]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("ddp", "diloco_h100", "streaming_int4", "streaming_none", "no_sync"):
        r = results.get(name)
        if r is None or not r["val_curve"]:
            continue
        steps, losses = zip(*r["val_curve"], strict=True)
        ax.plot(steps, losses, marker="o", label=LABELS[name])
    ax.set_xlabel("inner step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title("Main job: validation loss (2 islands, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "streaming_loss_curves.png", dpi=110)
    plt.close(fig)


def plot_loss_vs_bytes(results: dict[str, Any]) -> None:
    ddp_step = _ddp_per_step(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label in LABELS.items():
        r = results.get(name)
        if r is None or name == "no_sync":
            continue
        total = ddp_step * r["steps"] if name == "ddp" else r.get("bytes_sent", 0.0)
        marker = "s" if name == "ddp" else ("o" if name.startswith("diloco") else "^")
        ax.scatter(total, r["val_loss"], marker=marker, s=50, label=label)
    if "no_sync" in results:
        ax.axhline(
            results["no_sync"]["val_loss"], color="grey", ls="--", lw=1, label="no sync (0 bytes)"
        )
    ax.legend(fontsize=7, loc="upper right")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent across islands per rank (whole run, log scale)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Final loss vs bytes exchanged")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(DOCS / "streaming_loss_vs_bytes.png", dpi=110)
    plt.close(fig)


def main() -> None:
    results = json.loads((DOCS / "streaming_results.json").read_text())
    print(quality_table(results))
    print()
    print(sync_table(results))
    plot_curves(results)
    plot_loss_vs_bytes(results)


if __name__ == "__main__":
    main()
