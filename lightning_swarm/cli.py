"""The Hydra app: compose a run from the package's ``conf/`` and train it.

``swarm-train trainer.devices=4 strategy.sync_every=50 strategy.island_size=2`` (or
``python -m lightning_swarm.cli ...``) reads ``lightning_swarm/conf/train.yaml`` (shipped inside
the package, so an installed wheel finds it) and its groups (trainer, strategy, model, data,
callbacks, logger), validates the options before any process starts (``cli_checks``), trains,
and on global rank 0 prints a summary and writes ``summary.json`` and ``loss.png`` into the run
directory.

Every ``instantiate`` converts OmegaConf containers to plain Python (``_convert_="all"``) and
the module's and datamodule's hyper-parameters are made plain once more before fit, so no
OmegaConf object reaches a checkpoint (Lightning's weights-only load refuses them).

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
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig

from lightning_swarm.callbacks import HostMemoryCensus
from lightning_swarm.cli_checks import (
    check_accelerator,
    check_islands,
    make_hparams_plain,
    plain,
    resolve_ckpt_path,
)
from lightning_swarm.config import SwarmConfig
from lightning_swarm.demo.loss_plot import LossHistory, write_loss_png
from lightning_swarm.strategy import SwarmStrategy

# The one copy of the YAML: inside the package, so that a wheel ships it (package data).
CONF_DIR = Path(__file__).resolve().parent / "conf"


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
    ckpt_path: str | None = None
    loss_history: LossHistory | None = None


def build(cfg: DictConfig) -> Run:
    """Instantiate everything a run needs; raises ValueError on a bad option, before training."""
    trainer_options = plain(cfg.trainer)
    check_accelerator(trainer_options.get("accelerator", "auto"))
    strategy = instantiate(cfg.strategy, _convert_="all")
    if isinstance(strategy, SwarmStrategy):
        # Fails here, in the launching process, instead of once per rank after the launch.
        check_islands(
            trainer_options.get("accelerator", "auto"),
            trainer_options.get("devices", "auto"),
            trainer_options.get("num_nodes", 1),
            strategy.config.island_size,
        )
    callbacks = [
        instantiate(c, _convert_="all")
        for c in (cfg.get("callbacks") or {}).values()
        if c is not None
    ]
    census = cfg.get("census")
    has_census = any(isinstance(c, HostMemoryCensus) for c in callbacks)
    if census is not None and census.enabled and not has_census:
        options = {str(k): plain(v) for k, v in census.items() if k != "enabled"}
        callbacks.append(HostMemoryCensus(**options))
    logger = instantiate(cfg.logger, _convert_="all") if cfg.get("logger") else False
    if logger is False:
        callbacks = _without_logger_callbacks(callbacks)
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        # A ModelCheckpoint in the callbacks group is the request to checkpoint; Lightning
        # would otherwise refuse it next to the trainer files' enable_checkpointing: false.
        trainer_options["enable_checkpointing"] = True
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), cfg.get("run_dir"), callbacks)
    loss_history = LossHistory()
    trainer = pl.Trainer(
        **trainer_options,
        strategy=strategy,
        callbacks=[*callbacks, loss_history],
        logger=logger,
    )
    model = instantiate(cfg.model, _convert_="all")
    datamodule = instantiate(cfg.data, _convert_="all")
    for part in (model, datamodule):
        make_hparams_plain(part.hparams)
    return Run(trainer, model, datamodule, ckpt_path=ckpt_path, loss_history=loss_history)


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


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, float]:
    """Train the composed run; global rank 0 prints the summary and, when ``run_dir`` is
    given, writes ``summary.json`` and ``loss.png`` there."""
    pl.seed_everything(cfg.seed, workers=True)
    job = build(cfg)
    if job.ckpt_path is not None and job.trainer.is_global_zero:
        print(f"resuming from {job.ckpt_path}", flush=True)
    job.trainer.fit(job.model, job.datamodule, ckpt_path=job.ckpt_path)
    summary = summarize(job)
    if job.trainer.is_global_zero:
        print(format_summary(summary), flush=True)
        if run_dir is not None:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            if job.loss_history is not None:
                print(write_loss_png(job.loss_history.curves, run_dir / "loss.png"), flush=True)
    return summary


register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg, run_dir=Path(HydraConfig.get().runtime.output_dir))


def main() -> None:
    # Each rank of the CPU default launcher re-runs this command; keep torch to one intra-op
    # thread per rank unless the user said otherwise, so N ranks do not fight over N cores.
    # The variable reaches the ranks this process launches; this process (rank 0) imported
    # torch already, so its own pool is sized here too (seen: rank 0 with its default pool
    # used 10x the CPU time of rank 1 per step on a loaded 2-core machine; every rank waits).
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    _hydra_main()


if __name__ == "__main__":
    main()
