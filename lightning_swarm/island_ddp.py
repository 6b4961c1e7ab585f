"""``IslandDDPStrategy``: Lightning's DDP, or FSDP, confined to each island (Lightning glue).

It creates the island and peer groups, starts every rank from rank 0's weights and wraps the
module over its island. With ``island_parallel="fsdp"`` the module's ``configure_model`` shards it
over the island's own mesh (Lightning's convention); every island starts from island 0's shards,
and spawned launchers send back no weights. Groups are created in ``setup_distributed`` and
destroyed at the very end of ``teardown``, after the DDP reducer and the peer group's users.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
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
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import (
    CollectiveTimeoutError,
    PeerLostError,
    SwarmConfigError,
    SwarmConfigTypeError,
    SwarmError,
)
from lightning_swarm.pipeline.glue import (
    average_plain_grads,
    build_runner,
    install_clipping,
    plain_step,
)
from lightning_swarm.pipeline.schedule import PipelineRunner
from lightning_swarm.resume.compatibility import MESH_KEY
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport import peer_backend
from lightning_swarm.transport.groups import (
    MESH_DIM_NAMES,
    PIPELINE_DIM,
    IslandMesh,
    SwarmGroups,
    build_groups,
    build_island_mesh,
)
from lightning_swarm.transport.link import first_line, is_peer_loss, is_timeout, peer_lost_message


class IslandDDPStrategy(DDPStrategy):
    """DDP (or FSDP) inside islands of ``config.island_size`` ranks, no averaging across them.

    Raises ``ValueError`` for ``process_group`` or a keyword in ``**kwargs`` that neither
    ``DDPStrategy`` nor ``DistributedDataParallel`` accepts.
    """

    def __init__(self, config: SwarmConfig, **kwargs: Any) -> None:
        if "process_group" in kwargs:
            raise SwarmConfigError(
                "process_group cannot be passed to SwarmStrategy: DDP runs over each island's "
                "own group, which the strategy creates; set island_size instead."
            )
        super().__init__(timeout=datetime.timedelta(seconds=config.group_timeout_s), **kwargs)
        _check_ddp_kwargs(self._ddp_kwargs)
        self.config = config
        self._island_size = config.island_size  # an elastic island sets its own at setup
        self._topology: IslandTopology | None = None
        self._groups: SwarmGroups | None = None
        self._mesh: IslandMesh | None = None  # model-sharded islands, from setup to teardown
        self._pipeline: PipelineRunner | None = None  # pipeline stages, from configure_ddp

    @property
    def topology(self) -> IslandTopology:
        if self._topology is None:
            raise RuntimeError("the island topology exists only after the strategy's setup")
        return self._topology

    @property
    def groups(self) -> SwarmGroups:
        if self._groups is None:
            raise RuntimeError("the process groups exist only after the strategy's setup")
        return self._groups

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        topology = IslandTopology(
            world_size=self.world_size, island_size=self._island_size, global_rank=self.global_rank
        )
        self._topology = topology
        sharded = self.config.model_sharded
        peers_backend = peer_backend(self.config.transport, dist.get_backend())
        self._groups = build_groups(
            topology,
            backend=self._process_group_backend,
            # new_group does not inherit the world's timeout: every group gets the same one.
            timeout=self._timeout,
            # A delayed exchange's worker thread must not share the default group.
            dedicated_peers=self.config.sync_delay > 0,
            # The swarm transport's CPU traffic needs a gloo peer group beside NCCL's.
            peer_backend=peers_backend,
            # Model-sharded, the island group carries the outer round's agreement only (FSDP
            # has its own groups), on the peer group's backend.
            island_backend=peers_backend if sharded else None,
        )
        if sharded:
            self._mesh = build_island_mesh(
                topology,
                self.config.tensor_parallel_size,
                device_type=self.root_device.type,
                backend=self._process_group_backend,
                pipeline_parallel_size=self.config.pipeline_parallel_size,
            )

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.config.model_sharded and self._start_method != "popen":
            self._launcher = _ShardedResultsLauncher(self, start_method=self._start_method)

    @property
    def island_mesh_shape(self) -> dict[str, int] | None:
        """``{"data_parallel": dp, "tensor_parallel": tp}`` (and ``"pipeline_parallel"``) of a
        model-sharded island; None under DDP islands (and before setup)."""
        return self._mesh.shape if self._mesh is not None else None

    @property
    def device_mesh(self) -> DeviceMesh:
        """This island's ``([pipeline_parallel,] data_parallel, tensor_parallel)`` mesh
        (``island_parallel="fsdp"`` or pipeline stages)."""
        if self._mesh is None:
            raise RuntimeError(
                "a device mesh exists only with island_parallel='fsdp' or pipeline stages, "
                "after setup"
            )
        return self._mesh.mesh

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._mesh is not None:
            # Read by the module's configure_model, which Lightning calls right after this.
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self._mesh.mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._mesh is None:
            return super().distributed_sampler_kwargs
        # One replica per (island, data-parallel rank): the stages and tensor-parallel ranks of
        # one data-parallel position share a batch (the first stage reads its inputs, the last
        # its targets).
        mesh, topology = self._mesh, self.topology
        dp = mesh.data_parallel_size
        _, position, _ = mesh.coordinates(topology.local_index)
        rank = topology.island_index * dp + position
        return {"num_replicas": topology.num_islands * dp, "rank": rank}

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not self.config.model_sharded:
            with super().tensor_init_context(empty_init):
                yield
            return
        # As Lightning's ModelParallelStrategy: ``empty_init`` builds the module on the meta
        # device, and ``model_to_device`` materialises it after configure_model sharded it,
        # so no rank ever allocates the whole model.
        with (
            torch.device("meta") if empty_init else nullcontext(),
            self.precision_plugin.tensor_init_context(),
        ):
            yield

    @override
    def model_to_device(self) -> None:
        if self._mesh is not None:
            assert self.model is not None
            _materialize_distributed_module(self.model, self.root_device)
        super().model_to_device()

    # -- model-sharded checkpoints: the module and inner optimizers live in per-rank swarm files
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Rank 0's shards alone would be neither the model nor loadable into other ranks.
        return {} if self.config.model_sharded else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {} if self.config.model_sharded else super().optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        swarm = checkpoint.get("swarm")
        if self._mesh is None and not _per_rank_save(checkpoint):
            super().load_model_state_dict(checkpoint, strict=strict)
        elif swarm is None and checkpoint.get("state_dict"):
            # A plain Lightning checkpoint holds the full weights on every rank: each keeps its
            # shards (collective over the mesh). A swarm checkpoint's shards are installed by
            # the swarm restore instead. set_model_state_dict replaces the dict's values as it
            # distributes them: hand it a copy.
            assert self.lightning_module is not None
            options = StateDictOptions(full_state_dict=True, strict=strict)
            set_model_state_dict(
                self.lightning_module, dict(checkpoint["state_dict"]), options=options
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.config.model_sharded and not _per_rank_save(checkpoint):
            super().load_optimizer_state_dict(checkpoint)
        elif "swarm" not in checkpoint and self.is_global_zero:
            rank_zero_warn(
                "island_parallel='fsdp': a plain Lightning checkpoint's inner optimizer state is "
                "not restored (it is one rank's, unsharded); the inner optimizers start fresh."
            )

    @override
    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]
        """Wrap in DDP over the island's group; an island of one rank needs no wrapper, and
        a model-sharded island is already sharded by ``configure_model``."""
        if self.topology.island_size == 1 or self._mesh is not None:
            return model
        return DistributedDataParallel(
            module=model,
            device_ids=self.determine_ddp_device_ids(),
            process_group=self.groups.island,
            **self._ddp_kwargs,
        )

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        if self._mesh is not None:
            assert self.lightning_module is not None
            _check_sharded(self.lightning_module, self._mesh)
            # Anchors must start identical in every island: island 0's shards everywhere.
            _align_islands(self.model, self.groups.peers, self._mesh)
            if self._mesh.pipeline_parallel_size > 1:
                self._pipeline = build_runner(self._mesh, self.config, self.root_device)
                install_clipping(self.precision_plugin, self._pipeline)
            return
        # Anchors must start identical on every rank: take global rank 0's weights everywhere,
        # before DDP (which would only sync inside the island) wraps the module.
        _sync_module_states(self.model)
        super().configure_ddp()

    @property
    def pipeline_stage(self) -> int | None:
        """This rank's pipeline stage (0-based), or None without stages."""
        return None if self._pipeline is None else self._pipeline.stage_index

    def pipeline_step(
        self, inputs: Tensor, target: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        """The batch's loss through this island's pipeline; call it from ``training_step`` and
        ``validation_step`` in place of ``loss_fn(self(inputs), target)``.

        With ``pipeline_parallel_size > 1`` the schedule runs every micro-batch's forward (the
        module's ``forward`` on this rank's stage) and, in training, backward: the returned
        loss (the last stage's, the same value on every rank of the island) is detached, and
        Lightning's backward step does nothing. Without stages it is the plain forward and
        loss, with Lightning's backward as usual.

        Args:
            inputs: the first stage's input (every rank passes its batch's; only the first
                stage reads it).
            target: what ``loss_fn`` compares the last stage's output with.
            loss_fn: ``(output, target) -> loss``, a mean over the micro-batch.
        """
        module = self.lightning_module
        assert module is not None
        runner = self._pipeline
        if runner is None:
            return plain_step(module, inputs, target, loss_fn)
        train = module.training and torch.is_grad_enabled()
        return runner.run(module, inputs, target, loss_fn, train=train)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        runner = self._pipeline
        if runner is None or not runner.ran_backward:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule ran backward inside pipeline_step; Lightning zeroed the gradients since
        # (it does between training_step and backward): they come back now, with the hooks.
        module = self.lightning_module
        assert module is not None and self._mesh is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        runner.give_back_grads()
        average_plain_grads(module, self._mesh)
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``reduce``; with no group given, during training, over the island only
        (``SwarmGroups.between_rounds``): a ``self.log(..., sync_dist=True)`` in
        ``training_step`` over the world would cross islands at every inner step. Its value is
        then the island's mean. Every other stage keeps the world."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        training = trainer is not None and trainer.training
        if group is None and training and self._topology and self._topology.num_islands > 1:
            if self.groups.between_rounds is None:
                return tensor  # an island of one rank: nothing to reduce with
            group = self.groups.between_rounds
        return super().reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Checkpoint and stopping decisions are the whole swarm's, in training too: the world.
        flag = torch.tensor(int(decision), device=self.root_device)
        total = super().reduce(flag, group=dist.group.WORLD, reduce_op="sum")
        return bool(total == self.world_size) if all else bool(total)

    @override
    def _register_ddp_hooks(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            super()._register_ddp_hooks()

    @override
    def teardown(self) -> None:
        # Lightning's teardown still talks to the DDP wrapper (its logging data lives in the
        # reducer, bound to the island group): unwrap first, destroy the groups last. The other
        # way round, a rank can block forever inside the wrapper of a destroyed group.
        super().teardown()
        self._pipeline = None
        if self._mesh is not None:
            self._mesh.destroy()
            self._mesh = None
        if self._groups is not None:
            self._groups.destroy()
            self._groups = None


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Reject keywords that neither DDPStrategy nor DistributedDataParallel accepts: the DDP
    wrapper is built only after launch (never for islands of one rank), so a typo would
    surface late or not at all."""
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters)
    accepted -= {"self", "module", "device_ids", "process_group"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise SwarmConfigError(
            f"SwarmStrategy got unknown option(s) {unknown}; use SwarmStrategy's own options, "
            "DDPStrategy's, or DistributedDataParallel keywords such as find_unused_parameters."
        )


_CONFIGURE_MODEL_HINT = """\
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        dp = self.device_mesh["data_parallel"]
        for layer in self.layers:        # e.g. each transformer block
            fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)  # then the root"""


def _check_sharded(module: Module, mesh: IslandMesh) -> None:
    """Refuse a module that ``configure_model`` did not shard: ``TypeError`` without one,
    ``ValueError`` for a trainable plain parameter with several data-parallel ranks (nothing
    would average its gradient inside the island; a frozen one must stay frozen)."""
    if not is_overridden("configure_model", module):
        raise SwarmConfigTypeError(
            "island_parallel='fsdp' requires the LightningModule to override "
            "configure_model() and shard itself there, as with Lightning's "
            "ModelParallelStrategy. Add, for example:\n" + _CONFIGURE_MODEL_HINT
        )
    if mesh.pipeline_parallel_size > 1:
        _check_stages(module, mesh)
        return  # a plain parameter of a stage is averaged over its data-parallel ranks
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


def _check_stages(module: Module, mesh: IslandMesh) -> None:
    """Refuse (on every rank) a module whose ``configure_model`` did not keep one stage per
    rank: a trained parameter held by two stages of the island, or a stage with none."""
    group = mesh.mesh[PIPELINE_DIM].get_group()
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    stages: list[set[str] | None] = [None] * mesh.pipeline_parallel_size
    dist.all_gather_object(stages, names, group=group)
    for a in range(len(stages)):
        for b in range(a + 1, len(stages)):
            shared = sorted((stages[a] or set()) & (stages[b] or set()))
            if shared:
                raise SwarmConfigError(
                    f"pipeline_parallel_size={len(stages)}: stages {a} and {b} both hold "
                    f"{len(shared)} trained parameter(s), e.g. {shared[:3]}: configure_model "
                    "ignored the mesh's pipeline_parallel dimension. Keep each rank's stage "
                    "only, e.g. lightning_swarm.keep_stage(self, self.device_mesh, "
                    'blocks="blocks", first=["embedding"], last=["head"]).'
                )
    empty = [i for i, s in enumerate(stages) if not s]
    if empty:
        raise SwarmConfigError(
            f"pipeline_parallel_size={len(stages)}: stage(s) {empty} hold no trained "
            "parameter; use fewer stages than the model has blocks."
        )


@torch.no_grad()
def _align_islands(module: Module, peers: dist.ProcessGroup | None, mesh: IslandMesh) -> None:
    """Give every island island 0's shards, and every rank global rank 0's plain tensors
    (collective). A shard goes over the peer group (the same shape in every island), so each
    rank moves only its own shard, and all of them skip an empty one. With pipeline stages a
    plain tensor belongs to one stage: island 0's goes over the peer group, then along the
    stage's data-parallel and tensor-parallel lines from their first rank."""
    tensors = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
    staged = mesh.pipeline_parallel_size > 1
    lines = [mesh.mesh[d].get_group() for d in MESH_DIM_NAMES] if staged else []
    for tensor in tensors:
        if not isinstance(tensor, DTensor) and staged:
            local = tensor.detach()
            for line in ([peers] if peers is not None else []) + lines:
                dist.broadcast(local, group=line, group_src=0)
            continue
        if not isinstance(tensor, DTensor):
            local, group = tensor.detach(), None
        elif peers is not None:
            local, group = tensor.to_local(), peers
        else:
            continue  # a single island: nothing to align a shard with
        if local.numel() > 0:
            dist.broadcast(local, group=group, group_src=0)


class _ShardedResultsLauncher(_MultiProcessingLauncher):
    """Lightning's fork / spawn launcher, minus the weights rank 0 would send back: its shards
    would fail or corrupt the main process's unsharded module, which keeps its weights."""

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


@contextlib.contextmanager
def timeouts_explained(timeout_s: float, rank: int, static: bool = True) -> Iterator[None]:
    """Turn a collective's timeout (torch's message names no option) into one that does, and
    a peer's closed connection into ``PeerLostError``: for the collectives of a static run that
    the outer round's transport does not explain itself (DDP's, Lightning's, a checkpoint's).
    Elastic islands (``static=False``) report their own errors.
    """
    try:
        yield
    except RuntimeError as err:
        if not static or isinstance(err, SwarmError):
            raise
        if is_peer_loss(err):
            gone = "a rank of this run (the one whose address torch names)"
            raise PeerLostError(peer_lost_message(f"rank {rank}", gone, err)) from err
        if not is_timeout(err):
            raise
        raise CollectiveTimeoutError(
            f"rank {rank}: a collective waited timeout_s={timeout_s:g} s for another rank and "
            f"gave up ({first_line(err)}). A rank stopped, hung or died; every waiting rank "
            "stops here instead of blocking. Look for the rank whose log ends earliest; if a "
            "step or a checkpoint legitimately takes longer, raise timeout_s."
        ) from err


def _per_rank_save(checkpoint: Mapping[str, Any]) -> bool:
    """Whether model-sharded islands wrote ``checkpoint``: its module and inner optimizer
    states are in per-rank swarm files only (the swarm restore installs them, on any layout)."""
    swarm = checkpoint.get("swarm")
    fingerprint = swarm.get("fingerprint") if isinstance(swarm, Mapping) else None
    return isinstance(fingerprint, Mapping) and fingerprint.get(MESH_KEY) is not None
