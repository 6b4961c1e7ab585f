"""``SwarmStrategy``: DiLoCo across islands as a Lightning strategy.

Glue only: Lightning's hooks wired to the ``OuterLoop``; groups and DDP come from
``IslandDDPStrategy``, saves and resumes from a ``SwarmCheckpointer`` (the hooks it is called
from and why: ``resume/checkpointer.py``; a run: ``docs/strategy.md``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_swarm.between_rounds import IslandSigterm, warn_of_world_collectives
from lightning_swarm.config import (
    SwarmConfig,
    dtype_name,
)
from lightning_swarm.elastic import ElasticIsland
from lightning_swarm.errors import SwarmConfigTypeError
from lightning_swarm.fit_end import BudgetStop, fit_ends_after_step
from lightning_swarm.island_ddp import (
    IslandDDPStrategy,
    process_group_timeout_s,
    timeouts_explained,
)
from lightning_swarm.lightning_file import AtomicCheckpointIO, read_lightning_file
from lightning_swarm.membership import elastic_options
from lightning_swarm.outer import (
    OuterLoop,
    OuterOptimizerFactory,
    OuterSync,
    SwarmTotals,
    as_outer_optimizer,
)
from lightning_swarm.outer.build import staging_device, transport_for
from lightning_swarm.resume import Collectives, SwarmCheckpointer, TrainingView, options_of
from lightning_swarm.resume.checkpointer import save_failure
from lightning_swarm.resume.training_view import ModelShards
from lightning_swarm.round_saves import RoundSaves
from lightning_swarm.transport import Transport
from lightning_swarm.transport.agree import agree, objects_over

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(SwarmConfig))


def _pop_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the ``SwarmConfig`` fields out of the strategy's keywords (the rest is DDP's)."""
    options = {name: kwargs.pop(name) for name in list(kwargs) if name in _OPTION_NAMES}
    if "anchor_device" in options:
        options["anchor_device"] = str(options["anchor_device"])
    if "anchor_dtype" in options:
        options["anchor_dtype"] = dtype_name(options["anchor_dtype"])
    return options


def config_with(config: SwarmConfig | None, options: dict[str, Any]) -> SwarmConfig:
    """``config`` (or the defaults) with ``options`` applied; validated again as a whole."""
    if config is None:
        return SwarmConfig(**options)
    if not isinstance(config, SwarmConfig):
        raise SwarmConfigTypeError(
            f"SwarmStrategy's first argument is a SwarmConfig, got {type(config).__name__}; "
            "pass options by name, e.g. SwarmStrategy(sync_every=100)."
        )
    return dataclasses.replace(config, **options)


