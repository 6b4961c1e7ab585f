"""``SwarmStrategy``: DiLoCo across islands as a Lightning strategy.

This module is glue. It wires Lightning's hooks to the island topology
(``lightning_swarm.topology``), the process groups and transport (``lightning_swarm.transport``)
and the outer loop (``lightning_swarm.outer``); the DiLoCo math itself lives in
``lightning_swarm.algorithm``.

Lifecycle inside ``Trainer.fit``:
1. ``setup_distributed``: the default process group, then the island and peer groups.
2. ``configure_ddp``: rank 0's weights are broadcast to the whole world (anchors start identical
   everywhere), then the module is wrapped in DDP over its island's group only. An island of one
   rank is not wrapped at all.
3. ``setup``: after Lightning built the optimizers, one ``OuterSync`` per optimizer takes a copy
   of that optimizer's trained parameters as its anchors.
4. ``optimizer_step``: after each real inner step (never a gradient-accumulation micro-batch),
   the optimizer's ``OuterSync`` counts it and syncs every ``sync_every`` steps; the sync's
   metrics go straight to the loggers under ``swarm/`` so ``log_every_n_steps`` cannot drop them.
5. ``teardown``: the sync worker drained and joined (Streaming DiLoCo), then the transport
   closed and the groups destroyed.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.fragments import FragmentLayout, build_fragments
from lightning_swarm.config import (
    AnchorConfig,
    SwarmConfig,
    SwarmTransportConfig,
    as_anchor_config,
    as_swarm_transport_config,
)
from lightning_swarm.outer import OuterOptimizerFactory, OuterSync, Streaming, SyncReport
from lightning_swarm.resume import Collectives, ResumeHost, SwarmCheckpointer, options_of
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport import AllReduceTransport, Transport, ring_allreduce_bytes
from lightning_swarm.transport.groups import SwarmGroups, build_groups
from lightning_swarm.transport.quantized import QuantizedTransport
from lightning_swarm.transport.swarm import SwarmTransport
from lightning_swarm.transport.worker import SyncWorker, SyncWorkerError

default_outer_optimizer: OuterOptimizerFactory = functools.partial(
    torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True
)


@dataclass
class SwarmTotals:
    """Running totals of this rank's outer syncs (all optimizers)."""

    outer_steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    sync_wall_s: float = 0.0
    inner_steps: int = 0


