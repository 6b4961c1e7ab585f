"""The end-of-run summary the Hydra app prints and writes to ``summary.json``."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_swarm.strategy import SwarmStrategy


def summarize(trainer: pl.Trainer) -> dict[str, float]:
    """Final figures of a finished run (this rank's view of the cross-island traffic)."""
    metrics = trainer.callback_metrics
    summary: dict[str, float] = {"steps": float(trainer.global_step)}
    for key in ("val_loss", "val_ppl"):
        if key in metrics:
            summary[key] = float(metrics[key])
    strategy = trainer.strategy
    if isinstance(strategy, SwarmStrategy):
        summary["outer_steps"] = float(strategy.totals.outer_steps)
        summary["bytes_sent_per_rank"] = float(strategy.totals.bytes_sent)
        loop = strategy.outer_loop
        summary["ddp_bytes_per_rank"] = float(loop.ddp_equivalent_bytes() if loop else 0)
        summary["sync_wall_s"] = strategy.totals.sync_wall_s
    return summary


_SUMMARY_LABELS = {
    "steps": ("inner steps", "{:.0f}"),
    "val_loss": ("final validation loss", "{:.4f}"),
    "val_ppl": ("final validation perplexity", "{:.3f}"),
    "outer_steps": ("outer steps", "{:.0f}"),
    "bytes_sent_per_rank": ("bytes sent across islands (per rank)", "{:,.0f}"),
    "ddp_bytes_per_rank": ("bytes DDP would have sent (per rank)", "{:,.0f}"),
    "sync_wall_s": ("time in outer syncs (s)", "{:.3f}"),
}


def format_summary(summary: dict[str, float]) -> str:
    lines = ["", "lightning_swarm run summary"]
    for key, (label, fmt) in _SUMMARY_LABELS.items():
        if key in summary:
            lines.append(f"  {label:<40} {fmt.format(summary[key])}")
    sent, ddp = summary.get("bytes_sent_per_rank"), summary.get("ddp_bytes_per_rank")
    if sent and ddp:
        lines.append(f"  {'DDP / swarm traffic ratio':<40} {ddp / sent:.1f}x")
    return "\n".join(lines)
