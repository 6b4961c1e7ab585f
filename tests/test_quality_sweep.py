"""The quality sweep (benchmarks/quality_sweep.py): a 20-step smoke run and its round schedules."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quality_sweep  # noqa: E402

from benchmarks.quality_schedules import InnerLrSchedule, OuterLrSchedule, round_factor  # noqa: E402
from lightning_swarm.strategy import SwarmStrategy  # noqa: E402

TINY = ["model.n_layer=1", "model.n_embd=32", "data.max_bytes=300000", "data.val_batches=2"]


@pytest.mark.slow  # ~24 s: a benchmark's end-to-end run; its pieces are tested below
@pytest.mark.timeout(600)
def test_smoke_sweep_records_gap_plot_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # H=5 so that 20 steps hold 4 rounds, each at the outer rate the callback set in the ranks
    smoke = quality_sweep.Setting(
        "swarm", (1.0, 0.5, False), sync_every=5, outer_schedule={"kind": "cosine", "final": 0.5}
    )
    monkeypatch.setitem(quality_sweep.SETTINGS, "smoke", smoke)
    results, png = tmp_path / "results.json", tmp_path / "plot.png"
    names = ["ddp", "no_sync", "smoke"]
    argv = ["--steps", "20", "--only", *names, "--results", str(results)]
    argv += ["--plot", str(png), "--work", str(tmp_path / "runs"), "--extra", *TINY]
    quality_sweep.main(argv)
    records = json.loads(results.read_text())
    assert sorted(records) == sorted(f"{n}@2x20" for n in names)
    for record in records.values():
        assert math.isfinite(record["val_loss"])
        assert "model.n_embd=32" in record["overrides"]
    swarm = records["smoke@2x20"]
    assert swarm["outer_steps"] == 4 and swarm["bytes_sent_per_rank"] > 0
    assert "+callbacks.outer_lr.kind=cosine" in swarm["overrides"]
    assert records["no_sync@2x20"]["bytes_sent_per_rank"] == 0
    gap = quality_sweep.gap_closed(swarm, records)
    assert gap is not None and math.isfinite(gap)
    assert "| smoke | 2 | 20 | H=5, SGD 1.0 momentum 0.5, outer lr cosine/0.5 |" in (
        capsys.readouterr().out
    )
    assert png.stat().st_size > 0

    before = results.read_text()
    quality_sweep.main(argv)  # every key is there: nothing runs, nothing changes
    assert "3 of 3 already in" in capsys.readouterr().out
    assert results.read_text() == before


def test_a_second_seed_has_its_own_keys_ends_and_row() -> None:
    """A run at another seed is keyed apart, passes ``seed=`` to the job, is scored against the
    ends of its own seed (not the default seed's) and shows in the by-seed table."""

    def record(name: str, loss: float, seed: int) -> dict[str, object]:
        return {"name": name, "islands": 2, "steps": 2000, "seed": seed, "val_loss": loss}

    results = {}
    for seed, (ddp, floor, avg) in {1234: (1.0, 2.0, 1.5), 7: (1.0, 3.0, 1.5)}.items():
        for name, loss in (("ddp", ddp), ("no_sync", floor), ("avg", avg)):
            results[quality_sweep.run_key(name, 2, 2000, seed)] = record(name, loss, seed)
    assert "avg@2x2000" in results and "avg@2x2000-s7" in results
    assert "seed=7" in quality_sweep.command("avg", 2, 2000, seed=7)
    assert not any(o.startswith("seed=") for o in quality_sweep.command("avg", 2, 2000))
    assert quality_sweep.gap_closed(results["avg@2x2000"], results) == 0.5
    assert quality_sweep.gap_closed(results["avg@2x2000-s7"], results) == 0.75
    assert "| avg | 2 | 2000 | 75% (seed 7), 50% (seed 1234) | 62% |" in (
        quality_sweep.seed_table(results)
    )


def test_unknown_setting_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown setting 'nope'; known: "):
        quality_sweep.sweep(["nope"], 2, 20, tmp_path / "r.json", tmp_path)


def test_round_factors() -> None:
    assert round_factor("cosine", 0, 5, 0.1) == pytest.approx(1.0)
    assert round_factor("cosine", 2, 5, 0.1) == pytest.approx(0.55)
    assert round_factor("cosine", 4, 5, 0.1) == pytest.approx(0.1)
    assert round_factor("linear", 1, 5, 1.5) == pytest.approx(1.125)
    assert round_factor("warmup", 1, 10, 0.2, warmup_rounds=4) == pytest.approx(0.4)
    assert round_factor("warmup", 7, 10, 0.2, warmup_rounds=4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="schedule kind 'step' is not known; use one of"):
        OuterLrSchedule(sync_every=10, kind="step")


def test_outer_lr_schedule_sets_the_next_rounds_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    anchor = torch.zeros(3, requires_grad=True)
    outer = SimpleNamespace(outer_optimizer=torch.optim.SGD([anchor], lr=0.8), outer_steps=0)
    # The schedule reads the strategy's public outer_syncs (built at setup in a real fit).
    monkeypatch.setattr(SwarmStrategy, "outer_syncs", property(lambda self: [outer]))
    strategy = SwarmStrategy()
    trainer = SimpleNamespace(strategy=strategy, max_steps=50)
    schedule = OuterLrSchedule(sync_every=10, kind="linear", final=0.5)  # 5 rounds
    group = outer.outer_optimizer.param_groups[0]
    for rnd, expected in ((0, 0.8), (2, 0.6), (2, 0.6), (4, 0.4)):
        outer.outer_steps = rnd
        schedule.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        assert group["lr"] == pytest.approx(expected)


def test_inner_lr_schedule_scales_the_modules_rate_without_compounding() -> None:
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.AdamW([param], lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = SimpleNamespace(
        max_steps=40, global_step=0, lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)]
    )
    schedule = InnerLrSchedule(sync_every=10, kind="linear", final=0.25)  # 4 rounds
    for step, expected in ((0, 3e-3), (15, 2.25e-3), (15, 2.25e-3), (39, 0.75e-3)):
        trainer.global_step = step
        schedule.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