class SwarmStrategy(DDPStrategy):
    """Train any LightningModule DiLoCo-style across islands of ranks.

    Args:
        sync_every: H, inner optimizer steps between outer syncs.
        outer_optimizer: callable taking an iterable of tensors (the anchors) and returning a
            ``torch.optim.Optimizer``; default SGD(lr=0.7, momentum=0.9, nesterov=True).
        island_size: ranks per island (synced every step); must divide the world size.
        transport: how pseudo-gradients are averaged across islands: ``"allreduce"`` or
            ``"swarm"`` (a rotating aggregator that spools, validates and aggregates).
        anchor_device: device of the anchors and outer optimizer state (default ``"cpu"``).
        anchor_dtype: dtype of the anchors, e.g. ``torch.bfloat16``; ``None`` = float32.
        bucket_mb: MiB per all-reduce bucket; bounds the transport's extra memory.
        anchors: how a resume restores anchors: ``AnchorConfig(mmap=True)`` (default) maps
            them; ``{"mmap": False}`` reads them eagerly.
        swarm: options of the swarm transport (``SwarmTransportConfig`` or a dict such as
            ``{"offload": True, "aggregation": "median"}``); warns unless transport="swarm".
        num_fragments: Streaming DiLoCo: sync the model in this many fragments on staggered
            schedules (``sync_every`` must be a multiple of it); 1 = plain DiLoCo.
        fragment_layout: ``"strided"`` (layer i -> fragment i mod F), ``"sequential"``, or one
            list of module names per fragment.
        sync_delay: inner steps between sending a fragment and applying its average; the
            exchange runs in a background thread meanwhile (``< sync_every / num_fragments``).
        merge_alpha: on arrival ``local <- (1 - alpha) * global + alpha * local``, in [0, 1].
        quantize: ``"none"``, ``"bf16"``, ``"int8"`` or ``"int4"`` pseudo-gradients (per-block
            absmax scales, accumulated in float32), on either transport.
        quantize_block_size: elements per scale block for int8 / int4.
        error_feedback: carry each island's quantization error into its next round.
        **kwargs: passed through to ``DDPStrategy`` (``start_method``, ``timeout``,
            ``process_group_backend``, DDP keywords such as ``find_unused_parameters``).

    Raises:
        ValueError: an option is out of range (the message names it and the fix).
    """

    strategy_name = "swarm"

    def __init__(
        self,
        sync_every: int = 100,
        outer_optimizer: OuterOptimizerFactory | None = None,
        island_size: int = 1,
        transport: str = "allreduce",
        anchor_device: str | torch.device = "cpu",
        anchor_dtype: str | torch.dtype | None = None,
        bucket_mb: float = 32.0,
        anchors: AnchorConfig | dict[str, Any] | None = None,
        swarm: SwarmTransportConfig | dict[str, Any] | None = None,
        num_fragments: int = 1,
        fragment_layout: FragmentLayout = "strided",
        sync_delay: int = 0,
        merge_alpha: float = 0.0,
        quantize: str = "none",
        quantize_block_size: int = 128,
        error_feedback: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(anchor_dtype, torch.dtype):
            anchor_dtype = str(anchor_dtype).removeprefix("torch.")
        self.config = SwarmConfig(
            sync_every=sync_every,
            island_size=island_size,
            transport=transport,
            anchor_device=str(anchor_device),
            anchor_dtype=anchor_dtype,
            bucket_mb=bucket_mb,
            anchors=as_anchor_config(anchors if anchors is not None else AnchorConfig()),
            swarm=as_swarm_transport_config(swarm if swarm is not None else SwarmTransportConfig()),
            num_fragments=num_fragments,
            fragment_layout=fragment_layout,
            sync_delay=sync_delay,
            merge_alpha=merge_alpha,
            quantize=quantize,
            quantize_block_size=quantize_block_size,
            error_feedback=error_feedback,
        )
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise ValueError(
                f"outer_optimizer must be a callable returning an optimizer, got "
                f"{type(outer_optimizer).__name__}; pass e.g. "
                "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)."
            )
        if "process_group" in kwargs:
            raise ValueError(
                "process_group cannot be passed to SwarmStrategy: DDP runs over each island's "
                "own group, which the strategy creates; set island_size instead."
            )
        super().__init__(**kwargs)
        _check_ddp_kwargs(self._ddp_kwargs)
        self.outer_optimizer_factory = outer_optimizer or default_outer_optimizer
        self._topology: IslandTopology | None = None
        self._groups: SwarmGroups | None = None
        self._transport: Transport | None = None
        self._outer_syncs: list[OuterSync] = []
        self._outer_by_optimizer: dict[int, OuterSync] = {}
        self._params_at_setup: dict[int, int] = {}
        self.totals = SwarmTotals()
        self._worker: SyncWorker | None = None

    # -- registration ---------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if "swarm" in strategy_registry:
            return
        strategy_registry.register(
            "swarm", cls, description="DiLoCo across islands (lightning_swarm)"
        )
        strategy_registry.register(
            "swarm_spawn",
            cls,
            description="DiLoCo across islands, processes started with spawn",
            start_method="spawn",
        )

    # -- read-only views ------------------------------------------------------------------
    @property
    def topology(self) -> IslandTopology:
        if self._topology is None:
            raise RuntimeError("the island topology exists only after the strategy's setup")
        return self._topology

    @property
    def outer_syncs(self) -> list[OuterSync]:
        """One ``OuterSync`` per optimizer, in ``trainer.optimizers`` order."""
        return self._outer_syncs

    @property
    def transport(self) -> Transport | None:
        return self._transport

    def anchor_bytes(self) -> int:
        return sum(o.anchor_bytes for o in self._outer_syncs)

    def outer_state_bytes(self) -> int:
        return sum(o.outer_state_bytes() for o in self._outer_syncs)

    def ddp_equivalent_bytes(self) -> int:
        """Bytes one rank would have sent across islands had the islands run DDP instead.

        DDP all-reduces every trained gradient at every inner step; across islands that is the
        same ring all-reduce the transport does, once per step instead of once per sync.
        """
        if self._topology is None:
            return 0
        total = 0
        for outer in self._outer_syncs:
            grad_bytes = sum(p.numel() * p.element_size() for p in outer.params.values())
            per_step = ring_allreduce_bytes(grad_bytes, self._topology.num_islands)
            total += per_step * outer.inner_steps
        return total

    # -- setup ----------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._topology = IslandTopology(
            world_size=self.world_size,
            island_size=self.config.island_size,
            global_rank=self.global_rank,
        )
        # A delayed exchange runs in a worker thread: it gets a peer group of its own.
        self._groups = build_groups(
            self._topology,
            backend=self._process_group_backend,
            dedicated_peers=self.config.sync_delay > 0,
        )

    @override
    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]
        """Wrap in DDP over the island's group; an island of one rank needs no wrapper."""
        assert self._groups is not None
        if self.topology.island_size == 1:
            return model
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(
            module=model,
            device_ids=device_ids,
            process_group=self._groups.island,
            **self._ddp_kwargs,
        )

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        # Anchors must start identical on every rank: take global rank 0's weights everywhere,
        # before DDP (which would only sync inside the island) wraps the module.
        _sync_module_states(self.model)
        super().configure_ddp()

    @override
    def _register_ddp_hooks(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            super()._register_ddp_hooks()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # A pending swarm resume installs anchors later: build placeholders, not copies.
            resuming = trainer.ckpt_path is not None
            self._build_outer_syncs(
                defer_anchors=self.checkpointer.defer_anchors(resuming=resuming)
            )

    def _build_outer_syncs(self, *, defer_anchors: bool) -> None:
        module = self.lightning_module
        assert module is not None
        names = {id(p): name for name, p in module.named_parameters()}
        self._transport = self._build_transport()
        self._outer_syncs, self._outer_by_optimizer = [], {}
        self._params_at_setup = {id(opt): _num_params(opt) for opt in self.optimizers}
        seen: set[int] = set()
        for index, optimizer in enumerate(self.optimizers):
            params = _trained_params(optimizer, names, index, seen)
            if not params:
                continue
            outer = OuterSync(
                params,
                outer_optimizer=self.outer_optimizer_factory,
                transport=self._transport,
                sync_every=self.config.sync_every,
                anchor_device=self.config.anchor_device,
                anchor_dtype=self.config.anchor_torch_dtype,
                defer_anchors=defer_anchors,
                streaming=self._streaming(params),
            )
            self._outer_syncs.append(outer)
            self._outer_by_optimizer[id(optimizer)] = outer

    def _build_transport(self) -> Transport:
        assert self._groups is not None
        # NCCL reduces device tensors only: the bucket visits the accelerator, anchors stay put.
        backend = torch.distributed.get_backend()
        device = self.root_device if backend == "nccl" else torch.device("cpu")
        if self.config.transport == "swarm":
            options = self.config.swarm
            return SwarmTransport(
                self._groups.peers,
                num_islands=self.topology.num_islands,
                island_index=self.topology.island_index,
                offload=options.offload,
                spool_dir=options.spool_dir,
                aggregation=options.aggregation,
                trim_ratio=options.trim_ratio,
                min_contributions=options.min_contributions,
                max_norm=options.max_norm,
                island_weights=options.island_weights,
                chunk_bytes=options.chunk_bytes,
                cleanup_timeout_s=options.cleanup_timeout_s,
                device=device,
                codec=self._codec() if self.config.quantize != "none" else None,
            )
        if self.config.quantize != "none":
            return QuantizedTransport(
                self._groups.peers,
                num_islands=self.topology.num_islands,
                codec=self._codec(),
                bucket_numel=self.config.bucket_numel,
                device=device,
            )
        return AllReduceTransport(
            self._groups.peers,
            num_islands=self.topology.num_islands,
            bucket_numel=self.config.bucket_numel,
            device=device,
        )

    def _codec(self) -> Codec:
        return Codec(self.config.quantize, self.config.quantize_block_size)

    def _streaming(self, params: dict[str, torch.nn.Parameter]) -> Streaming:
        """Fragments (the layout is checked here, where the names are known) and options."""
        config = self.config
        if config.sync_delay > 0 and self._worker is None:
            self._worker = SyncWorker(device=self.root_device)
        return Streaming(
            fragments=build_fragments(list(params), config.num_fragments, config.fragment_layout),
            sync_delay=config.sync_delay,
            merge_alpha=config.merge_alpha,
            codec=self._codec(),
            error_feedback=config.error_feedback,
            worker=self._worker,
        )

    def _close_worker(self) -> None:
        """Wait for exchanges in flight, then join the worker (before groups are destroyed)."""
        if self._worker is None:
            return
        try:
            for outer in self._outer_syncs:
                # A round still in flight when fit ends is dropped (it is in the last checkpoint).
                outer.drain()
        except SyncWorkerError as err:
            # Teardown also runs after a failed fit: do not mask that error with this one.
            warnings.warn(f"{err}; the round was dropped at teardown", RuntimeWarning, stacklevel=2)
        finally:
            self._worker.close()
            self._worker = None

    # -- training -------------------------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        expected = self._params_at_setup.get(id(optimizer))
        if expected is not None and _num_params(optimizer) != expected:
            raise ValueError(
                f"an optimizer gained or lost parameters after setup ({expected} at setup, "
                f"{_num_params(optimizer)} now), e.g. through add_param_group (as "
                "BackboneFinetuning does); SwarmStrategy anchors every parameter at setup, so "
                "give the optimizer all parameters from the start and freeze them with "
                "requires_grad=False instead."
            )
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        outer = self._outer_by_optimizer.get(id(optimizer))
        if outer is not None:
            self.totals.inner_steps += 1
            report = outer.on_inner_step()
            if report is not None:
                self._record(report, self._outer_syncs.index(outer))
        return output

    def _record(self, report: SyncReport, optimizer_index: int) -> None:
        self.totals.outer_steps += int(report.applied)
        self.totals.bytes_sent += report.bytes_sent
        self.totals.bytes_received += report.bytes_received
        self.totals.sync_wall_s += report.wall_s
        suffix = "" if len(self._outer_syncs) == 1 else f"_opt{optimizer_index}"
        metrics = {
            f"swarm/outer_steps{suffix}": float(report.outer_steps),
            f"swarm/pseudo_grad_norm{suffix}": report.pseudo_grad_norm,
            "swarm/bytes_sent": float(self.totals.bytes_sent),
            "swarm/bytes_received": float(self.totals.bytes_received),
            f"swarm/sync_time_s{suffix}": report.wall_s,
            f"swarm/transport_time_s{suffix}": report.transport_s,
        }
        if self.config.num_fragments > 1:
            metrics[f"swarm/fragment{report.fragment}_rounds{suffix}"] = float(
                report.fragment_rounds
            )
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if trainer is None:
            return
        # Logged directly at the sync step: self.log would wait for log_every_n_steps and a
        # sync every H steps could fall between two flushes. Built-in loggers are rank-0-only.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step + 1)

    # -- checkpoints ----------------------------------------------------------------------
    @functools.cached_property
    def checkpointer(self) -> SwarmCheckpointer:
        """Saves and restores the swarm state (``SwarmResume`` sets its island_ckpt_paths)."""
        return SwarmCheckpointer()

    def _resume_host(self) -> ResumeHost:
        """The training state the checkpointer saves from and restores into, on this rank."""
        module = self.lightning_module
        assert module is not None
        return ResumeHost(
            topology=self.topology,
            outer_syncs=self.outer_syncs,
            module=module,
            optimizers=self.optimizers,
            device=self.root_device,
            totals=self.totals,
            options=options_of(self.config, self.outer_syncs),
            anchors=self.config.anchors,
            collectives=Collectives.of_world(self.global_rank, self.broadcast, self.barrier),
        )

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self.checkpointer.capture(checkpoint_path, checkpoint, rank=self.global_rank)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # After setup (outer syncs exist) and after rank 0's optimizer state went everywhere:
        # each island's own state replaces it here, before any sanity check or training step.
        if self.checkpointer.pending:
            self.checkpointer.restore(self._resume_host())
            rank_zero_info(f"SwarmResume: {self.checkpointer.summary}")

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._outer_syncs or "optimizer_states" not in checkpoint:
            # Not fitting, or a weights-only file: nothing of the swarm to resume from.
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        save_id = self.checkpointer.save(self._resume_host(), checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.is_global_zero:
            # Only now does the Lightning file name the new save; older ones can go.
            self.checkpointer.prune(filepath, keep=save_id)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            self.checkpointer.remove(filepath)

    # -- teardown -------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        self._close_worker()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        # Lightning's teardown still talks to the DDP wrapper (its logging data lives in the
        # reducer, bound to the island group): unwrap first, destroy the groups last. The other
        # way round, a rank can block forever inside the wrapper of a destroyed group.
        super().teardown()
        if self._groups is not None:
            self._groups.destroy()
            self._groups = None


def _trained_params(
    optimizer: Optimizer, names: dict[int, str], index: int, seen: set[int]
) -> dict[str, torch.nn.Parameter]:
    """The parameters ``optimizer`` holds, by module name, in a rank-independent order.

    Frozen parameters (``requires_grad=False``) are included: a parameter unfrozen later in the
    run must already have an anchor, or it would train on every island and never be synced.
    While frozen its pseudo-gradient is zero and its anchor does not move.
    """
    params: dict[str, torch.nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.is_floating_point():
                continue
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of optimizer {index} is also trained by another optimizer; "
                    "SwarmStrategy keeps one anchor per parameter, so give each parameter to "
                    "exactly one optimizer."
                )
            seen.add(id(p))
            params[names.get(id(p), f"optimizer{index}.param{len(params)}")] = p
    return params


def _num_params(optimizer: Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


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
        raise ValueError(
            f"SwarmStrategy got unknown option(s) {unknown}; use SwarmStrategy's own options, "
            "DDPStrategy's, or DistributedDataParallel keywords such as find_unused_parameters."
        )
