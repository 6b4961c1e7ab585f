"""The GPU check of model-sharded islands: ``pytest tests/test_fsdp_gpu.py`` on a CUDA machine.

One rank over NCCL: an FSDP island of one GPU, parameters sharded on the GPU, anchors and outer
state on the CPU, the outer round staged through the GPU (``outer/staging.py``). Skipped without
CUDA; the multi-rank paths run over gloo on the CPU in ``test_fsdp_islands.py``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_swarm import SwarmStrategy
from tests.fsdp_utils import ShardedRegressor
from tests.helpers import QUIET, regression_data


class _CheckDevices(pl.Callback):
    """During fit (Lightning's teardown moves the module back to the CPU afterwards)."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        for name, p in pl_module.named_parameters():
            assert isinstance(p, DTensor) and p.device.type == "cuda", name
        for name, anchor in strategy.outer_syncs[0].anchors.items():
            assert anchor.device.type == "cpu", name
        self.checked += 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_fsdp_island_keeps_anchors_on_the_cpu() -> None:
    check = _CheckDevices()
    strategy = SwarmStrategy(island_parallel="fsdp", sync_every=2, start_method="popen")
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, max_steps=4, callbacks=[check], **QUIET
    )
    try:
        trainer.fit(ShardedRegressor(), regression_data())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert check.checked == 4
    assert strategy.outer_syncs[0].outer_steps == 2
