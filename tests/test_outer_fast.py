"""The functional outer steps and the one-pass pseudo-gradient against torch.optim and the old path.

Bitwise: the functional steps repeat torch's single-tensor operations in order on slices, and
element-wise kernels give the same bits on a slice as on the whole tensor, so every comparison
here is exact (``torch.equal``), not a tolerance.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_swarm.algorithm import pseudo_gradient
from lightning_swarm.algorithm.diloco import max_abs, pseudo_gradient_into, sum_of_squares
from lightning_swarm.algorithm.outer_optimizer import (
    adam_step_,
    ensure_state,
    fast_outer_kind,
    groups_by_param,
    sgd_step_,
)

SHAPES = [(7, 13), (1000,), (3, 5, 11), (1,)]


def _tensors(seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _fast_step(opt: torch.optim.Optimizer, anchors: list[Tensor], grads: list[Tensor]) -> None:
    """One round of the functional step, each tensor cut into two slices at an odd offset."""
    kind = fast_outer_kind(opt)
    assert kind is not None
    groups = groups_by_param(opt)
    for anchor, grad in zip(anchors, grads, strict=True):
        group = groups[id(anchor)]
        fresh = ensure_state(opt, anchor, kind, group, lambda a: torch.empty_like(a))
        state = opt.state.get(anchor, {})
        if kind == "adam":
            state["step"] += 1
        cut = anchor.numel() // 3
        for lo, hi in ((0, cut), (cut, anchor.numel())):
            a, g = anchor.view(-1)[lo:hi], grad.reshape(-1)[lo:hi].clone()  # grad is scratch
            if kind == "sgd":
                buf = state.get("momentum_buffer")
                sgd_step_(a, g, None if buf is None else buf.view(-1)[lo:hi], group, fresh=fresh)
            else:
                m, v = state["exp_avg"].view(-1)[lo:hi], state["exp_avg_sq"].view(-1)[lo:hi]
                adam_step_(a, g, m, v, group, step=float(state["step"].item()))


OPTIMIZERS: dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]] = {
    "sgd-nesterov": functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
    "sgd-wd-dampening": functools.partial(
        torch.optim.SGD, lr=0.3, momentum=0.8, dampening=0.25, weight_decay=0.01
    ),
    "sgd-plain-maximize": functools.partial(torch.optim.SGD, lr=0.5, maximize=True),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "adam-l2": functools.partial(torch.optim.Adam, lr=3e-3, weight_decay=0.05),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fast_step_matches_torch_optim_bitwise(name: str) -> None:
    factory = OPTIMIZERS[name]
    reference = [t.clone() for t in _tensors(0)]
    fast = [t.clone() for t in _tensors(0)]
    ref_opt, fast_opt = factory(reference), factory(fast)
    for step in range(5):
        grads = _tensors(100 + step)
        for p, g in zip(reference, grads, strict=True):
            p.grad = g.clone()
        ref_opt.step()
        _fast_step(fast_opt, fast, grads)
        for r, f in zip(reference, fast, strict=True):
            assert torch.equal(r, f), f"{name}: anchors differ after step {step}"
    # The state is torch's own: the slow path can load what the fast path wrote.
    ref_state, fast_state = ref_opt.state_dict()["state"], fast_opt.state_dict()["state"]
    assert ref_state.keys() == fast_state.keys()
    for index, values in ref_state.items():
        for key, value in values.items():
            assert torch.equal(value, fast_state[index][key]), (name, index, key)


def test_fast_state_loads_into_torch_and_continues_bitwise() -> None:
    factory = OPTIMIZERS["adamw"]
    fast = [t.clone() for t in _tensors(0)]
    fast_opt = factory(fast)
    for step in range(2):
        _fast_step(fast_opt, fast, _tensors(10 + step))
    slow = [t.clone() for t in fast]
    slow_opt = factory(slow)
    slow_opt.load_state_dict(copy.deepcopy(fast_opt.state_dict()))
    grads = _tensors(99)
    for p, g in zip(slow, grads, strict=True):
        p.grad = g
    slow_opt.step()
    _fast_step(fast_opt, fast, grads)
    assert all(torch.equal(a, b) for a, b in zip(slow, fast, strict=True))


@pytest.mark.parametrize(
    "factory",
    [
        functools.partial(torch.optim.RMSprop, lr=0.1),
        functools.partial(torch.optim.AdamW, lr=0.1, amsgrad=True),
        functools.partial(torch.optim.SGD, lr=torch.tensor(0.1)),
        functools.partial(torch.optim.Adam, lr=0.1, differentiable=True),
    ],
)
def test_other_optimizers_take_the_slow_path(factory: Callable[..., Any]) -> None:
    assert fast_outer_kind(factory([torch.zeros(3, requires_grad=True)])) is None


def test_subclass_takes_the_slow_path() -> None:
    class MySGD(torch.optim.SGD):
        pass

    assert fast_outer_kind(MySGD([torch.zeros(3)], lr=0.1)) is None
    assert fast_outer_kind(torch.optim.SGD([torch.zeros(3)], lr=0.1)) == "sgd"


@pytest.mark.parametrize("anchor_dtype", [torch.float32, torch.bfloat16])
def test_pseudo_gradient_into_matches_the_old_pseudo_gradient(anchor_dtype: torch.dtype) -> None:
    anchor = torch.randn(37, 5).to(anchor_dtype)
    local = torch.randn(37, 5)
    out = torch.full((37 * 5 + 3,), 7.0)  # a reused bucket, larger than this tensor
    pseudo_gradient_into(anchor, local, out[2 : 2 + anchor.numel()])
    expected = pseudo_gradient(anchor, local).view(-1)
    assert torch.equal(out[2 : 2 + anchor.numel()], expected)
    assert out[0] == 7.0 and out[-1] == 7.0
    sumsq = sum_of_squares(out[2 : 2 + anchor.numel()])
    assert sumsq.dtype == torch.float32
    assert torch.allclose(sumsq.double(), expected.double().pow(2).sum(), rtol=1e-5)


def test_pseudo_gradient_into_refuses_bad_buffers() -> None:
    with pytest.raises(ValueError, match="same number of elements"):
        pseudo_gradient_into(torch.zeros(3), torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="writes float32"):
        pseudo_gradient_into(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_shows_in_the_norms(bad: float) -> None:
    t = torch.ones(100)
    t[57] = bad
    assert not torch.isfinite(sum_of_squares(t))
    assert not torch.isfinite(max_abs([torch.ones(3), t]))
    assert torch.isfinite(max_abs([torch.ones(3), torch.full((4,), 3e38)]))
