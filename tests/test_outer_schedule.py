"""The outer momentum schedule (``MomentumSchedule``): its factors by hand, its refusals, and a
round that steps with the scheduled momentum, equal to torch's SGD given the same values."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_swarm.algorithm.outer_schedule import MomentumSchedule, base_momentum, total_rounds
from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.outer import OuterSync
from lightning_swarm.transport.allreduce import AllReduceTransport

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def test_default_ramps_up_over_the_first_half_and_down_over_the_second() -> None:
    schedule = MomentumSchedule()  # the SwarmConfig default: warmup 0.5, cooldown 0.5
    assert (schedule.warmup, schedule.cooldown) == (
        SwarmConfig().outer_momentum_warmup,
        SwarmConfig().outer_momentum_cooldown,
    )
    # 12 rounds: up by 1/6 a round from 0, down by 1/6 a round to 0 at the last round
    factors = [schedule.factor(k, 12) for k in range(12)]
    expected = [0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0]
    assert factors == pytest.approx(expected)
    # 13 rounds: the peak round reaches the full momentum
    assert max(schedule.factor(k, 13) for k in range(13)) == pytest.approx(6 / 7)
    assert MomentumSchedule(warmup=0.5, cooldown=0.25).factor(7, 12) == 1.0


def test_uneven_and_short_runs_and_no_schedule() -> None:
    schedule = MomentumSchedule(warmup=0.3, cooldown=0.1)
    # 7 rounds: warm-up over ceil(2.1) = 3 rounds, cool-down over ceil(0.7) = 1 round
    assert [schedule.factor(k, 7) for k in range(7)] == pytest.approx([0, 1 / 3, 2 / 3, 1, 1, 1, 0])
    assert schedule.factor(0, 1) == 0.0  # one round: a plain step
    assert schedule.factor(5, None) == 1.0  # length unknown: the optimizer's own momentum
    flat = MomentumSchedule(warmup=0.0, cooldown=0.0)
    assert [flat.factor(k, 4) for k in range(4)] == [1.0] * 4


def test_total_rounds_counts_the_last_partial_round() -> None:
    assert total_rounds(300, 25) == 12
    assert total_rounds(310, 25) == 13
    assert total_rounds(None, 25) is None
    assert total_rounds(float("inf"), 25) is None
    assert total_rounds(-1, 25) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"outer_momentum_warmup": 1.5}, "outer_momentum_warmup=1.5 must be a share"),
        ({"outer_momentum_cooldown": -0.1}, "outer_momentum_cooldown=-0.1 must be a share"),
        ({"outer_momentum_warmup": "half"}, "outer_momentum_warmup='half' must be a share"),
        (
            {"outer_momentum_warmup": 0.8, "outer_momentum_cooldown": 0.3},
            "overlap (their sum is above 1); lower one of them",
        ),
    ],
)
def test_bad_shares_are_refused_naming_the_option(options: dict, message: str) -> None:
    with pytest.raises(SwarmConfigError) as err:
        SwarmConfig(**options)
    assert message in str(err.value)


def test_base_momentum_is_none_where_the_optimizer_has_none() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    assert base_momentum(NESTEROV(p)) == [0.9]
    assert base_momentum(torch.optim.Adam(p)) == [None]


def _outer(h: int) -> tuple[OuterSync, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.zeros(5))
    outer = OuterSync(
        {"w": param},
        outer_optimizer=NESTEROV,
        transport=AllReduceTransport(None, num_islands=1, bucket_numel=3),
        sync_every=h,
        momentum=MomentumSchedule(),
    )
    return outer, param


def test_rounds_step_with_the_scheduled_momentum_as_torch_would() -> None:
    h, rounds = 2, 8
    outer, param = _outer(h)
    outer.set_run_length(h * rounds)
    reference = torch.zeros(5, requires_grad=True)
    ref_opt = NESTEROV([reference])
    schedule = MomentumSchedule()
    used = []
    for step in range(h * rounds):
        with torch.no_grad():
            param.add_(torch.linspace(-1, 1, 5) * (step + 1) ** 0.5)
        local = param.detach().clone()
        report = outer.on_inner_step()
        if report is None:
            continue
        k = len(used)
        used.append(outer.outer_optimizer.param_groups[0]["momentum"])
        assert report.outer_momentum == used[-1]  # what swarm/outer_momentum logs
        ref_opt.param_groups[0]["momentum"] = 0.9 * schedule.factor(k, rounds)
        reference.grad = reference.detach() - local
        ref_opt.step()
        assert torch.equal(outer.anchors["w"], reference.detach()), f"round {k}"
    assert used == pytest.approx([0.9 * schedule.factor(k, rounds) for k in range(rounds)])
    assert used[0] == 0.0 and used[-1] == 0.0 and max(used) == pytest.approx(0.9 * 3 / 4)


def test_a_restored_round_count_gives_the_same_momentum() -> None:
    h = 2
    first, param = _outer(h)
    first.set_run_length(16)
    for _ in range(6):  # three rounds
        with torch.no_grad():
            param.add_(1.0)
        first.on_inner_step()
    state = first.state_dict()
    second, param2 = _outer(h)
    second.load_state_dict(state)
    second.set_run_length(16)
    with torch.no_grad():
        param2.copy_(param)
    for outer in (first, second):
        outer.schedule_momentum(0)
    assert first.outer_optimizer.param_groups[0]["momentum"] == pytest.approx(0.9 * 3 / 4)
    assert (
        second.outer_optimizer.param_groups[0]["momentum"]
        == first.outer_optimizer.param_groups[0]["momentum"]
    )


def test_run_length_reads_max_steps_then_lightnings_estimate() -> None:
    from types import SimpleNamespace

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_swarm.strategy import _run_length

    class NoEstimate:
        max_steps = -1

        @property
        def estimated_stepping_batches(self) -> int:
            raise MisconfigurationException("no length")

    assert _run_length(SimpleNamespace(max_steps=300, estimated_stepping_batches=7)) == 300.0  # type: ignore[arg-type]
    assert _run_length(SimpleNamespace(max_steps=-1, estimated_stepping_batches=40)) == 40.0  # type: ignore[arg-type]
    assert _run_length(NoEstimate()) is None  # type: ignore[arg-type]


def test_a_flat_schedule_leaves_the_momentum_as_it_is() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    outer = OuterSync(
        {"w": param},
        outer_optimizer=NESTEROV,
        transport=AllReduceTransport(None, num_islands=1, bucket_numel=3),
        sync_every=2,
        momentum=MomentumSchedule(warmup=0.0, cooldown=0.0),
    )
    outer.set_run_length(8)
    outer.outer_optimizer.param_groups[0]["momentum"] = 0.3  # a caller's own setting
    outer.schedule_momentum(0)
    assert outer.outer_optimizer.param_groups[0]["momentum"] == 0.3
    ramped, _ = _outer(2)
    ramped.set_run_length(8)
    ramped.outer_optimizer.param_groups[0]["momentum"] = 0.3
    ramped.schedule_momentum(0)
    assert ramped.outer_optimizer.param_groups[0]["momentum"] == 0.0  # round 0 of a ramp
