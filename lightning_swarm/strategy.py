"""``SwarmStrategy``: DiLoCo across islands as a Lightning strategy.

This module is glue: Lightning hooks only. It wires them to the island topology
(``lightning_swarm.topology``), the process groups (``lightning_swarm.transport.groups``) and
the outer loop (``lightning_swarm.outer.OuterLoop``), which owns the anchors, the rounds, the
worker, the totals and the byte figures; the DiLoCo math itself lives in
``lightning_swarm.algorithm``.

Lifecycle inside ``Trainer.fit``:
1. ``setup_distributed``: the default process group, then the island and peer groups.
2. ``configure_ddp``: rank 0's weights are broadcast to the whole world (anchors start identical
   everywhere), then the module is wrapped in DDP over its island's group only. An island of one
   rank is not wrapped at all.
3. ``setup``: after Lightning built the optimizers, the transport is built and an ``OuterLoop``
   takes a copy of every optimizer's trained parameters as its anchors.
4. ``optimizer_step``: after each real inner step (never a gradient-accumulation micro-batch),
   the outer loop counts it and syncs every ``sync_every`` steps; the round's metrics go
   straight to the loggers under ``swarm/`` so ``log_every_n_steps`` cannot drop them.
5. ``teardown``: the outer loop closed (worker drained and joined, transport closed), then the
   groups destroyed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_swarm.algorithm.fragments import FragmentLayout
from lightning_swarm.checkpoint import prune_saves, swarm_root
from lightning_swarm.config import (
    AnchorConfig,
    SwarmConfig,
    SwarmTransportConfig,
    as_anchor_config,
    as_swarm_transport_config,
)
from lightning_swarm.elastic import ElasticIsland
from lightning_swarm.islands import IslandDDPStrategy
from lightning_swarm.membership import elastic_options
from lightning_swarm.outer import (
    OuterLoop,
    OuterOptimizerFactory,
    OuterSync,
    SwarmTotals,
    as_outer_optimizer,
)
from lightning_swarm.outer.build import build_transport, staging_device
from lightning_swarm.transport import Transport

if TYPE_CHECKING:
    # The resume glue is imported where used (helper "resume" removes this cycle).
    from lightning_swarm.callbacks.resume import SwarmResume


class SwarmStrategy(IslandDDPStrategy):
    """Train any LightningModule DiLoCo-style across islands of ranks.

    Args:
        outer_optimizer: callable taking an iterable of tensors (the anchors) and returning a
            ``torch.optim.Optimizer``; default SGD(lr=0.7, momentum=0.9, nesterov=True).
        anchors, swarm: nested option groups (``AnchorConfig`` / ``SwarmTransportConfig``) or
            dicts of their fields, e.g. ``swarm={"offload": True, "aggregation": "median"}``.
        **kwargs: passed through to ``DDPStrategy`` (``start_method``, ``timeout``,
            ``process_group_backend``, DDP keywords such as ``find_unused_parameters``).

    Every other argument is the ``SwarmConfig`` field of the same name, documented there
    (``sync_every``, ``island_size``, ``transport``, ``anchor_device``, ``anchor_dtype`` also as
    a ``torch.dtype``, ``bucket_mb``, the Streaming DiLoCo options and the ``quantize`` ones).

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
        membership: str = "static",
        lighthouse: str | None = None,
        island_id: str | None = None,
        min_islands: int = 2,
        quorum_timeout_s: float = 60.0,
        round_timeout_s: float = 60.0,
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
            membership=membership,
            lighthouse=lighthouse,
            island_id=island_id,
            min_islands=min_islands,
            quorum_timeout_s=quorum_timeout_s,
            round_timeout_s=round_timeout_s,
        )
        elastic = elastic_options(self.config)
        # membership="torchft": this launch is one island of a swarm (docs/elastic.md).
        self._elastic = ElasticIsland(elastic, sync_every) if elastic is not None else None
        self.outer_optimizer_factory = as_outer_optimizer(outer_optimizer)
        # A delayed exchange runs in a worker thread: it gets a peer group of its own.
        super().__init__(
            island_size=self.config.island_size,
            dedicated_peers=self.config.sync_delay > 0,
            **kwargs,
        )
        self._loop: OuterLoop | None = None
        self.totals = SwarmTotals()

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
    def outer_loop(self) -> OuterLoop | None:
        """This fit's outer loop (built at setup, kept after teardown for its figures)."""
        return self._loop

    @property
    def outer_syncs(self) -> list[OuterSync]:
        """One ``OuterSync`` per optimizer, in ``trainer.optimizers`` order."""
        return self._loop.outer_syncs if self._loop is not None else []

    @property
    def memory_report(self) -> OuterLoop | None:
        """What ``HostMemoryCensus`` reads (a ``SwarmMemoryReport``); None before setup."""
        return self._loop

    def ddp_equivalent_bytes(self) -> int:
        """Bytes one rank would have sent across islands had the islands run DDP instead."""
        return self._loop.ddp_equivalent_bytes() if self._loop is not None else 0

    # -- setup ----------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        if self._elastic is not None:
            self._island_size = self._elastic.island_size(self._island_size, self.world_size)
        super().setup_distributed()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # A pending swarm resume installs anchors later: build placeholders, not copies.
            self._build_outer_loop(defer_anchors=self._resume_callback(trainer).pending)

    def _build_outer_loop(self, *, defer_anchors: bool) -> None:
        module = self.lightning_module
        assert module is not None
        if self._elastic is not None:
            transport: Transport = self._elastic.build_membership(
                module, self.groups.island, self.config.bucket_numel
            )
        else:
            transport = build_transport(
                self.config,
                self.groups.peers,
                num_islands=self.topology.num_islands,
                island_index=self.topology.island_index,
                device=staging_device(self.root_device),
            )
        self._loop = OuterLoop(
            self.optimizers,
            {id(p): name for name, p in module.named_parameters()},
            config=self.config,
            transport=transport,
            num_islands=self.topology.num_islands,
            outer_optimizer=self.outer_optimizer_factory,
            device=self.root_device,
            defer_anchors=defer_anchors,
            totals=self.totals,
        )
        if self._elastic is not None:
            self._elastic.attach(self._loop.outer_syncs)

    # -- training -------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if self._elastic is not None and trainer is not None:
            # After any resume restored this island's state: heal it from the swarm now.
            self._log_round(self._elastic.join(trainer))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._loop is not None:
            self._loop.check_optimizer(optimizer)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._loop is not None:
            metrics = self._loop.on_inner_step(optimizer)
            trainer = self.lightning_module.trainer if self.lightning_module else None
            if metrics is not None and self._elastic is not None and trainer is not None:
                metrics = self._elastic.after_round(trainer, metrics)
            self._log_round(metrics)
        return output

    def _log_round(self, metrics: dict[str, float] | None) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if metrics is None or trainer is None:
            return
        # Logged directly at the sync step: self.log would wait for log_every_n_steps and a
        # sync every H steps could fall between two flushes. Built-in loggers are rank-0-only.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step + 1)

    # -- checkpoints ----------------------------------------------------------------------
    def _resume_callback(self, trainer: pl.Trainer) -> SwarmResume:
        """The trainer's ``SwarmResume``; one is added when the user did not add one."""
        from lightning_swarm.callbacks.resume import SwarmResume

        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, SwarmResume):
                return callback
        callback = SwarmResume()
        trainer.callbacks.append(callback)  # type: ignore[attr-defined]
        return callback

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._resume_callback(trainer).capture(checkpoint_path, checkpoint)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # After setup (outer syncs exist) and after rank 0's optimizer state went everywhere:
        # each island's own state replaces it here, before any sanity check or training step.
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            self._resume_callback(module._trainer).restore(self)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self.outer_syncs or "optimizer_states" not in checkpoint:
            # Not fitting, or a weights-only file: nothing of the swarm to resume from.
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        from lightning_swarm.callbacks.resume import save_swarm_state

        save_id = save_swarm_state(self, checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.is_global_zero:
            # Only now does the Lightning file name the new save; older ones can go.
            prune_saves(swarm_root(filepath), keep=save_id)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            from lightning_swarm.callbacks.resume import remove_swarm_state

            remove_swarm_state(filepath)

    # -- teardown -------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        # Before the groups go (the base class destroys them last): the worker and the
        # transport use the peer group.
        if self._loop is not None:
            self._loop.close()
        super().teardown()
