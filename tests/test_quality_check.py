"""The quality check (benchmarks/quality_check.py): its scoring, the candidate outer steps of
issue 40 (quality_schedules.OuterStepSchedule) and a short end-to-end run on a user's module."""

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

import quality_check  # noqa: E402
import quality_workloads  # noqa: E402

from benchmarks.quality_schedules import OuterStepSchedule, inner_lr_ratio  # noqa: E402
from lightning_swarm.strategy import SwarmStrategy  # noqa: E402


def _record(variant: str, final: float, seed: int = 1) -> dict[str, object]:
    spec = {"workload": "cnn", "variant_name": variant, "islands": 2, "steps": 300, "seed": seed}
    kind = variant if variant in ("ddp", "local") else "swarm"
    return {**spec, "variant": {"kind": kind}, "final": final}


def test_gap_closed_against_the_ends_of_the_same_seed() -> None:
    results = {}
    for seed, (ddp, local, avg) in {1: (1.0, 2.0, 1.5), 2: (1.0, 3.0, 3.5)}.items():
        for name, value in (("ddp", ddp), ("local", local), ("avg", avg)):
            record = _record(name, value, seed)
            results[quality_check.run_key(record)] = record
    assert quality_check.gap_closed(results["cnn/avg@2x300-s1"], results) == 0.5
    assert quality_check.gap_closed(results["cnn/avg@2x300-s2"], results) == -0.25
    row = next(r for r in quality_check.summary(results) if r["variant"] == "avg")
    assert row["shares"] == {1: 0.5, 2: -0.25}
    assert row["mean_share"] == pytest.approx(0.125)
    assert row["half_range"] == pytest.approx(0.375)
    assert row["min_share"] == -0.25
    assert "| cnn | 2 | 300 | avg | 1.5000, 3.5000 | 50%, -25% | 12% (± 38) |" in (
        quality_check.table(results)
    )
    assert "| avg | 12% (50, -25) |" in quality_check.pivot(results)
    del results["cnn/local@2x300-s2"]
    assert quality_check.gap_closed(results["cnn/avg@2x300-s2"], results) is None


def test_shares_against_the_ddp_runs_of_another_file() -> None:
    results = {}
    for name, value in (("ddp", 1.0), ("local", 2.0), ("avg", 1.5)):
        record = _record(name, value)
        results[quality_check.run_key(record)] = record
    paired = {"cnn/ddp@2x300-s1": _record("ddp", 1.5), "cnn/local@2x300-s1": _record("local", 9.0)}
    scored = quality_check.with_ddp_from(results, paired)
    assert scored["cnn/local@2x300-s1"]["final"] == 2.0  # only the DDP runs are taken
    assert quality_check.gap_closed(scored["cnn/avg@2x300-s1"], scored) == 1.0
    assert quality_check.with_ddp_from(results, {}).get("cnn/ddp@2x300-s1") is None


def test_user_module_needs_an_import_path() -> None:
    with pytest.raises(ValueError, match="write it as package.module:Class"):
        quality_check.workload_of({"module": "my_pkg.model", "data": "x:Y"})


def test_one_rank_ddp_needs_the_users_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        quality_check.main(["--module", "a:B", "--data", "c:D", "--ddp", "one_rank"])
    assert "give the per-island batch in --data-args" in capsys.readouterr().err


