"""Running one island's pipeline: this rank's stage under a ``torch.distributed.pipelining``
schedule, micro-batched, with the loss on the last stage.

``PipelineRunner.run`` is what ``SwarmStrategy.pipeline_step`` calls from the user's
``training_step`` (or ``validation_step``): the schedule owns forward and backward, micro-batch
by micro-batch and stage by stage, which Lightning's forward -> loss -> backward closure cannot
express. The loss comes back to every rank of the island (a broadcast over the pipeline group
from the last stage), so logging and Lightning's loss bookkeeping see one value. Gradients
after a training step equal the whole batch's (the schedule scales them by the micro-batch
count; ``loss_fn`` must average over its micro-batch, as a mean loss does).

Island-wide numbers cross the pipeline group: ``clip_grad_norm_`` takes the norm over every
stage (each stage's norm is already whole over its own FSDP / tensor-parallel mesh).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from lightning_swarm.errors import SwarmConfigError

SCHEDULES: dict[str, Any] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# An activation's header between stages in evaluation: ndim, dtype index, shape (<= 8 dims).
_HEADER = 10
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class PipelineRunner:
    """This rank's stage and its schedule (built at the first step, rebuilt if ``loss_fn``
    changes). ``group``: the island's pipeline group through this rank (one rank per stage);
    ``ranks``: its global ranks by stage. A training step leaves its gradients held here
    (``ran_backward``) for the strategy's ``backward`` to give back."""

    stage_index: int
    num_stages: int
    group: dist.ProcessGroup
    ranks: list[int]
    microbatches: int
    schedule: str
    device: torch.device
    _built: tuple[Any, LossFn, int] | None = field(default=None, repr=False)
    # The gradients a training step computed, held off the parameters until Lightning's
    # backward step: Lightning zeroes gradients between training_step and backward.
    _grads: list[tuple[Tensor, Tensor]] | None = field(default=None, repr=False)

    @property
    def ran_backward(self) -> bool:
        return self._grads is not None

    def hold_grads(self, module: torch.nn.Module) -> None:
        """Take the gradients off ``module``'s parameters until ``give_back_grads``."""
        self._grads = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        for p, _ in self._grads:
            p.grad = None

    def give_back_grads(self) -> None:
        """Put the held gradients back (after Lightning's zero_grad, in its backward step)."""
        for p, grad in self._grads or []:
            p.grad = grad if p.grad is None else p.grad + grad
        self._grads = None

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _schedule(self, module: torch.nn.Module, loss_fn: LossFn, batch: int) -> Any:
        # A stage infers its micro-batch shapes at its first step and keeps them: another
        # batch size (an epoch's last, short batch) needs a new stage.
        if self._built is None or self._built[1:] != (loss_fn, batch):
            stage = PipelineStage(
                module, self.stage_index, self.num_stages, self.device, group=self.group
            )
            kind = SCHEDULES[self.schedule]
            self._built = (kind(stage, self.microbatches, loss_fn=loss_fn), loss_fn, batch)
        return self._built[0]

    def run(
        self,
        module: torch.nn.Module,
        inputs: Tensor,
        target: Tensor,
        loss_fn: LossFn,
        *,
        train: bool,
    ) -> Tensor:
        """One batch through the island's pipeline; returns the batch's loss on every rank,
        as a detached 0-d tensor. Training: forward and backward of every micro-batch under
        the schedule (the loss is the mean over micro-batches). Evaluation: the whole batch
        forward, stage to stage, whatever its size.

        Raises:
            SwarmConfigError: a training batch cannot be split into ``microbatches``.
        """
        if not train:
            return self._evaluate(module, inputs, target, loss_fn)
        if inputs.shape[0] < self.microbatches or inputs.shape[0] % self.microbatches:
            raise SwarmConfigError(
                f"pipeline_microbatches={self.microbatches} does not divide this batch of "
                f"{inputs.shape[0]} sample(s); use a batch size that is a multiple of it, or "
                "fewer micro-batches."
            )
        schedule = self._schedule(module, loss_fn, int(inputs.shape[0]))
        losses: list[Tensor] = []
        args = (inputs,) if self.first else ()
        extra: dict[str, Any] = {"target": target, "losses": losses} if self.last else {}
        # Lightning zeroes gradients only after training_step: the last step's are still on
        # the parameters, and the schedule would add to them.
        for p in module.parameters():
            p.grad = None
        schedule.step(*args, return_outputs=False, **extra)
        self.hold_grads(module)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.last:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        return self._from_last_stage(loss)

    def _from_last_stage(self, loss: Tensor) -> Tensor:
        dist.broadcast(loss, group=self.group, group_src=self.num_stages - 1)
        return loss

    @torch.no_grad()
    def _evaluate(
        self, module: torch.nn.Module, inputs: Tensor, target: Tensor, loss_fn: LossFn
    ) -> Tensor:
        """Forward only, the whole batch at once: each stage receives its input (with its
        shape and dtype, which a short batch or autocast may change), runs and sends on."""
        x = inputs
        if not self.first:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, group=self.group, group_src=self.stage_index - 1)
            ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
            x = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=self.device)
            dist.recv(x, group=self.group, group_src=self.stage_index - 1)
        out = module(x)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.last:
            loss = loss_fn(out, target).detach().float()
        else:
            out = out.contiguous()
            shape = [out.dim(), _DTYPES.index(out.dtype), *out.shape]
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[: len(shape)] = torch.tensor(shape)
            dist.send(header, group=self.group, group_dst=self.stage_index + 1)
            dist.send(out, group=self.group, group_dst=self.stage_index + 1)
        return self._from_last_stage(loss)

    def clip_grad_norm_(self, params: Iterable[Tensor], max_norm: float) -> Tensor:
        """Scale the gradients of ``params`` (this stage's) so that their norm over every
        stage is at most ``max_norm``; returns that norm."""
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(norm, DTensor):  # FSDP / tensor parallel: whole over the stage's mesh
            norm = norm.full_tensor()
        square = norm.to(device=self.device, dtype=torch.float32).square()
        dist.all_reduce(square, group=self.group)
        total = square.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def check_schedule(schedule: str, microbatches: int, num_stages: int) -> None:
    """Refuse a schedule this pipeline cannot run (``SwarmConfigError`` naming the fix)."""
    if schedule not in SCHEDULES:
        raise SwarmConfigError(
            f"pipeline_schedule={schedule!r} is not known; use one of {sorted(SCHEDULES)} "
            "(interleaved schedules, which need several stages per rank, are not built)."
        )
    if microbatches < 1:
        raise SwarmConfigError(
            f"pipeline_microbatches={microbatches} must be at least 1 (the batch is split "
            "into that many micro-batches)."
        )
    if schedule == "1f1b" and microbatches < num_stages:
        raise SwarmConfigError(
            f"pipeline_schedule='1f1b' needs at least as many micro-batches as stages: "
            f"pipeline_microbatches={microbatches} < pipeline_parallel_size={num_stages}. "
            "Raise pipeline_microbatches, or use pipeline_schedule='gpipe'."
        )
