"""Model-sharded islands: Lightning's ``configure_model`` convention inside each island (glue).

With ``island_parallel="fsdp"`` each island gets its own ``(data_parallel, tensor_parallel)`` mesh
as ``self.device_mesh``, as in ``ModelParallelStrategy``; the mesh never spans islands. Every
island starts from island 0's shards (``align_islands``), so no rank gathers the full model.
Spawned launchers send back no weights (``ShardedResultsLauncher``). Built in
``setup_distributed`` (collective), destroyed in ``teardown`` with the groups it created, never
the island's own group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn import Module

from lightning_swarm.errors import SwarmConfigError, SwarmConfigTypeError
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.groups import IslandMesh, build_island_mesh

_CONFIGURE_MODEL_HINT = """\
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        dp = self.device_mesh["data_parallel"]
        for layer in self.layers:        # e.g. each transformer block
            fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)  # then the root"""


class IslandFSDP:
    """One rank's model-sharded island: its mesh, data split and start-up alignment.

    Args:
        topology: where this rank sits among the islands.
        tensor_parallel_size: ranks of the mesh's ``tensor_parallel`` dimension.
        device_type: ``"cpu"`` or ``"cuda"`` (the mesh's device type).
        backend: backend of the mesh's groups (the world's when None).
    """

    def __init__(
        self,
        topology: IslandTopology,
        tensor_parallel_size: int,
        *,
        device_type: str,
        backend: str | None,
    ) -> None:
        self.topology = topology
        self._mesh: IslandMesh | None = build_island_mesh(
            topology, tensor_parallel_size, device_type=device_type, backend=backend
        )

    @property
    def mesh(self) -> IslandMesh:
        if self._mesh is None:
            raise RuntimeError("the island's device mesh was destroyed at teardown")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The island's ``(data_parallel, tensor_parallel)`` mesh (``module.device_mesh``)."""
        return self.mesh.mesh

    def sampler_kwargs(self) -> dict[str, int]:
        """``DistributedSampler`` arguments: one replica per (island, data-parallel rank).

        Positions are row-major over ``(dp, tp)``, so ``global_rank // tp`` is
        ``island x dp + dp_rank``, and the tensor-parallel ranks of one group share a batch.
        """
        tp = self.mesh.tensor_parallel_size
        return {
            "num_replicas": self.topology.world_size // tp,
            "rank": self.topology.global_rank // tp,
        }

    def check_module(self, module: Module) -> None:
        """Refuse a module that ``configure_model`` did not shard over the island's mesh.

        Raises:
            TypeError: the LightningModule does not override ``configure_model``.
            ValueError: a parameter that requires grad is still a plain tensor while the island
                has several data-parallel ranks: nothing would average its gradient inside the
                island, so the island's ranks would silently drift apart. A parameter frozen at
                setup is let through: it must stay frozen (or be sharded) to stay in step.
        """
        if not is_overridden("configure_model", module):
            raise SwarmConfigTypeError(
                "island_parallel='fsdp' requires the LightningModule to override "
                "configure_model() and shard itself there, as with Lightning's "
                "ModelParallelStrategy. Add, for example:\n" + _CONFIGURE_MODEL_HINT
            )
        if self.mesh.data_parallel_size == 1:
            return
        plain = [
            n
            for n, p in module.named_parameters()
            if p.requires_grad and not isinstance(p, DTensor)
        ]
        if plain:
            raise SwarmConfigError(
                f"island_parallel='fsdp': configure_model left {len(plain)} parameter(s) "
                f"unsharded, e.g. {plain[:3]}; with data_parallel size "
                f"{self.mesh.data_parallel_size} their gradients would never be averaged "
                "inside the island. Call fully_shard(..., mesh=self.device_mesh"
                '["data_parallel"]) on the modules holding them (the root last).'
            )

    @torch.no_grad()
    def align_islands(self, module: Module, peers: dist.ProcessGroup | None) -> None:
        """Give every island island 0's shards, and every rank global rank 0's plain tensors.

        Collective on every rank, in ``named_parameters`` then ``named_buffers`` order (the
        same everywhere). A shard goes over the peer group (same coordinate in every island),
        so each rank moves only its own shard.
        """
        tensors = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
        for tensor in tensors:
            if isinstance(tensor, DTensor):
                if peers is not None:
                    _broadcast(tensor.to_local(), group=peers)
            else:
                _broadcast(tensor.detach(), group=None)

    def load_full_state(self, module: Module, state: Mapping[str, Any], *, strict: bool) -> None:
        """Load an unsharded state dict (a plain Lightning checkpoint) into the sharded module.

        Every rank holds the whole dict (Lightning loaded the file on each) and keeps its own
        slice of each tensor; collective over the island's mesh.
        """
        options = StateDictOptions(full_state_dict=True, strict=strict)
        # set_model_state_dict replaces the dict's values as it distributes them: hand it a copy.
        set_model_state_dict(module, dict(state), options=options)

    def destroy(self) -> None:
        if self._mesh is not None:
            self._mesh.destroy()
            self._mesh = None


def _broadcast(tensor: Tensor, *, group: dist.ProcessGroup | None) -> None:
    """Broadcast in place from the group's first rank; empty shards move nothing.

    Ranks of a peer group hold shards of the same shape, so all of them skip an empty one.
    """
    if tensor.numel() == 0:
        return
    dist.broadcast(tensor, group=group, group_src=0)


class ShardedResultsLauncher(_MultiProcessingLauncher):
    """Lightning's fork / spawn launcher, minus the weights rank 0 would send back.

    Under model-sharded islands rank 0 holds one shard of each parameter: loading that into the
    main process's unsharded module would fail or corrupt it, so the main process keeps the
    module's weights from before ``fit`` and gets every other result (state, metrics, best
    checkpoint path) as usual.
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
