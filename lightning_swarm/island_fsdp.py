"""Model-sharded islands (``island_parallel="fsdp"``): Lightning's ``configure_model`` convention
inside each island (glue). Each island's mesh never spans islands; every island starts from island
0's shards, so no rank gathers the full model, and spawned launchers send back no weights.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor
from torch.nn import Module

from lightning_swarm.errors import SwarmConfigError, SwarmConfigTypeError
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.groups import IslandMesh

_CONFIGURE_MODEL_HINT = """\
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        dp = self.device_mesh["data_parallel"]
        for layer in self.layers:        # e.g. each transformer block
            fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)  # then the root"""


def sampler_kwargs(topology: IslandTopology, mesh: IslandMesh) -> dict[str, int]:
    """``DistributedSampler`` arguments: one replica per (island, data-parallel rank).

    Positions are row-major over ``(dp, tp)``, so ``global_rank // tp`` is
    ``island x dp + dp_rank``, and the tensor-parallel ranks of one group share a batch.
    """
    tp = mesh.tensor_parallel_size
    return {"num_replicas": topology.world_size // tp, "rank": topology.global_rank // tp}


def check_sharded(module: Module, mesh: IslandMesh) -> None:
    """Refuse a module that ``configure_model`` did not shard over the island's mesh.

    Raises:
        TypeError: the LightningModule does not override ``configure_model``.
        ValueError: a parameter that requires grad is still a plain tensor while the island
            has several data-parallel ranks: nothing would average its gradient inside the
            island. A parameter frozen at setup is let through: it must stay frozen.
    """
    if not is_overridden("configure_model", module):
        raise SwarmConfigTypeError(
            "island_parallel='fsdp' requires the LightningModule to override "
            "configure_model() and shard itself there, as with Lightning's "
            "ModelParallelStrategy. Add, for example:\n" + _CONFIGURE_MODEL_HINT
        )
    if mesh.data_parallel_size == 1:
        return
    plain = [
        n for n, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
    ]
    if plain:
        raise SwarmConfigError(
            f"island_parallel='fsdp': configure_model left {len(plain)} parameter(s) "
            f"unsharded, e.g. {plain[:3]}; with data_parallel size "
            f"{mesh.data_parallel_size} their gradients would never be averaged "
            "inside the island. Call fully_shard(..., mesh=self.device_mesh"
            '["data_parallel"]) on the modules holding them (the root last).'
        )


@torch.no_grad()
def align_islands(module: Module, peers: dist.ProcessGroup | None) -> None:
    """Give every island island 0's shards, and every rank global rank 0's plain tensors.

    Collective on every rank, in ``named_parameters`` then ``named_buffers`` order. A shard
    goes over the peer group (same coordinate, so same shape, in every island): each rank
    moves only its own shard, and all of them skip an empty one.
    """
    tensors = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
    for tensor in tensors:
        if not isinstance(tensor, DTensor):
            local, group = tensor.detach(), None
        elif peers is not None:
            local, group = tensor.to_local(), peers
        else:
            continue  # a single island: nothing to align a shard with
        if local.numel() > 0:
            dist.broadcast(local, group=group, group_src=0)


class ShardedResultsLauncher(_MultiProcessingLauncher):
    """Lightning's fork / spawn launcher, minus the weights rank 0 would send back.

    Rank 0 holds one shard of each parameter: loading that into the main process's unsharded
    module would fail or corrupt it, so the main process keeps its weights from before ``fit``
    and gets every other result as usual.
    """

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or output.weights_path is None:
            return output
        os.remove(output.weights_path)
        os.rmdir(os.path.dirname(output.weights_path))
        rank_zero_warn(
            "island_parallel='fsdp' with a fork/spawn launcher: the main process keeps the "
            "module's weights from before fit (each rank holds only shards); read the trained "
            "weights from a checkpoint, or launch with start_method='popen'."
        )
        return output._replace(weights_path=None)
