"""What a strategy with pipeline stages adds to Lightning's training step: the runner built
from the island mesh, data-parallel averaging of a stage's plain gradients, clipping by the norm
over every stage, and the checks of the Trainer's options."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.pipeline.schedule import PipelineRunner
from lightning_swarm.transport.groups import PIPELINE_DIM, IslandMesh


def build_runner(mesh: IslandMesh, config: SwarmConfig, device: torch.device) -> PipelineRunner:
    """This rank's runner over its island's pipeline group."""
    stages = mesh.mesh[PIPELINE_DIM]
    group = stages.get_group()
    return PipelineRunner(
        stage_index=stages.get_local_rank(),
        num_stages=stages.size(),
        group=group,
        ranks=dist.get_process_group_ranks(group),
        microbatches=config.microbatches,
        schedule=config.pipeline_schedule,
        device=device,
    )


@torch.no_grad()
def average_plain_grads(module: torch.nn.Module, mesh: IslandMesh) -> None:
    """Average the gradients of the stage's plain (not FSDP-sharded) parameters over its
    data-parallel ranks: DDP inside a stage (one flat all-reduce)."""
    if mesh.data_parallel_size == 1:
        return
    grads = [
        p.grad
        for p in module.parameters()
        if p.grad is not None and not isinstance(p, DTensor) and not isinstance(p.grad, DTensor)
    ]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=mesh.mesh["data_parallel"].get_group())
    flat /= mesh.data_parallel_size
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(averaged)


def install_clipping(precision: Any, runner: PipelineRunner) -> None:
    """Make ``gradient_clip_val`` (by norm) clip by the norm over every stage: Lightning's
    precision plugin calls ``clip_grad_by_norm(optimizer, clip_val)``, which otherwise sees this
    stage's gradients only."""

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        runner.clip_grad_norm_(params, float(clip_val))

    precision.clip_grad_by_norm = partial(clip_grad_by_norm)


def check_trainer(trainer: pl.Trainer, config: SwarmConfig) -> None:
    """Refuse the Trainer options pipeline stages cannot honour."""
    pp = config.pipeline_parallel_size
    if trainer.accumulate_grad_batches > 1:
        raise SwarmConfigError(
            f"pipeline_parallel_size={pp} with accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}: the schedule already accumulates over "
            "pipeline_microbatches micro-batches per step; raise pipeline_microbatches (and the "
            "batch size) instead, and set accumulate_grad_batches=1."
        )
    if str(trainer.precision).startswith("16"):
        raise SwarmConfigError(
            f"pipeline_parallel_size={pp} with precision={trainer.precision!r}: the schedule's "
            "backward does not go through fp16's loss scaler; use 'bf16-mixed' or '32-true'."
        )


def plain_step(module: torch.nn.Module, inputs: Tensor, target: Tensor, loss_fn: Any) -> Tensor:
    """Without stages, ``pipeline_step`` is the plain forward and loss (Lightning's backward
    follows), so a module written for stages runs unchanged with ``pipeline_parallel_size=1``."""
    return loss_fn(module(inputs), target)
