"""The warm start (``warm_start_steps``): synchronous steps before the islands go local.

Post-local SGD (Lin et al., 2020) and the DiLoCo paper both begin the local phase from a model
trained synchronously for a while. For the first ``steps`` optimizer steps the strategy wraps
each inner step's closure: after the backward (and the island's own DDP reduction) every
gradient is averaged with the same parameter's gradient on this rank's counterparts in the
other islands (the peer group), before gradient clipping and the inner step, so the step is a
DDP step over all ranks. No outer round runs then, and the outer loop does not count those
steps. After the last warm step the anchors take the weights, equal on every island, and the
first round comes ``sync_every`` steps later.

Whether a step is warm depends only on Lightning's ``global_step`` (restored by a resume), so
a run saved inside the warm start resumes into the same steps. A parameter without a gradient
on this rank contributes zeros, so every rank runs the same collectives; it leaves with the
average as its gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.profiler import record_function

import lightning_swarm.profiling as labels


class WarmStart:
    """Gradient averaging across islands for the first ``steps`` optimizer steps.

    Args:
        steps: warm optimizer steps (Lightning's ``global_step`` below it is warm).
        peers: this rank's group with its counterparts in the other islands; ``None`` with
            one island (nothing to average).
        num_islands: ranks in ``peers``.
        bucket_numel: most gradient elements in one all-reduce.
    """

    def __init__(
        self, steps: int, peers: dist.ProcessGroup | None, num_islands: int, bucket_numel: int
    ) -> None:
        self.steps = steps
        self.peers = peers
        self.num_islands = num_islands
        self.bucket_numel = max(1, bucket_numel)

    def covers(self, global_step: int) -> bool:
        """Whether the optimizer step taken at ``global_step`` (0-based) is warm."""
        return global_step < self.steps

    def averaging(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """``closure`` followed by the cross-island average of ``optimizer``'s gradients."""

        def averaged() -> Any:
            output = closure()
            self.average(optimizer)
            return output

        return averaged

    @torch.no_grad()
    def average(self, optimizer: Optimizer) -> None:
        """Average the gradients of ``optimizer``'s trained parameters across the islands
        (collective over the peer group, in parameter order, bucketed by dtype and device)."""
        if self.peers is None or self.num_islands == 1:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        with record_function(labels.WARM_START):
            for kind in sorted(by_kind, key=str):
                for bucket in _buckets(by_kind[kind], self.bucket_numel):
                    self._average_bucket(bucket)

    def _average_bucket(self, bucket: list[Tensor]) -> None:
        grads = [p.grad for p in bucket]
        assert all(g is not None for g in grads)
        flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
        dist.all_reduce(flat, group=self.peers)
        flat.div_(self.num_islands)
        at = 0
        for g in grads:
            assert g is not None
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()


def _buckets(params: list[Tensor], bucket_numel: int) -> list[list[Tensor]]:
    """``params`` in order, cut into runs of at most ``bucket_numel`` elements (a larger
    tensor travels alone)."""
    out: list[list[Tensor]] = [[]]
    size = 0
    for p in params:
        if out[-1] and size + p.numel() > bucket_numel:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return [b for b in out if b]
