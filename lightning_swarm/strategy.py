"""``SwarmStrategy``: DiLoCo across islands as a Lightning strategy.

Glue only: Lightning's hooks wired to the ``OuterLoop``; groups and DDP come from
``IslandDDPStrategy``, saves and resumes from a ``SwarmCheckpointer`` (the hooks it is called
from and why: ``resume/checkpointer.py``; a run: ``docs/strategy.md``).
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_swarm.between_rounds import BudgetFit, IslandSigterm, warn_of_world_collectives
from lightning_swarm.config import SwarmConfig
from lightning_swarm.elastic import ElasticIsland
from lightning_swarm.errors import SwarmConfigError, SwarmConfigTypeError
from lightning_swarm.island_ddp import IslandDDPStrategy, timeouts_explained
from lightning_swarm.lightning_file import AtomicCheckpointIO, read_lightning_file
from lightning_swarm.membership import elastic_options
from lightning_swarm.outer import (
    OuterLoop,
    OuterOptimizerFactory,
    OuterSync,
    SwarmTotals,
    as_outer_optimizer,
)
from lightning_swarm.outer.loop import staging_device, transport_for
from lightning_swarm.pipeline.glue import check_trainer
from lightning_swarm.resume import Collectives, SwarmCheckpointer, TrainingView, options_of
from lightning_swarm.resume.files import require_local_path, swarm_root
from lightning_swarm.resume.training_view import ModelShards
from lightning_swarm.transport import Transport
from lightning_swarm.warm_start import WarmStart


def _config_from(config: SwarmConfig | None, kwargs: dict[str, Any]) -> SwarmConfig:
    """``config`` (or the defaults) with the ``SwarmConfig`` fields among ``kwargs`` applied,
    validated again as a whole. Those fields and DDPStrategy's ``timeout`` (still accepted; it
    must agree with ``timeout_s``) leave ``kwargs``: the rest is DDP's."""
    names = {f.name for f in dataclasses.fields(SwarmConfig)}
    options = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
    timeout = kwargs.pop("timeout", None)
    if timeout is not None:
        if not isinstance(timeout, datetime.timedelta):
            raise SwarmConfigError(
                f"timeout={timeout!r} must be a datetime.timedelta; prefer timeout_s=<seconds>."
            )
        timeout_s = options.get("timeout_s", getattr(config, "timeout_s", None))
        if timeout_s not in (None, timeout.total_seconds()):
            raise SwarmConfigError(
                f"timeout={timeout} and timeout_s={timeout_s} disagree; give timeout_s only."
            )
        options["timeout_s"] = timeout.total_seconds()
    if config is None:
        return SwarmConfig(**options)
    if not isinstance(config, SwarmConfig):
        raise SwarmConfigTypeError(
            f"SwarmStrategy's first argument is a SwarmConfig, got {type(config).__name__}; "
            "pass options by name, e.g. SwarmStrategy(sync_every=100)."
        )
    return dataclasses.replace(config, **options)


def _fit_ends_after_step(trainer: pl.Trainer, *, steps_pending: int) -> bool:
    """True when no inner optimizer step follows the one just taken in this fit; the same on
    every rank. ``steps_pending``: steps not yet in ``global_step`` (1 inside ``optimizer_step``
    under automatic optimization, 0 after a manual ``training_step``).
    """
    if trainer.max_steps != -1 and trainer.global_step + steps_pending >= trainer.max_steps:
        return True
    last_batch = (
        trainer.is_last_batch
        or trainer.fit_loop.epoch_loop.batch_progress.current.ready >= trainer.num_training_batches
    )
    max_epochs = trainer.max_epochs
    if last_batch and max_epochs not in (None, -1) and trainer.current_epoch + 1 >= max_epochs:
        return True
    # Lightning stops after this batch when should_stop is set and min_epochs / min_steps are met.
    return trainer.should_stop and bool(getattr(trainer.fit_loop, "_can_stop_early", True))


