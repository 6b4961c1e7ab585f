"""The Hydra app: compose a run from the package's ``conf/`` and train it.

``swarm-train`` reads ``conf/train.yaml`` and its groups, validates the options before any
process starts (``cli.preflight``), trains, and on global rank 0 writes ``summary.json`` and
``loss.png``. Every ``instantiate`` converts OmegaConf containers to plain Python, and the
module's hyper-parameters are made plain again before fit, so no OmegaConf object reaches a
checkpoint (Lightning's weights-only load refuses them).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from lightning_swarm.callbacks import HostMemoryCensus
from lightning_swarm.cli.preflight import (
    check_accelerator,
    check_islands,
    check_lighthouse,
    make_hparams_plain,
    plain,
    resolve_ckpt_path,
)
from lightning_swarm.cli.schema import register_configs
from lightning_swarm.cli.summary import format_summary, summarize
from lightning_swarm.demo.loss_plot import LossHistory, write_loss_png
from lightning_swarm.outer.loop import check_outer_optimizer
from lightning_swarm.strategy import SwarmStrategy


def conf_dir() -> Path:
    """The one copy of the YAML: ``conf/`` at the top of a checkout (also what an editable
    install reads), or ``lightning_swarm/conf`` inside an installed wheel, mapped there from
    the same folder at build time (``[tool.setuptools]`` in pyproject.toml)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"lightning_swarm's configs are missing: neither {package / 'conf'} nor "
        f"{package.parent / 'conf'} holds train.yaml; reinstall the package."
    )


CONF_DIR = conf_dir()


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
    outer_optimizer = cfg.strategy.get("outer_optimizer")
    if outer_optimizer is not None:
        # Named by its CLI key here; inside the strategy it would read "outer_optimizer.lr".
        check_outer_optimizer(
            instantiate(outer_optimizer, _convert_="all"), option="strategy.outer_optimizer"
        )
    strategy = instantiate(cfg.strategy, _convert_="all")
    if isinstance(strategy, SwarmStrategy):
        # Fails here, in the launching process, instead of once per rank after the launch.
        check_islands(
            trainer_options.get("accelerator", "auto"),
            trainer_options.get("devices", "auto"),
            trainer_options.get("num_nodes", 1),
            strategy.config.island_size,
        )
        check_lighthouse(strategy.config)
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


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, float]:
    """Train the composed run; global rank 0 prints the summary and, when ``run_dir`` is
    given, writes ``summary.json`` and ``loss.png`` there."""
    pl.seed_everything(cfg.seed, workers=True)
    job = build(cfg)
    if job.ckpt_path is not None and job.trainer.is_global_zero:
        print(f"resuming from {job.ckpt_path}", flush=True)
    job.trainer.fit(job.model, job.datamodule, ckpt_path=job.ckpt_path)
    summary = summarize(job.trainer)
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


THREADS_NOTE = (
    "swarm-train set OMP_NUM_THREADS=1 and torch.set_num_threads(1): one intra-op thread per "
    "rank (set OMP_NUM_THREADS to choose another number)"
)


def main() -> None:
    # Each rank of the CPU default launcher re-runs this command; keep torch to one intra-op
    # thread per rank unless the user said otherwise, so N ranks do not fight over N cores.
    # The variable reaches the ranks this process launches; this process (rank 0) imported
    # torch already, so its own pool is sized here too (seen: rank 0 with its default pool
    # used 10x the CPU time of rank 1 per step on a loaded 2-core machine; every rank waits).
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        # A setting the CLI changes on its own is said in the run header, beside Lightning's
        # (global rank 0 only; launched ranks inherit the variable and say nothing).
        rank_zero_info(THREADS_NOTE)
    _hydra_main()


if __name__ == "__main__":
    main()
