"""SwarmStrategy end to end over real gloo process groups (fork launcher, CPU)."""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from lightning_swarm import SwarmStrategy
from tests.helpers import (
    QUIET,
    GrowingRegressor,
    Recorder,
    ScheduledRegressor,
    ThawingRegressor,
    TinyRegressor,
    TwoOptimizerModule,
    load_ranks,
    regression_data,
)

PLAIN_OUTER = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)


def _fit(strategy: object, devices: int, out: Path, steps: int, **trainer_kw: object) -> None:
    pl.seed_everything(7)
    kwargs = {**QUIET, **trainer_kw}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,  # type: ignore[arg-type]
        max_steps=steps,
        callbacks=[Recorder(str(out))],
        **kwargs,  # type: ignore[arg-type]
    )
    trainer.fit(TinyRegressor(), regression_data())


@pytest.mark.parametrize(
    ("world", "island_size", "shard_outer"), [(2, 1, True), (4, 2, False), (4, 2, True)]
)
def test_islands_agree_after_sync_and_differ_between(
    tmp_path: Path, world: int, island_size: int, shard_outer: bool
) -> None:
    sync_every = 4
    strategy = SwarmStrategy(
        sync_every=sync_every,
        island_size=island_size,
        shard_outer=shard_outer,
        start_method="fork",
    )
    _fit(strategy, world, tmp_path, steps=12)
    ranks = load_ranks(tmp_path, world)
    sharded = shard_outer and island_size > 1
    for r in ranks:
        assert r["inner_steps"] == [12] and r["outer_steps"] == [3]
    for i in range(12):
        step = ranks[0]["steps"][i]["global_step"]
        params = [r["steps"][i]["params"] for r in ranks]
        anchors = [r["steps"][i]["anchors"][0] for r in ranks]
        # inside an island every rank is identical at every step (DDP over the island group)
        for r in range(world):
            leader = (r // island_size) * island_size
            assert torch.equal(params[r], params[leader])
        # ranks at the same position of every island hold the same anchors (all of them, or
        # the same share when sharded); they only move at a sync
        for r in range(world):
            assert torch.equal(anchors[r], anchors[r % island_size])
        if sharded:  # a share each: together the island's ranks hold every anchor once
            shares = [set(ranks[r]["steps"][i]["named_anchors"]) for r in range(island_size)]
            assert set.union(*shares) == set(ranks[0]["steps"][i]["named_params"])
            assert sum(len(s) for s in shares) == len(ranks[0]["steps"][i]["named_params"])
            assert all(shares)
        if step % sync_every == 0:
            assert all(torch.equal(p, params[0]) for p in params), f"ranks differ after sync {step}"
            for r in range(world):
                record = ranks[r]["steps"][i]
                for name, anchor in record["named_anchors"].items():
                    assert torch.equal(record["named_params"][name], anchor), (step, r, name)
        else:
            assert not torch.equal(params[0], params[island_size]), f"islands equal at {step}"
    # anchors did move: three outer steps happened
    assert not torch.equal(ranks[0]["steps"][0]["anchors"][0], ranks[0]["steps"][-1]["anchors"][0])


def test_sync_every_1_with_plain_outer_sgd_matches_ddp(tmp_path: Path) -> None:
    swarm_dir, ddp_dir = tmp_path / "swarm", tmp_path / "ddp"
    swarm_dir.mkdir(), ddp_dir.mkdir()
    _fit(
        SwarmStrategy(sync_every=1, outer_optimizer=PLAIN_OUTER, start_method="fork"),
        2,
        swarm_dir,
        steps=10,
    )
    _fit(DDPStrategy(start_method="fork"), 2, ddp_dir, steps=10)
    swarm, ddp = load_ranks(swarm_dir, 2), load_ranks(ddp_dir, 2)
    for s, d in zip(swarm, ddp, strict=True):
        torch.testing.assert_close(s["final"], d["final"], rtol=0, atol=1e-6)
    # not trivially equal to the starting point
    assert not torch.allclose(swarm[0]["final"], swarm[0]["steps"][0]["anchors"][0], atol=1e-3)


def test_single_island_with_plain_outer_sgd_matches_plain_training(tmp_path: Path) -> None:
    swarm_dir, plain_dir = tmp_path / "swarm", tmp_path / "plain"
    swarm_dir.mkdir(), plain_dir.mkdir()
    _fit(
        SwarmStrategy(sync_every=3, outer_optimizer=PLAIN_OUTER, start_method="fork"),
        1,
        swarm_dir,
        steps=9,
        use_distributed_sampler=False,  # the same batch order as the plain run
    )
    _fit("auto", 1, plain_dir, steps=9, use_distributed_sampler=False)
    swarm, plain = load_ranks(swarm_dir, 1)[0], load_ranks(plain_dir, 1)[0]
    assert swarm["outer_steps"] == [3]
    torch.testing.assert_close(swarm["final"], plain["final"], rtol=0, atol=1e-6)


def test_counts_real_steps_per_optimizer_not_micro_batches(tmp_path: Path) -> None:
    # 16 batches with accumulate_grad_batches=2 -> 8 inner steps -> 2 syncs at sync_every=4
    strategy = SwarmStrategy(sync_every=4, start_method="fork")
    _fit(strategy, 2, tmp_path, steps=8, accumulate_grad_batches=2)
    ranks = load_ranks(tmp_path, 2)
    assert ranks[0]["inner_steps"] == [8] and ranks[0]["outer_steps"] == [2]
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


def test_manual_optimization_with_two_optimizers(tmp_path: Path) -> None:
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SwarmStrategy(sync_every=2, start_method="fork"),
        max_epochs=1,
        limit_train_batches=8,
        callbacks=[Recorder(str(tmp_path))],
        **QUIET,
    )
    trainer.fit(TwoOptimizerModule(), regression_data())
    ranks = load_ranks(tmp_path, 2)
    # optimizer a steps 8 times (4 syncs), optimizer b every other batch (4 steps, 2 syncs)
    assert ranks[0]["inner_steps"] == [8, 4]
    assert ranks[0]["outer_steps"] == [4, 2]
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


