"""The DiLoCo math against hand-computed values."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_swarm.algorithm import global_norm, merge_into_local, outer_step, pseudo_gradient


def test_pseudo_gradient_is_anchor_minus_local_in_float32() -> None:
    anchor = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    local = torch.tensor([0.5, 3.0])
    delta = pseudo_gradient(anchor, local)
    assert delta.dtype == torch.float32
    assert torch.equal(delta, torch.tensor([0.5, -1.0]))
    assert torch.equal(anchor, torch.tensor([1.0, 2.0], dtype=torch.bfloat16))  # untouched


def test_pseudo_gradient_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="anchor shape"):
        pseudo_gradient(torch.zeros(2), torch.zeros(3))


def test_outer_sgd_lr1_lands_on_mean_of_locals() -> None:
    # Descending along the averaged pseudo-gradient with lr=1 must give the islands' mean.
    anchor = torch.tensor([1.0, -2.0])
    locals_ = [torch.tensor([0.2, -1.0]), torch.tensor([0.6, -4.0])]
    mean_delta = torch.stack([pseudo_gradient(anchor, x) for x in locals_]).mean(0)
    opt = torch.optim.SGD([anchor], lr=1.0, momentum=0.0)
    outer_step(opt, [anchor], [mean_delta])
    assert torch.allclose(anchor, torch.tensor([0.4, -2.5]))
    assert anchor.grad is None  # pseudo-gradient memory released after the step


def test_outer_nesterov_momentum_by_hand() -> None:
    anchor = torch.tensor([1.0])
    opt = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    # step 1: buf = 0.5; update = g + m * buf = 0.95; anchor = 1 - 0.7 * 0.95
    outer_step(opt, [anchor], [torch.tensor([0.5])])
    assert anchor.item() == pytest.approx(0.335)
    # step 2: buf = 0.9 * 0.5 + 0.2 = 0.65; update = 0.2 + 0.9 * 0.65 = 0.785
    outer_step(opt, [anchor], [torch.tensor([0.2])])
    assert anchor.item() == pytest.approx(0.335 - 0.7 * 0.785)


def test_outer_step_length_mismatch() -> None:
    a = torch.zeros(1)
    opt = torch.optim.SGD([a], lr=1.0)
    with pytest.raises(ValueError, match="1 anchors but 2"):
        outer_step(opt, [a], [torch.zeros(1), torch.zeros(1)])


def test_merge_into_local() -> None:
    anchor = torch.tensor([1.0, 1.0])
    local = torch.tensor([3.0, -1.0])
    merge_into_local(local, anchor, alpha=0.25)
    assert torch.allclose(local, torch.tensor([0.75 * 1 + 0.25 * 3, 0.75 * 1 - 0.25]))
    merge_into_local(local, anchor)
    assert torch.equal(local, anchor)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        merge_into_local(local, anchor, alpha=1.5)


def test_global_norm() -> None:
    assert global_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == pytest.approx(5.0)


def test_outer_optimizer_factory_partial_builds_over_anchors() -> None:
    factory = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    anchors = [torch.zeros(3), torch.zeros(2)]
    opt = factory(anchors)
    assert opt.param_groups[0]["params"][0] is anchors[0]
