"""The Hydra app: compose a run from ``conf/`` and train it.

``swarm-train trainer.devices=4 strategy.sync_every=50 strategy.island_size=2`` (or
``python -m lightning_swarm.cli ...``) reads ``conf/train.yaml`` and its groups (trainer,
strategy, model, data, callbacks, logger), validates the strategy options before any process
starts, trains, and prints a summary on global rank 0.

Structured configs: ``register_configs()`` stores the strategy schema (``SwarmStrategyConf``,
whose fields are ``SwarmConfig``'s plus the outer optimizer and launch options) in Hydra's
ConfigStore under group ``strategy`` as ``swarm_schema``, so a YAML file that lists it in its
defaults gets type checks and unknown-key errors, and a user's own Hydra app can reuse it.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from lightning_swarm.callbacks import HostMemoryCensus
from lightning_swarm.config import SwarmConfig
from lightning_swarm.strategy import SwarmStrategy
from lightning_swarm.topology import IslandTopology

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def _default_outer_optimizer() -> dict[str, Any]:
    return {
        "_target_": "torch.optim.SGD",
        "_partial_": True,
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
    }


@dataclass(kw_only=True)
class SwarmStrategyConf(SwarmConfig):
    """Hydra schema of ``SwarmStrategy``: ``SwarmConfig``'s fields plus non-data options."""

    _target_: str = "lightning_swarm.SwarmStrategy"
    outer_optimizer: Any = field(default_factory=_default_outer_optimizer)
    start_method: str = "popen"
    process_group_backend: str | None = None

    def __post_init__(self) -> None:
        # Validation happens when SwarmStrategy is built from this node, not at schema time.
        pass


def register_configs() -> None:
    """Store the structured configs in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(group="strategy", name="swarm_schema", node=SwarmStrategyConf)


@dataclass
class Run:
    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule


def build(cfg: DictConfig) -> Run:
    """Instantiate everything a run needs; raises ValueError on a bad option, before training."""
    strategy = instantiate(cfg.strategy, _convert_="all")
    if isinstance(strategy, SwarmStrategy):
        devices, num_nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
        if isinstance(devices, int):
            # Fails here, in the launching process, instead of once per rank after the launch.
            IslandTopology(
                world_size=devices * num_nodes,
                island_size=strategy.config.island_size,
                global_rank=0,
            )
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    census = cfg.get("census")
    has_census = any(isinstance(c, HostMemoryCensus) for c in callbacks)
    if census is not None and census.enabled and not has_census:
        options = {str(k): v for k, v in census.items() if k != "enabled"}
        callbacks.append(HostMemoryCensus(**options))
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    if logger is False:
        callbacks = _without_logger_callbacks(callbacks)
    trainer = pl.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),  # type: ignore[arg-type]
        strategy=strategy,
        callbacks=callbacks,
        logger=logger,
    )
    return Run(trainer=trainer, model=instantiate(cfg.model), datamodule=instantiate(cfg.data))


def _without_logger_callbacks(callbacks: list[Any]) -> list[Any]:
    """Drop callbacks that only feed a logger, with a warning, when the run has none."""
    kept = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    if len(kept) != len(callbacks):
        warnings.warn(
            "LearningRateMonitor has no effect without a logger and was left out; pick a logger "
            "(e.g. logger=csv) to record learning rates.",
            stacklevel=2,
        )
    return kept


def summarize(run: Run) -> dict[str, float]:
    """Final figures of a finished run (this rank's view of the cross-island traffic)."""
    metrics = run.trainer.callback_metrics
    summary: dict[str, float] = {"steps": float(run.trainer.global_step)}
    for key in ("val_loss", "val_ppl"):
        if key in metrics:
            summary[key] = float(metrics[key])
    strategy = run.trainer.strategy
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


def run(cfg: DictConfig, summary_path: Path | None = None) -> dict[str, float]:
    """Train the composed run; global rank 0 prints the summary and writes it as JSON."""
    pl.seed_everything(cfg.seed, workers=True)
    job = build(cfg)
    job.trainer.fit(job.model, job.datamodule, ckpt_path=cfg.get("ckpt_path"))
    summary = summarize(job)
    if job.trainer.is_global_zero:
        print(format_summary(summary), flush=True)
        if summary_path is not None:
            summary_path.write_text(json.dumps(summary, indent=1))
    return summary


register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg, summary_path=Path(HydraConfig.get().runtime.output_dir) / "summary.json")


def main() -> None:
    # Each rank of the CPU default launcher re-runs this command; keep torch to one intra-op
    # thread per rank unless the user said otherwise, so N ranks do not fight over N cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _hydra_main()


if __name__ == "__main__":
    main()