def test_mixed_precision_clipping_scheduler_and_bf16_anchors(tmp_path: Path) -> None:
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        out.mkdir()
        strategy = SwarmStrategy(sync_every=5, anchor_dtype=dtype, start_method="fork")
        pl.seed_everything(7)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=10,
            precision="bf16-mixed",
            gradient_clip_val=0.5,
            callbacks=[Recorder(str(out))],
            **QUIET,
        )
        trainer.fit(ScheduledRegressor(), regression_data())
        runs[dtype] = load_ranks(out, 2)
    for ranks in runs.values():
        assert ranks[0]["outer_steps"] == [2]
        assert torch.equal(ranks[0]["final"], ranks[1]["final"])
        assert ranks[0]["lr"] == pytest.approx(0.05 * 0.5**2)  # the scheduler stepped 10 times
    start = runs["float32"][0]["steps"][0]["anchors"][0]
    moved_f32 = runs["float32"][0]["final"] - start
    moved_bf16 = runs["bfloat16"][0]["final"] - start
    # bf16 anchors follow the float32 trajectory (to bf16 resolution), they do not stall
    assert moved_f32.norm() > 0.05
    assert (moved_bf16 - moved_f32).norm() < 0.1 * moved_f32.norm()


def test_parameter_unfrozen_mid_run_is_synced(tmp_path: Path) -> None:
    strategy = SwarmStrategy(sync_every=4, start_method="fork", frozen_params="sync")
    pl.seed_everything(7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=8,
        callbacks=[Recorder(str(tmp_path))],
        **QUIET,
    )
    trainer.fit(ThawingRegressor(), regression_data())
    ranks = load_ranks(tmp_path, 2)
    first_layer = slice(0, 8 * 16)  # net.0.weight comes first in flat_params
    start = ranks[0]["steps"][0]["params"][first_layer]
    assert not torch.equal(ranks[0]["final"][first_layer], start)  # it trained after thawing
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])  # and the last sync covered it


def test_parameters_added_after_setup_are_refused(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SwarmStrategy(sync_every=2, start_method="fork"),
        max_steps=4,
        **QUIET,
    )
    with pytest.raises(Exception, match="gained or lost parameters after setup"):
        trainer.fit(GrowingRegressor(), regression_data())


def test_sync_metrics_logged_at_sync_steps(tmp_path: Path) -> None:
    pl.seed_everything(7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SwarmStrategy(sync_every=4, start_method="fork"),
        max_steps=12,
        logger=CSVLogger(str(tmp_path), name="m", version=0),
        log_every_n_steps=50,  # far above sync_every: sparse events must still be written
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor(), regression_data())
    with open(tmp_path / "m" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("swarm/outer_steps")]
    assert [int(r["step"]) for r in rows] == [4, 8, 12]
    assert [float(r["swarm/outer_steps"]) for r in rows] == [1.0, 2.0, 3.0]
    sent = [float(r["swarm/bytes_sent"]) for r in rows]
    n_params = sum(p.numel() for p in TinyRegressor().parameters())
    # two islands: a ring all-reduce sends the payload once per sync
    assert sent == [n_params * 4 * k for k in (1, 2, 3)]
    assert all(float(r["swarm/pseudo_grad_norm"]) > 0 for r in rows)


def test_registry_name_and_idempotent_import() -> None:
    import importlib

    import lightning_swarm

    importlib.reload(lightning_swarm)  # a second registration must not fail
    trainer = pl.Trainer(strategy="swarm", accelerator="cpu", devices=1, **QUIET)
    assert isinstance(trainer.strategy, SwarmStrategy)


