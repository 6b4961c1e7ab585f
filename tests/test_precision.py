"""bfloat16 anchors: outer steps in float32, stochastic rounding, float32 optimizer state."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_swarm.algorithm import outer_step
from lightning_swarm.algorithm.diloco import keep_state_float32, stochastic_round_to_bf16

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def _run(
    dtype: torch.dtype, rounds: int, delta: float
) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    anchor = torch.ones(4096, dtype=dtype)
    opt = NESTEROV([anchor])
    for r in range(rounds):
        outer_step(opt, [anchor], [torch.full((4096,), delta)], seed=r)
    return anchor, opt


def test_small_updates_are_not_lost_on_bfloat16_anchors() -> None:
    # Per-round pseudo-gradient of 5e-4 on a weight of 1.0: below half a bfloat16 step, so a
    # round-to-nearest update would leave the anchor at exactly 1.0 forever.
    exact, _ = _run(torch.float32, rounds=20, delta=-5e-4)
    stored, opt = _run(torch.bfloat16, rounds=20, delta=-5e-4)
    assert exact.mean().item() > 1.04  # the float32 trajectory moved
    assert stored.dtype == torch.bfloat16
    # unbiased: the mean of the stored anchors follows float32 closely
    assert stored.float().mean().item() == pytest.approx(exact.mean().item(), abs=1e-3)
    # the outer optimizer's momentum stayed float32 and is keyed by the stored anchor
    assert opt.state[stored]["momentum_buffer"].dtype == torch.float32
    assert opt.param_groups[0]["params"][0] is stored


def test_float16_anchors_step_in_float32_and_round_to_nearest() -> None:
    # The float16 branch: each round steps a float32 copy with float32 momentum, then writes
    # the result back rounded to nearest. The reference does exactly that with a float32
    # parameter reset to the stored float16 value every round.
    stored, opt = _run(torch.float16, rounds=6, delta=-3e-3)
    reference = torch.nn.Parameter(torch.ones(4096))
    ref_opt = NESTEROV([reference])
    expected = torch.ones(4096, dtype=torch.float16)
    for _ in range(6):
        with torch.no_grad():
            reference.copy_(expected.float())
        reference.grad = torch.full((4096,), -3e-3)
        ref_opt.step()
        expected = reference.detach().to(torch.float16)
    assert stored.dtype == torch.float16
    assert torch.equal(stored, expected)
    assert not torch.equal(stored, torch.ones_like(stored))  # it moved
    momentum = opt.state[stored]["momentum_buffer"]
    assert momentum.dtype == torch.float32
    assert torch.equal(momentum, ref_opt.state[reference]["momentum_buffer"])


def test_stochastic_rounding_is_deterministic_per_seed_and_unbiased() -> None:
    x = torch.full((100_000,), 1.0 + 2**-10)  # a quarter of the way from 1.0 to the next bf16
    a = stochastic_round_to_bf16(x, torch.Generator().manual_seed(3))
    b = stochastic_round_to_bf16(x, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert set(a.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert a.float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    neg = stochastic_round_to_bf16(-x, torch.Generator().manual_seed(3))
    assert torch.equal(neg, -a)  # sign-symmetric
    exact = torch.tensor([1.5, -2.0, 0.0])  # representable values never move
    assert torch.equal(stochastic_round_to_bf16(exact, torch.Generator()).float(), exact)


def test_float32_state_survives_a_state_dict_round_trip() -> None:
    stored, opt = _run(torch.bfloat16, rounds=3, delta=-1e-3)
    saved = opt.state_dict()
    fresh_anchor = stored.clone()
    fresh = NESTEROV([fresh_anchor])
    fresh.load_state_dict(saved)
    # torch casts loaded state to the parameter dtype; the helper puts float32 back
    assert fresh.state[fresh_anchor]["momentum_buffer"].dtype == torch.bfloat16
    keep_state_float32(fresh, saved)
    assert torch.equal(
        fresh.state[fresh_anchor]["momentum_buffer"], opt.state[stored]["momentum_buffer"]
    )
    # both continue identically
    outer_step(opt, [stored], [torch.full((4096,), -1e-3)], seed=3)
    outer_step(fresh, [fresh_anchor], [torch.full((4096,), -1e-3)], seed=3)
    assert torch.equal(stored, fresh_anchor)


def test_float32_anchors_take_the_plain_path() -> None:
    anchor = torch.ones(4)
    opt = torch.optim.SGD([anchor], lr=1.0)
    outer_step(opt, [anchor], [torch.full((4,), 0.25)], seed=0)
    assert torch.equal(anchor, torch.full((4,), 0.75))
    assert anchor.grad is None
