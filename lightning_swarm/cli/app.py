"""The Hydra app: compose a run from the package's ``conf/`` and train it.

The strategy schema derives from ``SwarmConfig``; ``cli.preflight`` checks options before any
process starts. No OmegaConf object reaches a checkpoint (weights-only loads refuse them)."""

from __future__ import annotations

import json
import os
import types
import warnings
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import hydra
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
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
    check_pipeline,
    plain,
    resolve_ckpt_path,
)
from lightning_swarm.config import SwarmConfig
from lightning_swarm.demo.loss_plot import LossHistory, write_loss_png
from lightning_swarm.outer.loop import check_outer_optimizer
from lightning_swarm.outer.sync import default_outer_optimizer
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


def _schema_type(annotation: Any) -> Any:
    """The type OmegaConf checks for a ``SwarmConfig`` annotation: it knows neither ``Literal``
    (checked as ``str``; the strategy checks the values) nor unions of several types (``Any``)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return str
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1 and len(members) < len(get_args(annotation)):
            inner = _schema_type(members[0])
            return Any if inner is Any else Optional[inner]  # noqa: UP045 (a runtime type)
        return Any
    return annotation


_DEFAULT_OUTER_OPTIMIZER = {
    "_target_": "torch.optim.SGD",
    "_partial_": True,
    **default_outer_optimizer.keywords,
}

# The Hydra schema of ``SwarmStrategy`` (group ``strategy``, name ``swarm_schema``): every
# ``SwarmConfig`` field, derived, plus what is not plain data (the target, the outer optimizer
# as a ``_partial_`` node, DDPStrategy's launch options). The strategy validates the values, so
# a bad one fails with ``SwarmConfig``'s message, not OmegaConf's.
_HINTS = get_type_hints(SwarmConfig)
SwarmStrategyConf: type = make_dataclass(
    "SwarmStrategyConf",
    [
        ("_target_", str, field(default="lightning_swarm.SwarmStrategy")),
        *(
            (
                item.name,
                _schema_type(_HINTS[item.name]),
                field(default=item.default)
                if item.default_factory is MISSING
                else field(default_factory=item.default_factory),
            )
            for item in fields(SwarmConfig)
        ),
        ("outer_optimizer", Any, field(default_factory=lambda: dict(_DEFAULT_OUTER_OPTIMIZER))),
        ("start_method", str, field(default="popen")),
        ("process_group_backend", Optional[str], field(default=None)),  # noqa: UP045
    ],
    kw_only=True,
)
SwarmStrategyConf.__module__ = __name__
ConfigStore.instance().store(group="strategy", name="swarm_schema", node=SwarmStrategyConf)


@dataclass
class Run:
    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule
    loss_history: LossHistory
    ckpt_path: str | None = None


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
        check_pipeline(strategy.config, plain(cfg.model), plain(cfg.data), trainer_options)
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
    if logger is False and any(isinstance(c, LearningRateMonitor) for c in callbacks):
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
        warnings.warn(
            "LearningRateMonitor has no effect without a logger and was left out; pick a logger "
            "(e.g. logger=csv) to record learning rates.",
            stacklevel=2,
        )
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
        part.hparams.update({key: plain(value) for key, value in part.hparams.items()})
    return Run(trainer, model, datamodule, loss_history, ckpt_path=ckpt_path)


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
            print(write_loss_png(job.loss_history.curves, run_dir / "loss.png"), flush=True)
    # Lightning leaves the default process group to the interpreter's exit, where its gloo
    # threads can be torn down mid-flight (once seen: "terminate called without an active
    # exception" on a torchrun rank after a finished fit). A finished run closes it itself.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return summary


def summarize(trainer: pl.Trainer) -> dict[str, float]:
    """Final figures of a finished run (this rank's view of the cross-island traffic)."""
    metrics = trainer.callback_metrics
    summary: dict[str, float] = {"steps": float(trainer.global_step)}
    summary.update({key: float(metrics[key]) for key in ("val_loss", "val_ppl") if key in metrics})
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


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg, run_dir=Path(HydraConfig.get().runtime.output_dir))


THREADS_NOTE = (
    "swarm-train set OMP_NUM_THREADS=1 and torch.set_num_threads(1): one intra-op thread per "
    "rank (set OMP_NUM_THREADS to choose another number)"
)


def main() -> None:
    # Each rank of the CPU default launcher re-runs this command: one intra-op thread per rank
    # unless the user said otherwise, so N ranks do not fight over N cores. This process (rank
    # 0) imported torch already, so its own pool is sized here too.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        # A setting the CLI changes on its own is said in the run header, beside Lightning's
        # (global rank 0 only; launched ranks inherit the variable and say nothing).
        rank_zero_info(THREADS_NOTE)
    _hydra_main()


if __name__ == "__main__":
    main()
