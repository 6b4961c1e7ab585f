"""The main job's picture: train and validation loss against step, outer rounds marked.
``LossHistory`` records on global rank 0 only; ``write_loss_png`` needs the optional matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

_FLUSH_EVERY = 256  # steps between host reads of the recorded losses

PLOT_EXTRA_HINT = (
    "loss.png not written: matplotlib is not installed; "
    "pip install 'lightning-swarm[plots]' to get the loss plot."
)


@dataclass
class LossCurves:
    """Steps and losses of one run (``rounds``: steps at which an outer round finished)."""

    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)


class LossHistory(Callback):
    """Record the losses and the outer rounds of a run on global rank 0 (island 0's view)."""

    def __init__(self) -> None:
        self.curves = LossCurves()
        self._last_outer: int | None = None
        # Losses still on their device: reading one per step (float()) would stall a GPU run
        # on a host sync every step, so they are read in batches (one sync per flush).
        self._pending: list[tuple[int, Tensor]] = []

    def _flush(self) -> None:
        if self._pending:
            steps, losses = zip(*self._pending, strict=True)
            values = torch.stack(losses).float().cpu().tolist()
            self.curves.train.extend(zip(steps, values, strict=True))
            self._pending.clear()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if not trainer.is_global_zero:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self._pending.append((trainer.global_step, loss.detach().reshape(())))
            if len(self._pending) >= _FLUSH_EVERY:
                self._flush()
        totals = getattr(trainer.strategy, "totals", None)
        outer = None if totals is None else int(totals.outer_steps)
        if outer is not None and self._last_outer is not None and outer > self._last_outer:
            self.curves.rounds.append(trainer.global_step)
        self._last_outer = outer

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()
        value = trainer.callback_metrics.get("val_loss")
        if trainer.is_global_zero and value is not None and not trainer.sanity_checking:
            self.curves.val.append((trainer.global_step, float(value)))


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def write_loss_png(curves: LossCurves, path: Path) -> str:
    """Draw ``curves`` into ``path``; returns the line to print (where it went, or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display is needed, none is opened
        import matplotlib.pyplot as plt
    except ImportError:
        return PLOT_EXTRA_HINT
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, step in enumerate(curves.rounds):
        ax.axvline(step, color="0.8", linewidth=0.8, label="outer round" if i == 0 else None)
    if curves.train:
        steps, losses = zip(*curves.train, strict=True)
        ax.plot(steps, losses, linewidth=0.8, alpha=0.35, color="C0")
        smooth = _moving_average(list(losses), window=max(1, len(losses) // 60))
        ax.plot(steps, smooth, linewidth=1.2, color="C0", label="train loss (island 0)")
    if curves.val:
        ax.plot(*zip(*curves.val, strict=True), "o-", color="C1", label="validation loss")
    ax.set(xlabel="inner step", ylabel="loss", title="lightning_swarm main job")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"loss plot written to {path}"
