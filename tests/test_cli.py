"""The Hydra app: every YAML composes and instantiates; bad overrides fail before training."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import hydra
import pytest
from hydra.errors import ConfigCompositionException
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from lightning_swarm import SwarmStrategy
from lightning_swarm.cli import CONF_DIR, build, format_summary

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def compose(tmp_path: Path) -> Iterator:
    def _compose(*overrides: str) -> DictConfig:
        paths = [f"trainer.default_root_dir={tmp_path}"]
        cfg = hydra.compose("train", overrides=[*paths, *overrides])
        if cfg.get("logger"):
            cfg.logger.save_dir = str(tmp_path)
        return cfg

    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield _compose


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("strategy", _options("strategy"))
@pytest.mark.parametrize("callbacks", _options("callbacks"))
@pytest.mark.parametrize("logger", _options("logger"))
def test_every_combination_instantiates(
    compose, strategy: str, callbacks: str, logger: str
) -> None:
    cfg = compose(f"strategy={strategy}", f"callbacks={callbacks}", f"logger={logger}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = build(cfg)
    lr_monitors = [c for c in run.trainer.callbacks if isinstance(c, LearningRateMonitor)]  # type: ignore[attr-defined]
    if logger == "none":
        # a logger-only callback cannot run without a logger: left out, and the user is told
        assert not lr_monitors
        if callbacks != "none":
            assert any("LearningRateMonitor has no effect" in str(w.message) for w in caught)
    else:
        assert len(lr_monitors) == (callbacks != "none")
    assert run.trainer.max_steps == cfg.trainer.max_steps
    assert (run.trainer.logger is None) == (logger == "none")
    if strategy != "ddp":
        assert isinstance(run.trainer.strategy, SwarmStrategy)
        assert run.trainer.strategy.config.sync_every == cfg.strategy.sync_every


@pytest.mark.parametrize("trainer", _options("trainer"))
def test_every_trainer_file_composes(compose, trainer: str) -> None:
    cfg = compose(f"trainer={trainer}")
    assert OmegaConf.to_container(cfg.trainer, resolve=True)["accelerator"] in {"cpu", "gpu"}


def test_overrides_reach_the_strategy(compose) -> None:
    cfg = compose(
        "trainer.devices=4",
        "strategy.sync_every=50",
        "strategy.island_size=2",
        "strategy.anchor_dtype=bfloat16",
        "strategy.outer_optimizer.lr=0.5",
    )
    strategy = build(cfg).trainer.strategy
    assert isinstance(strategy, SwarmStrategy)
    assert strategy.config.sync_every == 50 and strategy.config.island_size == 2
    assert strategy.config.anchor_dtype == "bfloat16"
    assert strategy.outer_optimizer_factory.keywords["lr"] == 0.5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("strategy.sync_every=0", "sync_every must be a positive integer"),
        ("strategy.island_size=3", "island_size=3 does not divide the world size 2"),
        ("strategy.transport=pigeon", "transport='pigeon' is not known"),
        ("strategy.bucket_mb=-1", "bucket_mb must be > 0"),
    ],
)
def test_bad_override_fails_before_training(compose, override: str, message: str) -> None:
    cfg = compose(override)
    with pytest.raises(Exception, match=message) as info:
        build(cfg)
    # hydra wraps instantiate errors; the root cause must be our ValueError
    err: BaseException | None = info.value
    while err is not None and not isinstance(err, ValueError):
        err = err.__cause__
    assert isinstance(err, ValueError)


def test_unknown_strategy_key_is_rejected(compose) -> None:
    with pytest.raises(ConfigCompositionException, match="no_such_key"):
        compose("strategy.no_such_key=1")
    # an explicitly added key composes, but the strategy refuses it before any launch
    cfg = compose("+strategy.no_such_key=1")
    with pytest.raises(Exception, match=r"unknown option\(s\) \['no_such_key'\]"):
        build(cfg)


def test_wrong_type_is_rejected(compose) -> None:
    with pytest.raises(ConfigCompositionException, match="sync_every"):
        compose("strategy.sync_every=often")


def test_summary_format() -> None:
    text = format_summary(
        {"steps": 10, "val_loss": 2.5, "bytes_sent_per_rank": 100.0, "ddp_bytes_per_rank": 1000.0}
    )
    assert "final validation loss" in text and "10.0x" in text


def test_main_job_runs_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "lightning_swarm.cli",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false",
        "strategy.sync_every=3",
        "data.max_bytes=300000",
        "model.n_layer=1",
        f"hydra.run.dir={tmp_path}",
    ]
    # Below pytest-timeout's 120 s (about 25 s here): a stuck run fails with TimeoutExpired
    # naming the command instead of being killed by the plugin without it.
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning_swarm run summary" in done.stdout
    assert "outer steps                              2" in done.stdout
    assert "DDP / swarm traffic ratio                3.0x" in done.stdout


@pytest.mark.parametrize(
    "overrides",
    [["census.enabled=true"], ["callbacks=census"], ["callbacks=census", "census.enabled=true"]],
)
def test_census_switches_add_one_census(compose, overrides: list[str]) -> None:
    from lightning_swarm.callbacks import HostMemoryCensus

    callbacks = build(compose(*overrides)).trainer.callbacks
    assert sum(isinstance(c, HostMemoryCensus) for c in callbacks) == 1  # type: ignore[attr-defined]
    off = build(compose()).trainer.callbacks
    assert not any(isinstance(c, HostMemoryCensus) for c in off)  # type: ignore[attr-defined]


def test_census_bad_value_names_the_option(compose) -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        build(compose("census.enabled=true", "census.every_n_steps=0"))
