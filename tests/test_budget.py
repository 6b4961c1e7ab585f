"""Rounds on a time budget (``sync_every_s``): the budget, the weights, the stop, the resume."""

from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from lightning_swarm import SwarmStrategy
from lightning_swarm.algorithm.budget import RoundBudget, scale_of
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.between_rounds import BudgetFit
from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.outer import OuterSync
from lightning_swarm.outer.sync_state import StreamingOptions
from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.base import Transport
from lightning_swarm.transport.errors import NonFinitePseudoGradientError
from lightning_swarm.transport.reduce_scatter import ReduceScatterTransport
from tests.dist_utils import run_ranks
from tests.helpers import QUIET, Recorder, TinyRegressor, load_ranks, regression_data

SHAPES = [(4, 3), (11,), (2, 2, 5)]
PLAIN_OUTER = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)
NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


class FakeClock:
    """A clock the test advances; steps of binary-exact lengths keep every sum exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the budget, alone --------------------------------------------------------------------
def test_budget_is_spent_after_its_seconds_and_restarts_when_the_island_leaves_a_round() -> None:
    clock = FakeClock()
    budget = RoundBudget(1.0, clock=clock)
    verdicts = []
    for step in range(1, 7):
        clock.now += 0.25
        verdicts.append(budget.spent())  # the first call starts the clock
        if verdicts[-1]:
            assert budget.work(step) == step
            budget.restart(step)
    assert verdicts == [False, False, False, False, True, False]
    assert budget.round_started_step == 5 and budget.elapsed_s() == 0.25


def test_an_island_that_reaches_max_steps_joins_a_round_before_its_budget_is_spent() -> None:
    clock = FakeClock()
    budget = RoundBudget(100.0, clock=clock)
    budget.max_inner_steps = 3
    assert [budget.spent(step) for step in (1, 2, 3)] == [False, False, True]


def test_budget_state_continues_from_the_moment_it_is_loaded() -> None:
    clock = FakeClock()
    budget = RoundBudget(2.0, clock=clock)
    budget.spent()
    clock.now += 1.5
    budget.restart(3)
    clock.now += 0.5
    saved = budget.state_dict()
    assert saved == {"elapsed_s": 0.5, "round_started_step": 3, "swarm_steps": None}
    clock.now = 100.0
    again = RoundBudget(2.0, clock=clock)
    again.load_state_dict(saved)
    clock.now += 1.25
    assert not again.spent() and again.elapsed_s() == 1.75
    clock.now += 0.25
    assert again.spent() and again.work(7) == 4


def test_the_island_decision_overrides_the_own_clock() -> None:
    budget = RoundBudget(1.0, clock=FakeClock(), island_decision=lambda own: not own)
    assert budget.spent()  # its own clock says no; the island's first rank said yes


def test_scale_of_is_exactly_one_for_equal_or_no_work() -> None:
    assert scale_of([3.0, 3.0, 3.0], 1) == 1.0
    assert scale_of([0.0, 0.0], 0) == 1.0
    assert scale_of([3.0, 1.0], 0) == 1.5 and scale_of([3.0, 1.0], 1) == 0.5


@pytest.mark.parametrize("seconds", [0, -1.0, float("inf"), True, "30"])
def test_a_bad_budget_is_refused(seconds: Any) -> None:
    with pytest.raises(SwarmConfigError, match=r"sync_every_s must be a number of seconds > 0"):
        SwarmConfig(sync_every_s=seconds)


@pytest.mark.parametrize(
    ("options", "named", "fix"),
    [
        ({"num_fragments": 2, "sync_every": 4}, "num_fragments=2", "num_fragments=1"),
        ({"sync_delay": 1}, "sync_delay=1", "sync_delay=0"),
    ],
)
def test_what_a_budget_cannot_combine_with_is_refused_by_name(
    options: dict[str, Any], named: str, fix: str
) -> None:
    with pytest.raises(SwarmConfigError, match=rf"cannot be combined with {named}: .*set {fix}"):
        SwarmConfig(sync_every_s=5.0, **options)


def test_the_budget_stop_needs_max_steps_and_refuses_epochs() -> None:
    with pytest.raises(SwarmConfigError, match=r"max_steps is not set; pass Trainer\(max_steps"):
        BudgetFit(pl.Trainer(max_epochs=1, **QUIET), 2.0)
    with pytest.raises(SwarmConfigError, match=r"max_epochs=3\).*pass max_steps only"):
        BudgetFit(pl.Trainer(max_steps=10, max_epochs=3, **QUIET), 2.0)
    trainer = pl.Trainer(max_steps=10, **QUIET)
    stop = BudgetFit(trainer, 2.0)
    stop.install()
    assert trainer.max_steps == -1
    stop.after_round(9)
    assert not trainer.should_stop
    stop.after_round(10)  # some island reached max_steps at this round
    assert trainer.should_stop
    stop.restore()
    assert trainer.max_steps == 10


# -- two islands over gloo, driven by fake clocks --------------------------------------------
def _params() -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"p{i}": torch.nn.Parameter(torch.randn(s, generator=gen)) for i, s in enumerate(SHAPES)
    }


def _train(params: dict[str, torch.nn.Parameter], rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.1)


def _transport(kind: str, rank: int, world: int) -> Transport:
    if kind == "int8":
        return ReduceScatterTransport(
            None, num_islands=world, island_index=rank, codec=Codec("int8", 4), bucket_numel=8
        )
    return AllReduceTransport(None, num_islands=world, bucket_numel=7)


def _sync(kind: str, rank: int, world: int, seconds: float | None, clock: FakeClock) -> OuterSync:
    streaming = StreamingOptions(
        codec=Codec("int8", 4) if kind == "int8" else None, error_feedback=kind == "int8"
    )
    budget = None if seconds is None else RoundBudget(seconds, clock=clock)
    return OuterSync(
        _params(),
        outer_optimizer=NESTEROV,
        transport=_transport(kind, rank, world),
        sync_every=10**6,
        streaming=streaming,
        budget=budget,
    )


def _run(outer: OuterSync, rank: int, clock: FakeClock, dt: float, max_steps: int) -> list[int]:
    """Step until a round where some island reached ``max_steps`` (the strategy's rule);
    returns the inner steps at each round."""
    budget = outer.budget
    assert budget is not None
    rounds = []
    while True:
        _train(outer.params, rank, outer.inner_steps)
        clock.now += dt
        report = outer.on_inner_step()
        if report is not None:
            rounds.append(outer.inner_steps)
            assert budget.swarm_steps is not None
            if budget.swarm_steps >= max_steps:
                return rounds


def _snapshot(outer: OuterSync) -> dict[str, Tensor]:
    return {n: a.clone() for n, a in outer.anchors.items()}


def _weighted_worker(rank: int, world: int, out: str, kind: str) -> None:
    clock = FakeClock()
    # Island 0 steps every 0.25 s, island 1 every 0.75 s: the first budget ends after step 5 and
    # step 3 (it starts at the first step), the next ones every 4 and 2 steps.
    outer = _sync(kind, rank, world, 1.0, clock)
    rounds = _run(outer, rank, clock, [0.25, 0.75][rank], max_steps=12)
    torch.save({"rounds": rounds, "anchors": _snapshot(outer), "params": dict(outer.params)},
               f"{out}/{rank}.pt")  # fmt: skip


@pytest.mark.parametrize("kind", ["allreduce", "int8"])
def test_islands_of_different_speeds_end_equal_with_different_step_counts(
    tmp_path: Path, kind: str
) -> None:
    run_ranks(_weighted_worker, 2, str(tmp_path), kind, timeout_s=60)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["rounds"] == [5, 9, 13] and ranks[1]["rounds"] == [3, 5, 7]
    for name, anchor in ranks[0]["anchors"].items():
        assert torch.equal(anchor, ranks[1]["anchors"][name])  # bit for bit on every island
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])


def _one_round_worker(rank: int, world: int, out: str, steps: list[int], budgeted: bool) -> None:
    """``steps[rank]`` inner steps, then one round: on the budget's clock, or at once."""
    clock = FakeClock()
    budget = RoundBudget(1.0, clock=clock) if budgeted else None
    outer = OuterSync(
        _params(),
        outer_optimizer=PLAIN_OUTER,
        transport=_transport("allreduce", rank, world),
        sync_every=10**6,
        budget=budget,
    )
    if budget is not None:
        budget.restart(0)  # the clock starts now, so a single step can spend it
    for step in range(steps[rank]):
        _train(outer.params, rank, step)
        clock.now += 1.0 if step == steps[rank] - 1 else 0.0
        if budget is not None:
            assert (outer.on_inner_step() is None) == (step < steps[rank] - 1)
    if budget is None:
        outer.engine.round(0)
    torch.save(_snapshot(outer), f"{out}/{rank}.pt")


def _locals(rank: int, steps: int) -> dict[str, Tensor]:
    params = _params()
    for step in range(steps):
        _train(params, rank, step)
    return {n: p.detach().clone() for n, p in params.items()}


def test_the_mean_is_weighted_by_the_steps_and_plain_when_they_are_equal(tmp_path: Path) -> None:
    # Weighted: island 0 took 3 steps, island 1 one; outer SGD(lr=1) lands on the weighted mean.
    run_ranks(_one_round_worker, 2, str(tmp_path), [3, 1], True, timeout_s=60)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    locals_ = [_locals(0, 3), _locals(1, 1)]
    for name, anchor in got[0].items():
        assert torch.equal(anchor, got[1][name])
        expected = (3 * locals_[0][name] + locals_[1][name]) / 4
        torch.testing.assert_close(anchor, expected, rtol=0, atol=1e-6)
    # Equal work: bit for bit the unweighted round.
    plain, budgeted = tmp_path / "plain", tmp_path / "budgeted"
    plain.mkdir(), budgeted.mkdir()
    run_ranks(_one_round_worker, 2, str(plain), [2, 2], False, timeout_s=60)
    run_ranks(_one_round_worker, 2, str(budgeted), [2, 2], True, timeout_s=60)
    for r in range(2):
        a, b = torch.load(plain / f"{r}.pt"), torch.load(budgeted / f"{r}.pt")
        assert all(torch.equal(a[n], b[n]) for n in a)


def _nan_worker(rank: int, world: int, out: str) -> None:
    clock = FakeClock()
    outer = _sync("allreduce", rank, world, 1.0, clock)
    before = _snapshot(outer)
    _train(outer.params, rank, 0)
    if rank == 1:
        with torch.no_grad():
            outer.params["p1"][3] = float("nan")
    clock.now += 2.0
    outer.on_inner_step()  # starts the budget
    clock.now += 2.0
    with pytest.raises(NonFinitePseudoGradientError, match=r"island\(s\) \[1\]"):
        outer.on_inner_step()
    assert all(torch.equal(outer.anchors[n], before[n]) for n in before)
    budget = outer.budget
    assert budget is not None and budget.round_started_step == 2  # a new budget began
    Path(f"{out}/{rank}.ok").touch()


def test_a_non_finite_island_is_refused_on_every_island_under_a_budget(tmp_path: Path) -> None:
    run_ranks(_nan_worker, 2, str(tmp_path), timeout_s=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.ok", "1.ok"]


def _resume_worker(rank: int, world: int, out: str, stop_after: list[int] | None) -> None:
    """Run to the end; or stop after ``stop_after`` steps of this island (mid-budget), save,
    build everything again (a restart) at a later time on the clock, load and run to the end."""
    dt, clock = [0.25, 0.75][rank], FakeClock()
    outer = _sync("int8", rank, world, 1.0, clock)
    if stop_after is not None:
        for _ in range(stop_after[rank]):
            _train(outer.params, rank, outer.inner_steps)
            clock.now += dt
            outer.on_inner_step()
        state, island = outer.state_dict(), outer.island_state_dict()
        params = {n: p.detach().clone() for n, p in outer.params.items()}
        clock.now += 500.0  # the restart takes a while: not charged to the budget
        outer = _sync("int8", rank, world, 1.0, clock)
        with torch.no_grad():
            for name, p in outer.params.items():
                p.copy_(params[name])
        outer.load_state_dict(state)
        outer.load_island_state_dict(island)
    rounds = _run(outer, rank, clock, dt, max_steps=12)
    torch.save({"rounds": rounds, "anchors": _snapshot(outer), "params": dict(outer.params)},
               f"{out}/{rank}.pt")  # fmt: skip


def test_a_resume_mid_budget_ends_bitwise_as_the_uninterrupted_run(tmp_path: Path) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    run_ranks(_resume_worker, 2, str(whole), None, timeout_s=60)
    # After round 1 (island 0 at step 5, island 1 at step 3), each island 7 and 4 steps in:
    # mid-budget, at different inner steps.
    run_ranks(_resume_worker, 2, str(resumed), [7, 4], timeout_s=60)
    a = [torch.load(whole / f"{r}.pt", weights_only=False) for r in range(2)]
    b = [torch.load(resumed / f"{r}.pt", weights_only=False) for r in range(2)]
    for r in range(2):
        assert a[r]["rounds"][-1] == b[r]["rounds"][-1]
        for name, anchor in a[r]["anchors"].items():
            assert torch.equal(anchor, b[r]["anchors"][name])
            assert torch.equal(a[r]["params"][name], b[r]["params"][name])


# -- Lightning: two islands, one slower ---------------------------------------------------
class SleepyRegressor(TinyRegressor):
    """``TinyRegressor`` whose inner steps take ``delays[global_rank]`` seconds longer."""

    def __init__(self, delays: tuple[float, ...]) -> None:
        super().__init__()
        self.delays = delays

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        time.sleep(self.delays[self.global_rank])
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("world", "island_size"), [(2, 1), (4, 2)])
def test_a_fit_on_a_budget_ends_on_every_island_at_one_round(
    tmp_path: Path, world: int, island_size: int
) -> None:
    pl.seed_everything(7)
    strategy = SwarmStrategy(sync_every_s=0.2, island_size=island_size, start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=24,
        callbacks=[Recorder(str(tmp_path))],
        limit_val_batches=0,
        **QUIET,
    )
    # Island 0 (its ranks alike) steps faster than island 1.
    delays = tuple(0.01 if r < island_size else 0.05 for r in range(world))
    trainer.fit(SleepyRegressor(delays), regression_data())
    ranks = load_ranks(tmp_path, world)
    fast, slow = ranks[0]["inner_steps"][0], ranks[-1]["inner_steps"][0]
    assert fast >= 24 > slow, (fast, slow)  # the fit ended when the fast island got there
    for rank in ranks:
        # An island's ranks step and stop alike; every island ends on the same round and model.
        island = rank["island"]
        assert rank["inner_steps"] == ranks[island * island_size]["inner_steps"]
        assert rank["outer_steps"] == ranks[0]["outer_steps"]
        assert torch.equal(rank["final"], ranks[0]["final"])
    last = ranks[0]["steps"][-1]  # the last round left the model on its anchors
    assert all(torch.equal(a, last["named_params"][n]) for n, a in last["named_anchors"].items())
    assert trainer.max_steps == 24  # Lightning's own limit is back after the fit


@pytest.mark.parametrize(
    "options",
    [{}, {"transport": "swarm"}, {"quantize": "int8", "error_feedback": True}],
    ids=["allreduce", "swarm", "int8"],
)
def test_a_budget_with_merge_alpha_ends_with_every_island_on_the_global_model(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """The fit's last round merges with alpha; the end of the fit lands every island on the
    anchors with no second round (one with no step since would carry no weight), and no island
    trains past max_steps."""
    pl.seed_everything(7)
    strategy = SwarmStrategy(
        sync_every_s=0.1, merge_alpha=0.5, island_size=1, start_method="fork", **options
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=30,
        callbacks=[Recorder(str(tmp_path))],
        limit_val_batches=0,
        **QUIET,
    )
    trainer.fit(SleepyRegressor((0.01, 0.03)), regression_data())
    ranks = load_ranks(tmp_path, 2)
    assert ranks[0]["inner_steps"] == [30] and ranks[1]["inner_steps"][0] < 30
    assert ranks[0]["outer_steps"] == ranks[1]["outer_steps"]
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
    anchors = ranks[0]["steps"][-1]["anchors"][0]
    assert torch.equal(ranks[0]["final"], anchors)
    # Every earlier round merged with alpha: right after it the locals were not the anchors.
    steps = ranks[0]["steps"]
    rounds = [
        b for a, b in itertools.pairwise(steps) if not torch.equal(a["anchors"][0], b["anchors"][0])
    ]
    assert len(rounds) >= 2 and not torch.equal(rounds[-2]["params"], rounds[-2]["anchors"][0])