class SwarmStrategy(IslandDDPStrategy):
    """Train any LightningModule DiLoCo-style across islands of ranks.

    Args:
        config: every option that is plain data (``SwarmConfig``, where each field is declared
            and documented once); ``None`` starts from its defaults.
        outer_optimizer: callable taking an iterable of tensors (the anchors) and returning a
            ``torch.optim.Optimizer``; default SGD(lr=0.7, momentum=0.9, nesterov=True).
        **kwargs: any ``SwarmConfig`` field by name (``sync_every=50``, ``island_size=2``, ...),
            applied over ``config``; ``anchor_device`` may be a ``torch.device``,
            ``anchor_dtype`` a ``torch.dtype``, ``anchors`` and ``swarm`` dicts of their fields.
            Every other keyword goes to ``DDPStrategy`` (``start_method``, ``timeout``,
            ``process_group_backend``, DDP keywords such as ``find_unused_parameters``).

    Raises:
        ValueError: an option is out of range (the message names it and the fix).
    """

    strategy_name = "swarm"

    def __init__(
        self,
        config: SwarmConfig | None = None,
        *,
        outer_optimizer: OuterOptimizerFactory | None = None,
        **kwargs: Any,
    ) -> None:
        options = _pop_options(kwargs)
        if "timeout" in kwargs:  # DDPStrategy's own keyword, still accepted
            default = config.timeout_s if isinstance(config, SwarmConfig) else None
            options["timeout_s"] = process_group_timeout_s(
                options.get("timeout_s", default), kwargs
            )
        self.config = config_with(config, options)
        elastic = elastic_options(self.config)
        # membership="torchft": this launch is one island of a swarm (docs/elastic.md).
        self._elastic = None if elastic is None else ElasticIsland(elastic, self.config)
        self.outer_optimizer_factory = as_outer_optimizer(outer_optimizer)
        # A delayed exchange runs in a worker thread: it gets a peer group of its own.
        super().__init__(
            island_size=self.config.island_size,
            dedicated_peers=self.config.sync_delay > 0,
            peer_transport=self.config.transport,
            island_parallel=self.config.island_parallel,
            tensor_parallel_size=self.config.tensor_parallel_size,
            timeout=datetime.timedelta(seconds=self.config.group_timeout_s),
            **kwargs,
        )
        self._loop: OuterLoop | None = None
        self._sigterm: IslandSigterm | None = None
        self._budget_stop: BudgetStop | None = None
        self._round_saves: RoundSaves | None = None
        self.totals = SwarmTotals()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if "swarm" in strategy_registry:
            return
        description = "DiLoCo across islands (lightning_swarm)"
        strategy_registry.register("swarm", cls, description=description)
        spawn = f"{description}, processes started with spawn"
        strategy_registry.register("swarm_spawn", cls, description=spawn, start_method="spawn")
        fsdp = f"{description}, FSDP2 inside each island (configure_model)"
        strategy_registry.register("swarm_fsdp", cls, description=fsdp, island_parallel="fsdp")

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
            resuming = trainer.ckpt_path is not None
            if self.config.sync_every_s is not None:
                self._budget_stop = BudgetStop(trainer, self.config.sync_every_s)
                self._round_saves = RoundSaves(trainer, self.config.sync_every_s)
            self._build_outer_loop(defer_anchors=self.checkpointer.defer_anchors(resuming=resuming))
            if self._budget_stop is not None and self._round_saves is not None:
                self._budget_stop.install()
                self._round_saves.install()
            if self._elastic is None and self.topology.num_islands > 1:
                # Lightning's per-batch SIGTERM broadcast would cross islands at every step.
                island = self.groups.between_rounds
                self._sigterm = IslandSigterm(trainer, island, self.root_device)
                self._sigterm.install()
                warn_of_world_collectives(trainer)

    def _build_outer_loop(self, *, defer_anchors: bool) -> None:
        module = self.lightning_module
        assert module is not None
        transport: Transport = (
            self._elastic.build_membership(module, self.groups.island, self.config.bucket_numel)
            if self._elastic is not None
            else transport_for(
                self.config,
                self.groups.peers,
                num_islands=self.topology.num_islands,
                island_index=self.topology.island_index,
                device=staging_device(self.root_device),
                # Model-sharded: one finite verdict per island, whatever shard holds a NaN.
                island_group=self.groups.island if self.config.model_sharded else None,
            )
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
            # Elastic islands share the outer state only when each rank exchanges its own share
            # (membership per rank); a model-sharded rank's share is its own shard.
            island_group=self.groups.island if self._shares_outer_state else None,
            island_position=self.topology.local_index,
            budget_group=self.groups.island if self.topology.island_size > 1 else None,
        )
        if self._elastic is not None:
            self._elastic.attach(self._loop.outer_syncs)
        if self._loop.frozen:
            rank_zero_info(self._loop.frozen_summary())

    @property
    def _shares_outer_state(self) -> bool:
        if self._elastic is not None:
            return self._elastic.outer_shares > 1
        return not self.config.model_sharded

    # -- checkpoints ---------------------------------------------------------------------
    def _resume_host(self) -> TrainingView:
        """The training state the checkpointer saves from and restores into, on this rank."""
        module = self.lightning_module
        assert module is not None
        return TrainingView(
            topology=self.topology,
            outer_syncs=self.outer_syncs,
            module=module,
            optimizers=self.optimizers,
            device=self.root_device,
            totals=self.totals,
            options=options_of(self.config, self.outer_syncs),
            anchors=self.config.anchors,
            collectives=Collectives.of_world(self.global_rank, self.broadcast, self.barrier),
            model_shards=self._model_shards(module),
            loops_per_island=self._own_pace,
        )

    @property
    def _own_pace(self) -> bool:
        """Islands step at their own pace (rounds on a time budget): each keeps its own
        ``global_step`` and data position, which checkpoints record per island."""
        return self.config.sync_every_s is not None

    def _model_shards(self, module: Module) -> ModelShards | None:
        """The island mesh and global shapes, when each rank holds only its shards."""
        mesh = self.island_mesh_shape
        if mesh is None:
            return None
        shapes = {name: list(p.shape) for name, p in module.named_parameters()}
        return ModelShards(mesh=mesh, global_shapes=shapes)

    @functools.cached_property
    def checkpointer(self) -> SwarmCheckpointer:
        """Saves and restores the swarm state (``SwarmResume`` sets its island_ckpt_paths)."""
        return SwarmCheckpointer()

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's file is written atomically (``AtomicCheckpointIO``) unless the user
        gave a checkpoint IO of their own (``Trainer(plugins=[...])``), which is kept."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            # Sets the wrapped IO only where none was configured (e.g. AsyncCheckpointIO()).
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint = read_lightning_file(
            checkpoint_path,
            lambda: super(SwarmStrategy, self).load_checkpoint(
                checkpoint_path, weights_only=weights_only
            ),
        )
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # Before Lightning restores its loops from it: under a time budget each island
            # takes its own loop state from the swarm record.
            self.checkpointer.capture(
                checkpoint_path,
                checkpoint,
                rank=self.global_rank,
                island=self.topology.island_index,
                own_pace=self._own_pace,
            )
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # After setup (outer syncs exist) and after rank 0's optimizer state went everywhere:
        # each island's own state replaces it here, before any sanity check or training step.
        if self.checkpointer.pending:
            self.checkpointer.restore(self._resume_host())
            rank_zero_info(f"swarm resume: {self.checkpointer.summary}")

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self.outer_syncs or "optimizer_states" not in checkpoint:
            # Not fitting, or a weights-only file: nothing of the swarm to resume from.
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if self._own_pace:
            # Each island names the file by its own step count: global rank 0's name is the
            # save's, so that every rank writes its swarm files next to the same file.
            filepath = self.broadcast(filepath)
        assert self._loop is not None
        with self._loop.saving():  # a budget's clock stops during the save
            self._save_swarm_checkpoint(checkpoint, filepath, storage_options)

    def _save_swarm_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None
    ) -> None:
        save_id = self.checkpointer.save(self._resume_host(), checkpoint, filepath)
        error: Exception | None = None
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        except Exception as err:  # raised below, on every rank, once the others know
            where = "" if self.world_size == 1 else f"global rank {self.global_rank}: "
            error = save_failure(err, filepath, where)
            if self.is_global_zero:
                # The new swarm files are named by no Lightning file: remove them (before the
                # other ranks hear of it and fail: a launcher may then end this rank at once).
                # The previous checkpoint, its file and the save it names, was never touched.
                self.checkpointer.discard(filepath, save_id)
        # Global rank 0 wrote (or failed to write) the Lightning file; every rank learns which.
        agree(gather=objects_over(), error=error)
        if self.is_global_zero:
            # Only now does the Lightning file name the new save; older ones can go.
            self.checkpointer.prune(filepath, keep=save_id)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            self.checkpointer.remove(filepath)

    # -- training -------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if self._loop is not None and self._budget_stop is not None:
            # After any resume: its budget runs from the first step, and a fit whose stopping
            # count was already reached when it was saved ends before taking one.
            self._loop.continue_budgets()
            swarm_steps = self._agreed_swarm_steps()
            self._budget_stop.after_round(swarm_steps >= self._budget_stop.max_steps)
            if self._round_saves is not None:
                self._round_saves.start(swarm_steps)
        if self._elastic is not None and trainer is not None:
            # After any resume restored this island's state: heal it from the swarm now.
            self._log_round(self._elastic.join(trainer), steps_pending=0)

    def _agreed_swarm_steps(self) -> int:
        """Under a time budget, before the first step: the most inner steps any island had at
        its last round (0 in a fresh fit). Islands resumed from different checkpoints
        (``island_ckpt_paths``) restored different counts, so this one message over the world,
        once per fit, makes the stop and the saves decide alike everywhere."""
        assert self._loop is not None
        steps = torch.tensor([self._loop.swarm_steps or 0], device=self.root_device)
        if self.world_size > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        return int(steps.item())

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
        # The step's collectives (DDP's in backward, the outer round's): a rank that stopped
        # shows here as a timeout, which is told apart from other errors by its message.
        with timeouts_explained(
            self.config.group_timeout_s, self.global_rank, self._elastic is None
        ):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self._loop is not None:
                metrics = self._loop.on_inner_step(optimizer)
                trainer = self.lightning_module.trainer if self.lightning_module else None
                if metrics is not None and self._elastic is not None and trainer is not None:
                    metrics = self._elastic.after_round(trainer, metrics)
                if metrics is not None and self._sigterm is not None:
                    self._sigterm.on_round()  # the islands learn of a SIGTERM at rounds only
                if metrics is not None and self._budget_stop is not None:
                    stop = self._budget_stop
                    stop.after_round(self._loop.budget_ended(stop.max_steps))
                if metrics is not None and self._round_saves is not None:
                    swarm_steps = self._loop.swarm_steps  # after a round only: not every step
                    if swarm_steps:
                        self._round_saves.after_round(swarm_steps)
                # global_step counts this step only once optimizer_step has returned.
                self._log_round(metrics, steps_pending=1)
                self._end_of_fit_round(manual=False)
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with timeouts_explained(
            self.config.group_timeout_s, self.global_rank, self._elastic is None
        ):
            output = super().training_step(*args, **kwargs)
            # Manual optimization steps its optimizers inside training_step: all are done.
            self._end_of_fit_round(manual=True)
        return output

    @property
    def _sync_at_end(self) -> bool:
        # An elastic fit already ends on a committed round, the same one on every island.
        return self.config.sync_at_end and self._elastic is None

    def _end_of_fit_round(self, *, manual: bool) -> None:
        module, pending = self.lightning_module, 0 if manual else 1
        if self._loop is None or module is None or module.automatic_optimization == manual:
            return
        if self._sync_at_end and fit_ends_after_step(module.trainer, steps_pending=pending):
            self._log_round(self._loop.finish(), steps_pending=pending)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._sigterm is not None:
            self._sigterm.close()
        self._restore_budget_hooks()
        # A fit that ended where fit_end could not foresee it (EarlyStopping, max_time).
        if self._loop is not None and self._sync_at_end:
            self._log_round(self._loop.finish(), steps_pending=0)

    def _log_round(self, metrics: dict[str, float] | None, *, steps_pending: int) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if metrics is None or trainer is None:
            return
        # Logged directly at the sync step: self.log would wait for log_every_n_steps and a
        # sync every H steps could fall between two flushes. Built-in loggers are rank-0-only.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step + steps_pending)

    def _restore_budget_hooks(self) -> None:
        """Give Lightning back what a budgeted fit took over (idempotent: a failed fit gets
        here from ``teardown`` only)."""
        if self._budget_stop is not None:
            self._budget_stop.restore()
        if self._round_saves is not None:
            self._round_saves.restore()

    @override
    def teardown(self) -> None:
        self._restore_budget_hooks()
        # Before the groups go (the base class destroys them last): the worker and the
        # transport use the peer group.
        if self._loop is not None:
            self._loop.close()
        self._sigterm = None  # after a failed fit its agreement is not waited for
        super().teardown()
