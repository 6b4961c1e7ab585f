"""The Hydra app: every YAML composes and instantiates; bad overrides fail before training."""

from __future__ import annotations

import dataclasses
import io
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import hydra
import lightning.pytorch as pl
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, OverrideParseException
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_swarm import SwarmConfig, SwarmStrategy
from lightning_swarm.cli.app import CONF_DIR, THREADS_NOTE, Run, build, format_summary
from tests.cli_utils import RUN_TIMEOUT_S, run_group, tree_env
from tests.helpers import QUIET, TinyRegressor, regression_data


@pytest.fixture
def compose(tmp_path: Path) -> Iterator:
    def _compose(*overrides: str) -> DictConfig:
        # As a run would: ${hydra:runtime.output_dir} (logger, checkpoint folder) is tmp_path.
        paths = [f"hydra.runtime.output_dir={tmp_path}"]
        cfg = hydra.compose("train", overrides=[*paths, *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
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
    _assert_loads_weights_only(run)
    assert (run.trainer.logger is None) == (logger == "none")
    if strategy != "ddp":
        assert isinstance(run.trainer.strategy, SwarmStrategy)
        assert run.trainer.strategy.config.sync_every == cfg.strategy.sync_every


def _assert_loads_weights_only(run: Run) -> None:
    """What a checkpoint takes from the run (hyper-parameters, callback states) loads back
    under torch's weights-only unpickler: no OmegaConf container slipped into it."""
    saved = {
        "model": dict(run.model.hparams),
        "data": dict(run.datamodule.hparams),
        "callbacks": [c.state_dict() for c in run.trainer.callbacks],  # type: ignore[attr-defined]
    }
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == saved


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
        ("strategy.bucket_mb=-1", r"bucket_mb=-1(\.0)? is below the floor of 1 MiB"),
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
    cmd = [
        sys.executable,
        "-m",
        "lightning_swarm.cli.app",
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
    # naming the command instead of being killed by the plugin without it; its ranks die too.
    # Without OMP_NUM_THREADS, as a user starts it: the CLI picks one thread per rank.
    env = {k: v for k, v in tree_env().items() if k != "OMP_NUM_THREADS"}
    done = run_group(cmd, cwd=tmp_path, env=env, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    # The CLI's own setting is said once, in the run header (rank 1 inherits it silently).
    assert (done.stdout + done.stderr).count(THREADS_NOTE) == 1, done.stderr[-3000:]
    assert "lightning_swarm run summary" in done.stdout
    assert "outer steps                              2" in done.stdout
    assert "DDP / swarm traffic ratio                3.0x" in done.stdout
    # the picture: train loss every step, validation at step 6, rounds at steps 3 and 6
    assert f"loss plot written to {tmp_path / 'loss.png'}" in done.stdout
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPU")
def test_gpu_trainer_without_a_gpu_says_so(compose) -> None:
    with pytest.raises(ValueError, match="no GPU was found on this machine") as info:
        build(compose("trainer=gpu"))
    assert "trainer=cpu" in str(info.value)
    assert "No supported gpu backend" not in str(info.value)


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        # "auto" on the CPU is one process, as Lightning resolves it
        (
            "auto",
            r"strategy.island_size=2 does not divide the world size 1 .*with one rank the only "
            r"island_size is 1.*trainer.devices=2.*trainer.devices='auto' means 1 process",
        ),
        ("-1", r"trainer.devices=-1 is not valid on the cpu accelerator: give a count"),
        ("3", r"world size 3 .*choose one of \[1, 3\]"),
    ],
)
def test_devices_are_resolved_before_the_island_check(compose, devices: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        build(compose(f"trainer.devices={devices}", "strategy.island_size=2"))
    assert "1 (one island) or 1" not in str(info.value)


def test_devices_auto_with_islands_of_one_builds(compose) -> None:
    run = build(compose("trainer.devices=auto"))
    assert run.trainer.world_size == 1


def test_quoted_checkpoint_path_with_equals_composes(compose) -> None:
    # Lightning names checkpoints epoch=0-step=8.ckpt; Hydra needs the value quoted.
    cfg = compose("ckpt_path='outputs/run/checkpoints/epoch=0-step=8.ckpt'")
    assert cfg.ckpt_path == "outputs/run/checkpoints/epoch=0-step=8.ckpt"
    with pytest.raises(OverrideParseException, match="mismatched input '='"):
        compose("ckpt_path=outputs/run/checkpoints/epoch=0-step=8.ckpt")


def test_tensorboard_logger_writes_into_the_run_dir(compose, tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = build(compose("logger=tensorboard")).trainer.logger
    assert isinstance(logger, TensorBoardLogger)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_loss_plot_without_matplotlib_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_swarm.demo.loss_plot import LossCurves, write_loss_png

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    line = write_loss_png(LossCurves(train=[(1, 2.0)]), tmp_path / "loss.png")
    assert line == (
        "loss.png not written: matplotlib is not installed; "
        "pip install 'lightning-swarm[plots]' to get the loss plot."
    )
    assert not (tmp_path / "loss.png").exists()


class _ValidatedRegressor(TinyRegressor):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_loss_history_records_every_step_the_validations_and_the_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_swarm.demo import loss_plot

    monkeypatch.setattr(loss_plot, "_FLUSH_EVERY", 2)  # several batched reads in 7 steps
    history = loss_plot.LossHistory()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SwarmStrategy(sync_every=3),  # popen at one process: this process trains
        max_steps=7,
        val_check_interval=4,
        limit_val_batches=2,
        num_sanity_val_steps=1,  # sanity checks are not validation results
        callbacks=[history],
        **QUIET,
    )
    try:
        trainer.fit(_ValidatedRegressor(), regression_data(), regression_data(num=16, seed=1))
    finally:
        if torch.distributed.is_initialized():  # Lightning leaves an in-process group up
            torch.distributed.destroy_process_group()
    curves = history.curves
    assert [step for step, _ in curves.train] == [1, 2, 3, 4, 5, 6, 7]
    assert all(loss > 0 for _, loss in curves.train)
    # Rounds every 3 steps, plus the end-of-fit round (sync_at_end) after step 7.
    assert curves.rounds == [3, 6, 7]
    assert [step for step, _ in curves.val] == [4]
    # The validation's own mean loss (the only validation ran at step 4), not a train loss nor
    # the sanity check's value.
    assert curves.val[0][1] == pytest.approx(float(trainer.callback_metrics["val_loss"]), rel=1e-6)


def test_swarm_small_is_the_paper_preset_with_plain_averaging(compose) -> None:
    """``strategy=swarm_small`` (docs/tuning.md) differs from ``strategy=swarm`` only in the
    outer optimizer: SGD at lr 1.0 without momentum, so the new anchors are the islands' mean."""
    paper, small = compose("strategy=swarm").strategy, compose("strategy=swarm_small").strategy
    assert dict(small.outer_optimizer) == {
        **paper.outer_optimizer,
        "lr": 1.0,
        "momentum": 0.0,
        "nesterov": False,
    }
    rest = {k: v for k, v in small.items() if k != "outer_optimizer"}
    assert rest == {k: v for k, v in paper.items() if k != "outer_optimizer"}
    outer = build(compose("strategy=swarm_small")).trainer.strategy
    assert isinstance(outer, SwarmStrategy)
    optimizer = outer.outer_optimizer_factory([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (1.0, 0.0, False)


def _restated_defaults(values: object, defaults: object, where: str) -> list[str]:
    """Each key of a preset's ``values`` (nested mappings too) that equals its default."""
    if not isinstance(values, dict):
        return [where] if values == defaults else []
    if dataclasses.is_dataclass(defaults):
        defaults = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
    assert isinstance(defaults, dict), (where, defaults)
    return [
        name
        for key, value in values.items()
        if key in defaults
        for name in _restated_defaults(value, defaults[key], f"{where}.{key}")
    ]


def _swarm_presets() -> list[str]:
    """The strategy files built on the SwarmStrategy schema (not ddp.yaml's DDPStrategy)."""
    return [
        name
        for name in _options("strategy")
        if "_target_" not in OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml")
    ]


@pytest.mark.parametrize("preset", _swarm_presets())
def test_strategy_presets_state_only_what_they_change(preset: str) -> None:
    """A preset's SwarmStrategy keys each differ from the schema's default (``SwarmConfig``'s,
    and the outer optimizer's): a restated default is a second copy that can drift."""
    from lightning_swarm.cli.app import SwarmStrategyConf

    values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "strategy" / f"{preset}.yaml"))
    assert isinstance(values, dict)
    schema = SwarmStrategyConf()
    defaults = {f.name: getattr(schema, f.name) for f in dataclasses.fields(schema)}
    swarm_fields = {f.name for f in dataclasses.fields(SwarmConfig)}
    assert swarm_fields <= set(defaults)  # the schema holds SwarmConfig's defaults
    data = {k: v for k, v in values.items() if k != "defaults"}
    assert _restated_defaults(data, defaults, preset) == []


@pytest.mark.parametrize(
    ("preset", "changes"),
    [
        (None, {}),
        ("swarm", {}),
        ("swarm_small", {}),
        ("swarm_fsdp", {"island_parallel": "fsdp", "island_size": 2}),
        ("no_sync", {"sync_every": 1_000_000_000, "sync_at_end": False}),
    ],
)
def test_strategy_presets_compose_to_their_swarm_config(
    compose, preset: str | None, changes: dict[str, object]
) -> None:
    """What each preset (and the main job's default command line) builds: ``SwarmConfig``'s
    defaults with the preset's changes, whatever the YAML files restate or leave out."""
    cfg = compose(*([f"strategy={preset}"] if preset else []))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. FSDP islands of a CPU run; not the point here
        strategy = hydra.utils.instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, SwarmStrategy)
    assert strategy.config == SwarmConfig(**changes)  # type: ignore[arg-type]
