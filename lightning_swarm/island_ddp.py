"""``IslandDDPStrategy``: Lightning's DDP confined to each island (Lightning glue).

It splits the world into islands, creates the island and peer groups, starts every rank from
rank 0's weights and wraps the module in DDP over its island (or an ``IslandFSDP`` member does).
Groups are created in ``setup_distributed`` and destroyed at the very end of ``teardown``, after
the DDP reducer bound to them is gone and a subclass closed what used the peer group.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_swarm.errors import (
    CollectiveTimeoutError,
    PeerLostError,
    SwarmConfigError,
    SwarmError,
)
from lightning_swarm.island_fsdp import IslandFSDP, ShardedResultsLauncher
from lightning_swarm.resume.compatibility import check_layout
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.factory import peer_backend
from lightning_swarm.transport.groups import SwarmGroups, build_groups
from lightning_swarm.transport.link import is_peer_loss, is_timeout, peer_lost_message


class IslandDDPStrategy(DDPStrategy):
    """DDP inside islands of ``island_size`` ranks, no averaging across them.

    Args:
        island_size: ranks per island; must divide the world size (checked at setup).
        dedicated_peers: give the peer group a group of its own even when it is the whole
            world (a background thread that drives it must not share the default group).
        peer_transport: the transport that will run over the peer group (its backend may
            differ from the world's: ``transport.factory.peer_backend``).
        island_parallel: ``"ddp"`` or ``"fsdp"`` (model-sharded islands, ``IslandFSDP``).
        tensor_parallel_size: the island mesh's tensor-parallel size (``"fsdp"`` only).
        **kwargs: ``DDPStrategy``'s options and ``DistributedDataParallel`` keywords.

    Raises:
        ValueError: ``process_group`` was passed, or a keyword neither DDPStrategy nor
            DistributedDataParallel accepts.
    """

    def __init__(
        self,
        *,
        island_size: int,
        dedicated_peers: bool = False,
        peer_transport: str = "allreduce",
        island_parallel: str = "ddp",
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        if "process_group" in kwargs:
            raise SwarmConfigError(
                "process_group cannot be passed to SwarmStrategy: DDP runs over each island's "
                "own group, which the strategy creates; set island_size instead."
            )
        super().__init__(**kwargs)
        _check_ddp_kwargs(self._ddp_kwargs)
        self._island_size = island_size
        self._dedicated_peers = dedicated_peers
        self._peer_transport = peer_transport
        self._topology: IslandTopology | None = None
        self._groups: SwarmGroups | None = None
        self._model_sharded = island_parallel == "fsdp"
        self._tensor_parallel_size = tensor_parallel_size
        self._fsdp: IslandFSDP | None = None

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
        self._topology = IslandTopology(
            world_size=self.world_size,
            island_size=self._island_size,
            global_rank=self.global_rank,
        )
        peers_backend = peer_backend(self._peer_transport, dist.get_backend())
        self._groups = build_groups(
            self._topology,
            backend=self._process_group_backend,
            # new_group does not inherit the world's timeout: every group gets the same one.
            timeout=self._timeout,
            dedicated_peers=self._dedicated_peers,
            # The swarm transport's CPU traffic needs a gloo peer group beside NCCL's.
            peer_backend=peers_backend,
            # Model-sharded, the island group carries the outer round's agreement only (FSDP
            # has its own groups), on the peer group's backend.
            island_backend=peers_backend if self._model_sharded else None,
        )
        if self._model_sharded:
            self._fsdp = IslandFSDP(
                self._topology,
                self._tensor_parallel_size,
                device_type=self.root_device.type,
                backend=self._process_group_backend,
            )

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._model_sharded and self._start_method != "popen":
            self._launcher = ShardedResultsLauncher(self, start_method=self._start_method)

    @property
    def island_mesh_shape(self) -> dict[str, int] | None:
        """``{"data_parallel": dp, "tensor_parallel": tp}`` of a model-sharded island; None
        under DDP islands (and before setup)."""
        return self._fsdp.mesh.shape if self._fsdp is not None else None

    @property
    def device_mesh(self) -> DeviceMesh:
        """This island's ``(data_parallel, tensor_parallel)`` mesh (``island_parallel="fsdp"``)."""
        if self._fsdp is None:
            raise RuntimeError("a device mesh exists only with island_parallel='fsdp', after setup")
        return self._fsdp.device_mesh

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._fsdp is not None:
            # Read by the module's configure_model, which Lightning calls right after this.
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self._fsdp.device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._fsdp is not None:
            return self._fsdp.sampler_kwargs()
        return super().distributed_sampler_kwargs

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not self._model_sharded:
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
        if self._fsdp is not None:
            assert self.model is not None
            _materialize_distributed_module(self.model, self.root_device)
        super().model_to_device()

    # -- model-sharded checkpoints: the module and inner optimizers live in per-rank swarm files
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Rank 0's shards alone would be neither the model nor loadable into other ranks.
        return {} if self._model_sharded else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {} if self._model_sharded else super().optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        swarm = checkpoint.get("swarm")
        if isinstance(swarm, Mapping) and isinstance(swarm.get("fingerprint"), Mapping):
            # Before Lightning loads weights that may not be there (a per-rank save has none).
            check_layout(swarm["fingerprint"], self.island_mesh_shape, self.topology.num_islands)
        if self._fsdp is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        elif swarm is None and checkpoint.get("state_dict"):
            # A plain Lightning checkpoint holds the full weights: each rank takes its shards.
            # A swarm checkpoint's shards are installed by the swarm restore instead.
            assert self.lightning_module is not None
            self._fsdp.load_full_state(
                self.lightning_module, checkpoint["state_dict"], strict=strict
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._model_sharded:
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
        if self.topology.island_size == 1 or self._fsdp is not None:
            return model
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(
            module=model,
            device_ids=device_ids,
            process_group=self.groups.island,
            **self._ddp_kwargs,
        )

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        if self._fsdp is not None:
            assert self.lightning_module is not None
            self._fsdp.check_module(self.lightning_module)
            # Anchors must start identical in every island: island 0's shards everywhere.
            self._fsdp.align_islands(self.model, self.groups.peers)
            return
        # Anchors must start identical on every rank: take global rank 0's weights everywhere,
        # before DDP (which would only sync inside the island) wraps the module.
        _sync_module_states(self.model)
        super().configure_ddp()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``reduce``; with no group given, during training, over the island only
        (``SwarmGroups.between_rounds``).

        That is a ``self.log(..., sync_dist=True)`` in ``training_step``: over the world it
        would cross islands at every inner step. Its value is then the island's mean. Validation
        and every other stage keep the world.
        """
        if group is None and self._between_rounds():
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

    def _between_rounds(self) -> bool:
        """True during the training stage of a swarm of several islands."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        islands = self._topology.num_islands if self._topology is not None else 1
        return islands > 1 and trainer is not None and trainer.training

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
        if self._fsdp is not None:
            self._fsdp.destroy()
            self._fsdp = None
        if self._groups is not None:
            self._groups.destroy()
            self._groups = None


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Reject keywords that neither DDPStrategy nor DistributedDataParallel accepts.

    DDPStrategy forwards unknown keywords to the DDP wrapper, which is built only after the
    processes have launched (and never for islands of one rank): a typo would surface late or
    not at all, so it is caught here.
    """
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters)
    accepted -= {"self", "module", "device_ids", "process_group"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise SwarmConfigError(
            f"SwarmStrategy got unknown option(s) {unknown}; use SwarmStrategy's own options, "
            "DDPStrategy's, or DistributedDataParallel keywords such as find_unused_parameters."
        )


def process_group_timeout_s(timeout_s: float | None, kwargs: dict[str, Any]) -> float | None:
    """The one timeout of every process group, from ``timeout_s`` or DDPStrategy's ``timeout``.

    ``timeout=timedelta(...)`` (DDPStrategy's own keyword) is still accepted and removed from
    ``kwargs``; giving both with different values is refused.
    """
    timeout = kwargs.pop("timeout", None)
    if timeout is None:
        return timeout_s
    if not isinstance(timeout, datetime.timedelta):
        raise SwarmConfigError(
            f"timeout={timeout!r} must be a datetime.timedelta; prefer timeout_s=<seconds>."
        )
    if timeout_s not in (None, timeout.total_seconds()):
        raise SwarmConfigError(
            f"timeout={timeout} and timeout_s={timeout_s} disagree; give timeout_s only."
        )
    return timeout.total_seconds()


@contextlib.contextmanager
def timeouts_explained(timeout_s: float, rank: int, static: bool = True) -> Iterator[None]:
    """Turn a collective's timeout (torch's message names no option) into one that does, and
    a peer's closed connection into ``PeerLostError``.

    Only for static runs (``static``): elastic islands bound their rounds with
    ``round_timeout_s`` and report their own errors. The outer round's transport explains its
    own collectives (naming the island and the round, ``transport.link``); this catches the
    others (DDP inside an island, Lightning's, a checkpoint's).
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
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CollectiveTimeoutError(
            f"rank {rank}: a collective waited timeout_s={timeout_s:g} s for another rank and "
            f"gave up ({first}). A rank stopped, hung or died; every waiting rank stops here "
            "instead of blocking. Look for the rank whose log ends earliest; if a step or a "
            "checkpoint legitimately takes longer, raise timeout_s."
        ) from err