# -- the end of fit ---------------------------------------------------------------------------
class FinalWeights(pl.Callback):
    """Saves each rank's parameters at teardown: what ``trainer.fit`` leaves in the module."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        path = Path(self.out_dir) / f"final{trainer.global_rank}.pt"
        torch.save(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]), path)


class StopAt(pl.Callback):
    """Sets ``trainer.should_stop`` after a given step (as EarlyStopping or a timer would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def _fit_to_end(
    out: Path, module: pl.LightningModule, strategy: SwarmStrategy, **trainer_kw: object
) -> tuple[list[dict], list[torch.Tensor]]:
    pl.seed_everything(7)
    callbacks = [Recorder(str(out)), FinalWeights(str(out)), *trainer_kw.pop("callbacks", [])]  # type: ignore[misc]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks, **QUIET, **trainer_kw
    )
    trainer.fit(module, regression_data())
    finals = [torch.load(out / f"final{r}.pt", weights_only=True) for r in range(2)]
    return load_ranks(out, 2), finals


@pytest.mark.parametrize("sync_at_end", [True, False])
def test_fit_ends_with_every_island_holding_the_global_model(
    tmp_path: Path, sync_at_end: bool
) -> None:
    strategy = SwarmStrategy(sync_every=5, sync_at_end=sync_at_end, start_method="fork")
    ranks, finals = _fit_to_end(tmp_path, TinyRegressor(), strategy, max_steps=12)
    last = [r["steps"][-1] for r in ranks]  # on_train_batch_end of step 12: checkpoint time
    assert all(r["inner_steps"] == [12] for r in ranks)
    if sync_at_end:
        # rounds at 5 and 10, and the end-of-fit round after step 12, before the last batch end
        assert all(r["outer_steps"] == [3] for r in ranks)
        assert torch.equal(last[0]["params"], last[1]["params"])
        assert torch.equal(last[0]["params"], last[0]["anchors"][0])
        assert torch.equal(finals[0], finals[1]) and torch.equal(finals[0], last[0]["params"])
    else:
        assert all(r["outer_steps"] == [2] for r in ranks)
        assert not torch.equal(finals[0], finals[1])
        assert torch.equal(finals[0], last[0]["params"])


def test_end_of_fit_round_with_fragments_and_a_round_in_flight(tmp_path: Path) -> None:
    # H=4, F=2 (one layer each), tau=1: fragment 0 is sent after step 10 and due at 11.
    strategy = SwarmStrategy(
        sync_every=4, num_fragments=2, sync_delay=1, merge_alpha=0.5, start_method="fork"
    )
    ranks, finals = _fit_to_end(tmp_path, TinyRegressor(), strategy, max_steps=10)
    assert torch.equal(finals[0], finals[1])
    assert torch.equal(ranks[0]["steps"][-1]["params"], ranks[0]["steps"][-1]["anchors"][0])


def test_end_of_fit_round_at_the_last_batch_of_the_last_epoch(tmp_path: Path) -> None:
    strategy = SwarmStrategy(sync_every=5, start_method="fork")
    ranks, finals = _fit_to_end(
        tmp_path, TinyRegressor(), strategy, max_epochs=1, limit_train_batches=7
    )
    assert ranks[0]["outer_steps"] == [2]  # the round at 5 and the end-of-fit round
    last = [r["steps"][-1]["params"] for r in ranks]
    assert torch.equal(last[0], last[1]) and torch.equal(finals[0], finals[1])


def test_end_of_fit_round_under_manual_optimization(tmp_path: Path) -> None:
    # Optimizer a steps 7 times (rounds at 2, 4, 6), b at batches 1, 3, 5 (a round at 2): both
    # end between rounds, and the round runs once all of the last batch's steps are done.
    strategy = SwarmStrategy(sync_every=2, start_method="fork")
    ranks, finals = _fit_to_end(
        tmp_path, TwoOptimizerModule(), strategy, max_epochs=1, limit_train_batches=7
    )
    assert ranks[0]["inner_steps"] == [7, 3] and ranks[0]["outer_steps"] == [4, 2]
    last = [r["steps"][-1]["params"] for r in ranks]  # before the last batch's callbacks
    assert torch.equal(last[0], last[1]) and torch.equal(finals[0], finals[1])


def test_an_unforeseen_stop_is_synced_at_train_end(tmp_path: Path) -> None:
    strategy = SwarmStrategy(sync_every=5, start_method="fork")
    ranks, finals = _fit_to_end(
        tmp_path, TinyRegressor(), strategy, max_steps=20, callbacks=[StopAt(7)]
    )
    assert ranks[0]["inner_steps"] == [7]
    # should_stop came after the step: the last batch end saw local weights, fit's end did not
    last = [r["steps"][-1]["params"] for r in ranks]
    assert not torch.equal(last[0], last[1])
    assert torch.equal(finals[0], finals[1])