def _run_length(trainer: pl.Trainer) -> float | None:
    """The fit's inner optimizer steps: ``max_steps``, else Lightning's estimate (inf when
    unbounded); ``None`` when it cannot tell."""
    if trainer.max_steps != -1:
        return float(trainer.max_steps)
    try:
        return float(trainer.estimated_stepping_batches)
    except (MisconfigurationException, TypeError, ValueError):  # the schedule stays flat
        return None


class SwarmStrategy(IslandDDPStrategy):
    """Train any LightningModule DiLoCo-style across islands of ranks.

    Args:
        config: every option that is plain data (``SwarmConfig``); ``None`` starts from its
            defaults.
        outer_optimizer: callable taking an iterable of tensors (the anchors) and returning a
            ``torch.optim.Optimizer``; default SGD(lr=0.7, momentum=0.9, nesterov=True). An SGD
            momentum is ramped over the run by ``outer_momentum_warmup`` and
            ``outer_momentum_cooldown`` (both 0: constant).
        **kwargs: any ``SwarmConfig`` field by name, applied over ``config`` (``anchors`` and
            ``swarm`` may be dicts); every other keyword goes to ``DDPStrategy``
            (``start_method``, ``process_group_backend``, ``find_unused_parameters``, ...).

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
        config = _config_from(config, kwargs)
        elastic = elastic_options(config)
        # membership="torchft": this launch is one island of a swarm (docs/elastic.md).
        self._elastic = None if elastic is None else ElasticIsland(elastic, config)
        self.outer_optimizer_factory = as_outer_optimizer(outer_optimizer)
        super().__init__(config, **kwargs)
        self._loop: OuterLoop | None = None
        self._sigterm: IslandSigterm | None = None
        self._budget: BudgetFit | None = None
        self.totals = SwarmTotals()
        # Saves and restores the swarm state (``SwarmResume`` sets its island_ckpt_paths).
        self.checkpointer = SwarmCheckpointer()
        # Rounds on a time budget: each island keeps its own global_step and data position,
        # which checkpoints record per island.
        self._own_pace = config.sync_every_s is not None
        # Every island ends on the global model: one more round where the static islands all
        # reach the end at one step; elastic islands land on the anchors of their last round.
        self._sync_at_end = config.sync_at_end
        self._warm_start: WarmStart | None = None

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

    # What ``HostMemoryCensus`` reads (a ``SwarmMemoryReport``); None before setup.
    memory_report = outer_loop

    @property
    def outer_syncs(self) -> list[OuterSync]:
        """One ``OuterSync`` per optimizer, in ``trainer.optimizers`` order."""
        return self._loop.outer_syncs if self._loop is not None else []

    @property
    def _trainer(self) -> pl.Trainer | None:
        module = self.lightning_module
        return module._trainer if module is not None else None

    # -- setup ----------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        if self._elastic is not None:
            self._island_size = self._elastic.island_size(self._island_size, self.world_size)
        super().setup_distributed()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        # A checkpoint directory no save could write fails here, on every rank, not at the
        # first save (ModelCheckpoint resolved its dirpath in its own setup, before this).
        self.checkpointer.check_dirs(
            [getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks],
            Collectives(self.global_rank, self.broadcast, self.barrier),
        )
        if self.config.pipeline_parallel_size > 1:
            check_trainer(trainer, self.config)
        if self.config.sync_every_s is not None:
            self._budget = BudgetFit(trainer, self.config.sync_every_s)
        if self.config.warm_start_steps > 0:
            self._warm_start = WarmStart(
                self.config.warm_start_steps,
                self.groups.peers,
                self.topology.num_islands,
                self.config.bucket_numel,
            )
        # A pending swarm resume installs anchors later: build placeholders, not copies.
        self._build_outer_loop(
            self.checkpointer.defer_anchors(resuming=trainer.ckpt_path is not None)
        )
        if self._budget is not None:
            self._budget.install()
            assert self._loop is not None
            self._loop.cap_budgets(self._budget.max_steps)
        if self._elastic is None and self.topology.num_islands > 1:
            # Lightning's per-batch SIGTERM broadcast would cross islands at every step.
            self._sigterm = IslandSigterm(
                trainer,
                self.groups.between_rounds,
                self.root_device,
                island_index=self.topology.island_index,
                num_islands=self.topology.num_islands,
            )
            self._sigterm.install()
            warn_of_world_collectives(trainer)

    def _build_outer_loop(self, defer_anchors: bool) -> None:
        module = self.lightning_module
        assert module is not None
        topology, island = self.topology, self.groups.island
        transport: Transport = (
            self._elastic.build_membership(module, island, self.config.bucket_numel)
            if self._elastic is not None
            else transport_for(
                self.config,
                self.groups.peers,
                num_islands=topology.num_islands,
                island_index=topology.island_index,
                device=staging_device(self.root_device),
                # Model-sharded: one finite verdict per island, whatever shard holds a NaN.
                island_group=island if self.config.model_sharded else None,
            )
        )
        # Elastic islands share the outer state only when each rank exchanges its own share
        # (membership per rank); a model-sharded rank's share is its own shard.
        shares = not self.config.model_sharded and (
            self._elastic is None or self._elastic.outer_shares > 1
        )
        self._loop = OuterLoop(
            self.optimizers,
            {id(p): name for name, p in module.named_parameters()},
            config=self.config,
            transport=transport,
            num_islands=topology.num_islands,
            outer_optimizer=self.outer_optimizer_factory,
            device=self.root_device,
            defer_anchors=defer_anchors,
            totals=self.totals,
            island_group=island if shares else None,
            island_position=topology.local_index,
            budget_group=island if topology.island_size > 1 else None,
        )
        if self._elastic is not None:
            self._elastic.attach(self._loop.outer_syncs)
        if self._loop.frozen:
            rank_zero_info(self._loop.frozen_summary())

    # -- checkpoints ---------------------------------------------------------------------
    def _training_view(self) -> TrainingView:
        """The training state the checkpointer saves from and restores into, on this rank."""
        module = self.lightning_module
        assert module is not None
        mesh = self.island_mesh_shape
        return TrainingView(
            topology=self.topology,
            outer_syncs=self.outer_syncs,
            module=module,
            optimizers=self.optimizers,
            device=self.root_device,
            totals=self.totals,
            options=options_of(self.config, self.outer_syncs),
            anchors=self.config.anchors,
            collectives=Collectives(self.global_rank, self.broadcast, self.barrier),
            # Each rank holds only its shards (their slices: the outer states' layouts).
            model_shards=None if mesh is None else ModelShards(mesh=mesh),
            loops_per_island=self._own_pace,
        )

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
        trainer = self._trainer
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
            self.checkpointer.restore(self._training_view())
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
            self.checkpointer.save(
                self._training_view(),
                checkpoint,
                filepath,
                lambda: super(SwarmStrategy, self).save_checkpoint(
                    checkpoint, filepath, storage_options=storage_options
                ),
            )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:  # and its swarm directory
            shutil.rmtree(swarm_root(require_local_path(filepath, what="checkpoint path")), True)

    # -- training -------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer
        if self._loop is not None and trainer is not None:
            # The rounds start after the warm start: the momentum ramps span what is left.
            length = _run_length(trainer)
            warm = self.config.warm_start_steps
            self._loop.set_run_length(None if length is None else max(0.0, length - warm))
        if self._loop is not None and self._budget is not None:
            # After any resume: its budget runs from the first step, and a fit whose stopping
            # count was already reached when it was saved ends before taking one.
            self._loop.continue_budgets()
            self._budget.start(self._agreed_swarm_steps())
        trainer = self._trainer
        if self._elastic is not None and trainer is not None:
            # After any resume restored this island's state: heal it from the swarm now.
            self._log_round(self._elastic.join(trainer), steps_pending=0)

    def _agreed_swarm_steps(self) -> int:
        """Under a time budget, before the first step: the most inner steps any island had at
        its last round (0 in a fresh fit). Islands resumed from different checkpoints
        restored different counts: this one message per fit makes them decide alike."""
        assert self._loop is not None
        steps = torch.tensor([self._loop.swarm_steps or 0], device=self.root_device)
        if self.world_size > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        return int(steps.item())

    def _timeouts_explained(self) -> AbstractContextManager[None]:
        # A rank that stopped shows as a timeout of this step's collectives (DDP's in backward,
        # the outer round's), told apart from other errors by its message.
        return timeouts_explained(
            self.config.group_timeout_s, self.global_rank, self._elastic is None
        )

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
        trainer = self._trainer
        warm = self._warm_start
        if warm is not None and trainer is not None and warm.covers(trainer.global_step):
            return self._warm_step(warm, trainer, optimizer, closure, model, **kwargs)
        with self._timeouts_explained():
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self._loop is None:
                return output
            metrics = self._loop.on_inner_step(optimizer)
            trainer = self._trainer
            if metrics is not None and self._elastic is not None and trainer is not None:
                metrics = self._elastic.after_round(trainer, metrics)
            if metrics is not None and self._sigterm is not None:
                self._sigterm.on_round()  # the islands learn of a SIGTERM at rounds only
            swarm_steps = self._loop.swarm_steps if metrics is not None else None
            if swarm_steps and self._budget is not None:  # after a round only: not every step
                self._budget.after_round(swarm_steps)
            # global_step counts this step only once optimizer_step has returned.
            self._log_round(metrics, steps_pending=1)
            self._end_of_fit_round(manual=False)
        return output

    def _warm_step(
        self,
        warm: WarmStart,
        trainer: pl.Trainer,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None,
        **kwargs: Any,
    ) -> Any:
        """One step of the warm start: gradients averaged across islands, no outer round;
        after the last one, the anchors start from the (equal) weights."""
        closure = warm.averaging(closure, optimizer)
        with self._timeouts_explained():
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._loop is not None and not warm.covers(trainer.global_step + 1):
            self._loop.restart_from_params()
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._timeouts_explained():
            output = super().training_step(*args, **kwargs)
            # Manual optimization steps its optimizers inside training_step: all are done.
            self._end_of_fit_round(manual=True)
        return output

    def _end_of_fit_round(self, *, manual: bool) -> None:
        module, pending = self.lightning_module, 0 if manual else 1
        if self._loop is None or module is None or module.automatic_optimization == manual:
            return
        if self._sync_at_end and _fit_ends_after_step(module.trainer, steps_pending=pending):
            self._log_round(self._finish(), steps_pending=pending)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._sigterm is not None:
            self._sigterm.close()
        if self._budget is not None:
            self._budget.restore()
        # A fit that ended where _fit_ends_after_step could not foresee it (EarlyStopping,
        # max_time): the returned module holds the global model, that step's checkpoints not.
        # After a foreseen end every island is on the anchors already, and this runs nothing.
        if self._loop is not None and self._sync_at_end:
            self._log_round(self._finish(), steps_pending=0)

    def _finish(self) -> dict[str, float] | None:
        """The end-of-fit round (``OuterLoop.finish``): an exchange only between static
        islands, which reach the end at the same step."""
        assert self._loop is not None
        return self._loop.finish(exchange=self._elastic is None)

    def _log_round(self, metrics: dict[str, float] | None, *, steps_pending: int) -> None:
        trainer = self._trainer
        if metrics is None or trainer is None:
            return
        # Logged directly at the sync step: self.log would wait for log_every_n_steps and a
        # sync every H steps could fall between two flushes. Built-in loggers are rank-0-only.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step + steps_pending)

    @override
    def teardown(self) -> None:
        if self._budget is not None:
            self._budget.restore()  # idempotent: a failed fit gets here only
        # Before the groups go (the base class destroys them last): the worker and the
        # transport use the peer group.
        if self._loop is not None:
            self._loop.close()
        self._sigterm = None  # after a failed fit its agreement is not waited for
        super().teardown()