def test_a_results_file_holds_one_kind_of_ddp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DDP record made one way is not taken as the other's baseline: the check stops before
    running anything and names the file, the run and the other option."""
    results = tmp_path / "r.json"
    key = "cnn/ddp@2x300-s1"
    results.write_text(json.dumps({key: {"ddp": "one_rank", "final": 0.5, "curve": []}}))
    with pytest.raises(SystemExit):
        quality_check.main(
            ["--workload", "cnn", "--results", str(results), "--work", str(tmp_path)]
        )
    err = capsys.readouterr().err
    assert f"{results} holds {key} made with --ddp one_rank" in err
    assert "another --results file for --ddp ranks" in err


def test_inner_lr_ratio_reads_the_schedulers_base() -> None:
    param = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.AdamW([param], lr=4e-3)
    trainer = SimpleNamespace(optimizers=[optimizer])
    assert inner_lr_ratio(trainer) == 1.0  # type: ignore[arg-type]  # no scheduler
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - 0.25 * s)
    optimizer.step()
    scheduler.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
    assert inner_lr_ratio(trainer) == pytest.approx(0.5)  # type: ignore[arg-type]


def test_outer_step_schedule_scales_lr_and_warms_momentum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    anchor = torch.zeros(3, requires_grad=True)
    outer_optimizer = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    outer = SimpleNamespace(outer_optimizer=outer_optimizer, outer_steps=0)
    monkeypatch.setattr(SwarmStrategy, "outer_syncs", property(lambda self: [outer]))
    inner = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    inner.param_groups[0]["initial_lr"] = 2e-3  # a scheduler at half its peak
    trainer = SimpleNamespace(strategy=SwarmStrategy(), optimizers=[inner])
    schedule = OuterStepSchedule(lr_by_inner=True, momentum_warmup_rounds=4)
    group = outer_optimizer.param_groups[0]
    for rnd, momentum in ((0, 0.0), (1, 0.225), (1, 0.225), (3, 0.675), (9, 0.9)):
        outer.outer_steps = rnd
        schedule.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        assert group["lr"] == pytest.approx(0.35)  # 0.7 x 0.5, never compounded
        assert group["momentum"] == pytest.approx(momentum)
    group["lr"], group["momentum"] = 0.7, 0.9  # a fresh fit: the optimizer's own values
    fading = OuterStepSchedule(momentum_warmup_rounds=4, momentum_by_inner=True)
    outer.outer_steps = 2
    fading.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
    assert group["lr"] == pytest.approx(0.7)  # lr_by_inner off: the base, untouched
    assert group["momentum"] == pytest.approx(0.225)  # 0.9 x 2/4 x the inner ratio 0.5
    with pytest.raises(ValueError, match="momentum_warmup_rounds must be >= 0, got -1"):
        OuterStepSchedule(momentum_warmup_rounds=-1)


def test_outer_step_schedule_applies_the_librarys_momentum_shares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    anchor = torch.zeros(3, requires_grad=True)
    outer_optimizer = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    outer = SimpleNamespace(outer_optimizer=outer_optimizer, outer_steps=0, sync_every=25)
    monkeypatch.setattr(SwarmStrategy, "outer_syncs", property(lambda self: [outer]))
    inner = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    trainer = SimpleNamespace(strategy=SwarmStrategy(), optimizers=[inner], max_steps=300)
    schedule = OuterStepSchedule(momentum_shares=(0.5, 0.25))  # 12 rounds: up 6, down 3
    group = outer_optimizer.param_groups[0]
    for rnd, momentum in ((0, 0.0), (3, 0.45), (7, 0.9), (10, 0.3), (11, 0.0)):
        outer.outer_steps = rnd
        schedule.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        assert group["momentum"] == pytest.approx(momentum)
        assert group["lr"] == pytest.approx(0.7)


def test_generated_images_are_deterministic_and_class_conditional() -> None:
    images, labels = quality_workloads.make_images(64, num_classes=10, size=8, noise=0.0, seed=3)
    again, same = quality_workloads.make_images(64, num_classes=10, size=8, noise=0.0, seed=3)
    assert images.shape == (64, 3, 8, 8) and torch.equal(images, again)
    assert torch.equal(labels, same) and int(labels.max()) < 10
    val, _ = quality_workloads.make_images(32, num_classes=10, size=8, noise=0.0, seed=3)
    assert not torch.equal(val, images[:32])  # another draw, same class patterns


def test_cosine_with_warmup_hand_values() -> None:
    f = quality_workloads.cosine_with_warmup
    assert f(0, 4, 104, 0.1) == pytest.approx(0.25)
    assert f(4, 4, 104, 0.1) == pytest.approx(1.0)
    assert f(54, 4, 104, 0.1) == pytest.approx(0.55)
    assert f(104, 4, 104, 0.1) == pytest.approx(0.1)


@pytest.mark.slow  # ~60 s: four 2-rank fits of a tiny CNN
@pytest.mark.timeout(600)
def test_check_runs_on_a_users_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The user path: import paths of a module and data module, ddp / local / a swarm."""
    results, png = tmp_path / "r.json", tmp_path / "curves.png"
    argv = ["--module", "quality_workloads:SmallCNN"]
    argv += ["--data", "quality_workloads:ShapesDataModule"]
    data = {"num_train": 800, "num_val": 256, "size": 8, "batch_size": 8}
    argv += ["--data-args", json.dumps(data)]
    argv += ["--steps", "20", "--sync-every", "5", "--eval-every", "10", "--results", str(results)]
    argv += ["--variants", "ddp", "local", "default", "paper_momentum_warmup"]
    argv += ["--plot", str(png), "--work", str(tmp_path / "runs")]
    quality_check.main(argv)
    records = json.loads(results.read_text())
    assert len(records) == 4
    for record in records.values():
        assert [step for step, _ in record["curve"]] == [10, 20]
        assert math.isfinite(record["final"])
    key = "quality_workloads:SmallCNN/default@2x20-s1"
    assert quality_check.gap_closed(records[key], records) is not None
    assert "| quality_workloads:SmallCNN | 2 | 20 | default |" in capsys.readouterr().out
    assert png.stat().st_size > 0
