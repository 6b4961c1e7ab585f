"""HostMemoryCensus inside real (CPU) Trainer.fit runs: key sets on and off, cadences, the
stand-in path, strategy state, allocator counters, the end-of-fit summary, bad arguments."""

from __future__ import annotations

import csv
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from typing_extensions import override

from lightning_swarm import SwarmStrategy
from lightning_swarm.callbacks import HostMemoryCensus
from tests.helpers import QUIET, TinyRegressor, regression_data
from tests.test_memory_allocator import HOST_SNAPSHOTS

STEPS = 7


class CaptureLogger(Logger):
    """Keeps every ``log_metrics`` call as (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    @override
    def name(self) -> str:
        return "capture"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def census(self) -> Iterator[tuple[int | None, dict[str, float]]]:
        for step, metrics in self.records:
            picked = {k: v for k, v in metrics.items() if k.startswith("census/")}
            if picked:
                yield step, picked

    def without_census(self) -> list[tuple[int | None, dict[str, float | None]]]:
        """Non-census records; wall-clock timings (``*_s``) compared by key only."""
        out = []
        for step, metrics in self.records:
            kept = {
                k: None if k.endswith("_s") else v
                for k, v in metrics.items()
                if not k.startswith("census/")
            }
            if kept:
                out.append((step, kept))
        return out


class LoggingRegressor(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def fit(
    callbacks: list[pl.Callback], strategy: Any = None, **trainer_kw: Any
) -> tuple[pl.Trainer, CaptureLogger]:
    pl.seed_everything(3)
    logger = CaptureLogger()
    kwargs = {**QUIET, "logger": logger, "log_every_n_steps": 1, **trainer_kw}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy if strategy is not None else SwarmStrategy(sync_every=2),
        max_steps=STEPS,
        callbacks=callbacks,
        **kwargs,
    )
    try:
        trainer.fit(LoggingRegressor(), regression_data())
    finally:
        # One in-process rank: Lightning leaves its default group to the caller.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer, logger


def census_keys(records: Iterator[tuple[int | None, dict[str, float]]]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for step, metrics in records:
        assert step is not None
        out.setdefault(step, set()).update(metrics)
    return out


FAST = {
    "census/status/VmRSS_bytes",
    "census/status/VmHWM_bytes",
    "census/status/RssAnon_bytes",
    "census/status/RssFile_bytes",
    "census/status/RssShmem_bytes",
    "census/meminfo/MemAvailable_bytes",
    "census/meminfo/AnonPages_bytes",
}
CUDA_ALLOCATOR_KEYS = ("census/cuda_device/", "census/cuda_host/")
SWARM = {"census/swarm/anchor_bytes", "census/swarm/outer_state_bytes"}
SLOW = {
    "census/smaps_rollup/Anonymous_bytes",
    "census/smaps_rollup/Private_Dirty_bytes",
    "census/smaps_rollup/read_s",
    "census/swarm/anchor_file_backed_bytes",
}
SUMMARY = {
    "census/summary/peak_rss_bytes",
    "census/summary/peak_anon_bytes",
    "census/summary/anon_slope_bytes_per_step",
    "census/summary/num_samples",
}


def test_census_off_leaves_records_unchanged_and_on_adds_census_keys() -> None:
    _, off = fit([])
    census = HostMemoryCensus(every_n_steps=1, smaps_every_n_steps=3)
    trainer, on = fit([census])
    assert not list(off.census())
    # With the census on, everything else is logged exactly as before (keys, steps, values).
    assert on.without_census() == off.without_census()
    assert any(k.startswith("swarm/") for _, m in off.without_census() for k in m)
    assert any("train_loss" in m for _, m in off.without_census())

    keys = census_keys(on.census())
    assert sorted(keys) == list(range(STEPS + 1))  # start of fit (0), then every step
    for step, got in keys.items():
        expected = FAST | SWARM
        if step in (0, 3, 6, STEPS):  # start, every 3rd step, end of fit
            expected |= SLOW
        if step == STEPS:
            expected |= SUMMARY
        # On a machine with CUDA initialised, allocator counters join (test_allocator_* checks
        # them); the host-memory keys must be exactly these either way.
        assert {k for k in got if not k.startswith(CUDA_ALLOCATOR_KEYS)} == expected, step

    strategy = trainer.strategy
    assert isinstance(strategy, SwarmStrategy)
    values = {k: v for _, m in on.census() for k, v in m.items()}  # last value of each key
    num_params = sum(p.numel() for p in trainer.lightning_module.parameters())
    report = strategy.memory_report
    assert report is not None
    assert values["census/swarm/anchor_bytes"] == 4 * num_params == report.anchor_bytes()
    # Nesterov momentum: one float32 buffer per anchor once an outer step has run.
    assert values["census/swarm/outer_state_bytes"] == report.outer_state_bytes() > 0
    assert values["census/swarm/anchor_file_backed_bytes"] == 0
    assert values["census/smaps_rollup/read_s"] > 0
    assert census.summary == {k: values[k] for k in SUMMARY}


def test_outer_state_appears_with_the_first_momentum() -> None:
    _, logger = fit([HostMemoryCensus()])
    by_step = {}
    for step, metrics in logger.census():
        by_step.setdefault(step, {}).update(metrics)
    # sync_every=2: the default momentum ramp makes the first round (step 2) a plain step,
    # with no momentum buffer; the second (step 4) builds it.
    assert by_step[2]["census/swarm/outer_state_bytes"] == 0
    assert by_step[4]["census/swarm/outer_state_bytes"] > 0
    # With a constant momentum the buffer appears at the first round.
    constant = SwarmStrategy(sync_every=2, outer_momentum_warmup=0.0)
    _, logger = fit([HostMemoryCensus()], strategy=constant)
    by_step = {}
    for step, metrics in logger.census():
        by_step.setdefault(step, {}).update(metrics)
    assert by_step[1]["census/swarm/outer_state_bytes"] == 0
    assert by_step[2]["census/swarm/outer_state_bytes"] > 0


def test_every_n_steps_and_smaps_only_at_ends() -> None:
    _, logger = fit([HostMemoryCensus(every_n_steps=2, smaps_every_n_steps=0)])
    keys = census_keys(logger.census())
    assert sorted(keys) == [0, 2, 4, 6, STEPS]
    assert {s for s, k in keys.items() if k >= SLOW} == {0, STEPS}


def test_summary_matches_logged_series() -> None:
    census = HostMemoryCensus()
    _, logger = fit([census])
    anon = [(s, m["census/status/RssAnon_bytes"]) for s, m in logger.census()]
    steps = np.array([s for s, _ in anon], dtype=float)
    values = np.array([v for _, v in anon], dtype=float)
    expected_slope = np.polyfit(steps, values, 1)[0]
    assert census.summary["census/summary/anon_slope_bytes_per_step"] == pytest.approx(
        expected_slope, rel=1e-6, abs=1e-6
    )
    assert census.summary["census/summary/peak_anon_bytes"] == values.max()
    hwm = max(m["census/status/VmHWM_bytes"] for _, m in logger.census())
    assert census.summary["census/summary/peak_rss_bytes"] == hwm
    assert census.summary["census/summary/num_samples"] == len(anon)


def test_standin_path_when_proc_unreadable(tmp_path: Path) -> None:
    census = HostMemoryCensus(proc_root=str(tmp_path / "no_proc"))
    _, logger = fit([census])
    keys = census_keys(logger.census())
    for got in keys.values():
        assert {"census/psutil/rss_bytes", "census/psutil/available_bytes"} <= got
        assert not any(k.startswith(("census/status/", "census/meminfo/")) for k in got)
        # No stand-in for page-walked anonymous memory or the maps of anchors: absent.
        assert not any(k.startswith("census/smaps_rollup/") for k in got)
        assert "census/swarm/anchor_file_backed_bytes" not in got
    assert "census/summary/peak_rss_bytes" in census.summary
    assert "census/summary/peak_anon_bytes" not in census.summary
    assert "census/summary/anon_slope_bytes_per_step" not in census.summary


def test_any_strategy_without_swarm_keys() -> None:
    _, logger = fit([HostMemoryCensus()], strategy="auto")
    keys = census_keys(logger.census())
    assert keys and all(got >= FAST for got in keys.values())
    assert not any(k.startswith("census/swarm/") for got in keys.values() for k in got)


def test_allocator_counters_logged_and_classified() -> None:
    snapshots = iter(HOST_SNAPSHOTS + [HOST_SNAPSHOTS[-1]] * 20)
    census = HostMemoryCensus(allocator_stats=lambda: {"cuda_host": next(snapshots)})
    _, logger = fit([census])
    first = next(iter(logger.census()))[1]
    assert "census/cuda_host/active_bytes/current" in first
    assert "census/cuda_host/active_bytes/gauge" not in first  # nothing happened yet
    last = list(logger.census())[-1][1]
    assert last["census/cuda_host/allocated_bytes/gauge"] == 1.0
    assert last["census/cuda_host/active_bytes/gauge"] == 0.0


def test_file_backed_anchor_bytes(tmp_path: Path) -> None:
    census = HostMemoryCensus()
    trainer, _ = fit([census])
    strategy = trainer.strategy
    assert isinstance(strategy, SwarmStrategy)
    anchors = strategy.outer_syncs[0].anchors
    name = max(anchors, key=lambda n: anchors[n].numel())
    torch.save(anchors[name].clone(), tmp_path / "anchor.pt")
    anchors[name] = torch.load(tmp_path / "anchor.pt", mmap=True, weights_only=True)
    measured = census.collect(trainer, slow=True)
    assert measured["swarm/anchor_file_backed_bytes"] == anchors[name].nbytes
    # The fast cadence never walks maps.
    assert "swarm/anchor_file_backed_bytes" not in census.collect(trainer, slow=False)


class SpoolingTransport:
    """A transport stand-in that reports spool usage (the swarm transport's accessor)."""

    def __init__(self, disk_bytes: int) -> None:
        self.disk_bytes = disk_bytes

    def spool_bytes(self) -> int:
        return self.disk_bytes


def test_spool_bytes_only_when_transport_has_them() -> None:
    census = HostMemoryCensus()
    trainer, logger = fit([census])
    assert not any("spool" in k for _, m in logger.census() for k in m)
    strategy = trainer.strategy
    assert isinstance(strategy, SwarmStrategy)
    transport = SpoolingTransport(12345)
    assert strategy.outer_loop is not None
    strategy.outer_loop.transport = transport  # type: ignore[assignment]
    assert census.collect(trainer, slow=False)["swarm/spool_bytes"] == 12345
    transport.disk_bytes = 0  # drained after the round: read afresh, not cached
    assert census.collect(trainer, slow=False)["swarm/spool_bytes"] == 0


def test_all_ranks_gathers_to_rank0(tmp_path: Path) -> None:
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SwarmStrategy(sync_every=2, start_method="fork"),
        max_steps=3,
        callbacks=[HostMemoryCensus(all_ranks=True, smaps_every_n_steps=2)],
        **{**QUIET, "logger": CSVLogger(tmp_path, name="run", version=0)},
    )
    trainer.fit(TinyRegressor(), regression_data())
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        columns = set(next(csv.reader(f)))
    for rank in (0, 1):
        assert f"census/rank{rank}/status/VmRSS_bytes" in columns
        assert f"census/rank{rank}/summary/peak_rss_bytes" in columns
    assert not any(c.startswith("census/status/") for c in columns)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n_steps": 0}, ValueError, r"every_n_steps=0 must be >= 1; use 1"),
        ({"every_n_steps": 1.5}, TypeError, r"every_n_steps must be an int, got float"),
        ({"every_n_steps": True}, TypeError, r"every_n_steps must be an int, got bool"),
        ({"smaps_every_n_steps": -1}, ValueError, r"smaps_every_n_steps=-1 must be >= 0.*or 0"),
        ({"smaps_every_n_steps": "500"}, TypeError, r"smaps_every_n_steps must be an int"),
        ({"all_ranks": "yes"}, TypeError, r"all_ranks must be True or False.*use False"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        HostMemoryCensus(**kwargs)
