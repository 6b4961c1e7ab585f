"""Lightning's per-step machinery in a swarm: kept inside the island, or moved to rounds (glue).

Between rounds nothing may cross islands: each message costs a slow round trip and would let a
slow island pace the others. ``IslandSigterm`` replaces Lightning's per-batch SIGTERM broadcast:
the island agrees every batch, the islands once per round, and every rank stops at the same batch
after the next round (a grace period must cover ``sync_every`` steps). Under a time budget islands
step at their own pace, so ``BudgetFit`` moves ``max_steps`` and step-triggered checkpoints to
rounds, counting the swarm's steps (the most any island took, agreed at each round). ``max_time``
and ``train_time_interval`` cannot be confined; ``warn_of_world_collectives`` names alternatives.
The Lightning private names read here are read nowhere else, each tested in
``tests/test_between_rounds.py`` or ``tests/test_budget_resume.py``.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.callbacks.timer import Interval
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_swarm.errors import PeerLostError, SwarmConfigError, SwarmError
from lightning_swarm.transport.link import is_peer_loss, peer_lost_message

log = logging.getLogger(__name__)


class IslandSigterm:
    """SIGTERM handling of one fit of a static swarm of several islands.

    ``island_group`` is ``SwarmGroups.between_rounds`` (no round or worker thread uses it;
    ``None`` for islands of one rank); ``device`` is where the flags live. Lifetime: ``install``
    at setup, before Lightning registers its handlers; ``close`` when the fit ends normally,
    waiting for an agreement still in flight before the groups go. After a failed fit the
    strategy drops the object without waiting: a peer may be gone.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        island_group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        island_index: int,
        num_islands: int,
    ) -> None:
        self._trainer = trainer
        self._island_group = island_group
        self._device = device
        self._island_index = island_index
        self._num_islands = num_islands
        self._signalled = False  # this rank received SIGTERM
        self._island_signalled = False  # some rank of this island did (agreed at a batch)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def install(self) -> None:
        connector = self._trainer._signal_connector
        # An instance attribute: Lightning registers ``self._sigterm_notifier_fn`` after setup.
        connector._sigterm_notifier_fn = self._on_sigterm  # type: ignore[method-assign,assignment]
        epoch_loop = self._trainer.fit_loop.epoch_loop
        epoch_loop._broadcast_sigterm_tensor = self.check  # type: ignore[method-assign]

    def _on_sigterm(self, signum: int | signal.Signals, frame: FrameType) -> None:
        rank = self._trainer.global_rank
        message = "SIGTERM received: every island stops after the next outer round"
        log.warning(rank_prefixed_message(message, rank))
        if not self._signalled:
            launcher = self._trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # as Lightning does: pass it to the ranks it started
        self._signalled = True

    def check(self) -> None:
        """At every training batch: agree inside the island; raise ``SIGTERMException`` if
        the last round's agreement said some island was signalled."""
        flag = torch.tensor([int(self._signalled)], device=self._device)
        if self._island_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._island_group)
        self._island_signalled = self._island_signalled or bool(flag.item())
        try:
            stop = self._agreed_to_stop()
        except RuntimeError as err:
            # The last round's agreement crosses islands: a peer island that died after that
            # round shows here, outside any round.
            if isinstance(err, SwarmError) or not is_peer_loss(err):
                raise
            where = f"rank {self._trainer.global_rank}, after the last round"
            gone = "a rank of another island (the one whose address torch names)"
            raise PeerLostError(peer_lost_message(where, gone, err)) from err
        if stop:
            self._trainer._signal_connector.received_sigterm = True
            trainer = self._trainer
            limit = f" of max_steps={trainer.max_steps}" if trainer.max_steps > 0 else ""
            log.warning(
                rank_prefixed_message(
                    f"the fit stops early, at inner step {trainer.global_step}{limit}: island(s) "
                    f"{stop} received SIGTERM, and every island "
                    "stops after the round that followed (the exit code is 143, as for SIGTERM). "
                    "Resume from the last checkpoint to go on.",
                    trainer.global_rank,
                )
            )
            raise SIGTERMException(128 + signal.SIGTERM)

    def on_round(self) -> None:
        """After a round applied, on every rank: start the islands' agreement (no wait); one
        flag per island, so that every rank can name the island that was signalled."""
        flags = torch.zeros(self._num_islands, dtype=torch.int64, device=self._device)
        flags[self._island_index] = int(self._island_signalled)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        assert work is not None
        self._pending.append((work, flags))

    def _agreed_to_stop(self) -> list[int]:
        """The islands that some agreement in flight found signalled (none: go on)."""
        try:
            for work, _ in self._pending:
                work.wait()
            return sorted({i for _, f in self._pending for i in f.nonzero().flatten().tolist()})
        finally:
            self._pending.clear()

    def close(self) -> None:
        """Wait for an agreement still in flight (the fit ended right after its round)."""
        self._agreed_to_stop()


def warn_of_world_collectives(trainer: pl.Trainer) -> None:
    """Warn about callbacks that make Lightning cross islands at every batch (module docstring)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        per_step = isinstance(callback, Timer) and callback._interval == Interval.step
        if per_step and callback._duration is not None:
            rank_zero_warn(
                "Trainer(max_time=...) (Lightning's Timer) broadcasts over every island at "
                "every inner step, so a slow link or a slow island paces every step; prefer "
                "max_steps, or Timer(duration=..., interval='epoch')."
            )
        if isinstance(callback, ModelCheckpoint) and callback._train_time_interval is not None:
            rank_zero_warn(
                "ModelCheckpoint(train_time_interval=...) broadcasts over every island at every "
                "inner step, so a slow link or a slow island paces every step; prefer "
                "ModelCheckpoint(every_n_train_steps=...), a multiple of sync_every."
            )


def check_round_saves(trainer: pl.Trainer, seconds: float) -> list[ModelCheckpoint]:
    """The trainer's ``ModelCheckpoint`` callbacks that save during the fit.

    Raises:
        SwarmConfigError: a checkpoint saves at epoch ends or on a clock, or links its last
            checkpoint (each island would do so at a different round).
    """
    during: list[ModelCheckpoint] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback._every_n_epochs or callback._train_time_interval is not None:
            given = (
                f"every_n_epochs={callback._every_n_epochs}"
                if callback._every_n_epochs
                else f"train_time_interval={callback._train_time_interval}"
            )
            raise SwarmConfigError(
                f"sync_every_s={seconds} cannot run ModelCheckpoint({given}): each island "
                "reaches its epoch ends and its clock at a different round, and a save is "
                "collective. Pass ModelCheckpoint(every_n_train_steps=N) instead: under a "
                "budget it saves right after the first round at which some island reached each "
                "multiple of N steps (counted like max_steps); Trainer(enable_checkpointing="
                "False) for no checkpoints during the fit."
            )
        if callback.save_last == "link":
            raise SwarmConfigError(
                f"sync_every_s={seconds} cannot run ModelCheckpoint(save_last='link'): it links "
                "the last checkpoint at each island's own epoch ends, a collective the other "
                "islands do not join; pass save_last=True."
            )
        if callback._every_n_train_steps:
            during.append(callback)
    return during


class BudgetFit(pl.Callback):
    """Ends a budgeted fit at the first round where the swarm's step count reached
    ``max_steps``, and saves each step-triggered checkpoint right after the first round at which
    it reached a multiple of ``every_n_train_steps`` (``monitor``: every island must log it in
    ``training_step``; file names are global rank 0's).

    Lifetime: built at the strategy's setup, ``install`` right after it, ``start`` before the
    first step, ``after_round`` after each round, ``restore`` (idempotent) when the fit ends.

    Raises:
        SwarmConfigError: without ``max_steps``, with ``max_epochs``, or as
            ``check_round_saves``.
    """

    def __init__(self, trainer: pl.Trainer, seconds: float) -> None:
        self._trainer = trainer
        self.max_steps = trainer.max_steps
        if self.max_steps == -1:
            raise SwarmConfigError(
                f"sync_every_s={seconds} ends the fit at the first round where some island "
                "reached Trainer(max_steps=...), but max_steps is not set; pass "
                "Trainer(max_steps=N)."
            )
        if trainer.max_epochs not in (None, -1):
            raise SwarmConfigError(
                f"sync_every_s={seconds} cannot end a fit by Trainer(max_epochs="
                f"{trainer.max_epochs}): islands step at their own pace, so their epochs end at "
                "different rounds; pass max_steps only (max_epochs=-1)."
            )
        self._checkpoints = check_round_saves(trainer, seconds)
        self._every = {id(c): c._every_n_train_steps for c in self._checkpoints}
        self._due: list[ModelCheckpoint] = []
        self._last = 0  # the swarm's step count at the last round

    def install(self) -> None:
        """Lift Lightning's per-process step limit and the checkpoints' step trigger; join
        ``trainer.callbacks`` right before the first checkpoint (so this runs just before it)."""
        self._trainer.fit_loop.epoch_loop.max_steps = -1
        if not self._checkpoints:
            return
        for checkpoint in self._checkpoints:
            checkpoint._every_n_train_steps = 0
        callbacks: list[pl.Callback] = self._trainer.callbacks  # type: ignore[attr-defined]
        first = next(i for i, c in enumerate(callbacks) if c in self._checkpoints)
        callbacks.insert(first, self)

    def start(self, swarm_steps: int) -> None:
        """Before the first step: the swarm's step count at the last round (0 for a fresh fit);
        a resumed fit whose count already reached ``max_steps`` ends before taking a step."""
        self._last = swarm_steps
        self.after_round(swarm_steps)  # no checkpoint is due: the count did not move

    def after_round(self, swarm_steps: int) -> None:
        """After a round at which the swarm's step count was ``swarm_steps``: end the fit after
        this batch if it reached ``max_steps``, and mark the checkpoints now due."""
        if swarm_steps >= self.max_steps:
            self._trainer.should_stop = True
        last, every = self._last, self._every
        self._due = [
            c for c in self._checkpoints if swarm_steps // every[id(c)] > last // every[id(c)]
        ]
        self._last = swarm_steps

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        due, self._due = self._due, []
        for checkpoint in due:
            if checkpoint._should_skip_saving_checkpoint(trainer):
                continue
            candidates = checkpoint._monitor_candidates(trainer)
            # Collective over the world (every rank is at this save): a top-k save needs the
            # monitored value on every island.
            logged = checkpoint.monitor is None or trainer.strategy.reduce_boolean_decision(
                checkpoint.monitor in candidates
            )
            if logged:
                checkpoint._save_topk_checkpoint(trainer, candidates)
            else:
                rank_zero_warn(
                    f"ModelCheckpoint(monitor={checkpoint.monitor!r}): some island has not logged "
                    "it at this round, so no top-k checkpoint was saved here; under "
                    "sync_every_s log the monitored value in training_step on every island."
                )
            checkpoint._save_last_checkpoint(trainer, candidates)

    def restore(self) -> None:
        """Give Lightning its ``max_steps`` and the checkpoints their trigger back; leave
        ``trainer.callbacks``. Idempotent."""
        self._trainer.fit_loop.epoch_loop.max_steps = self.max_steps
        for checkpoint in self._checkpoints:
            checkpoint._every_n_train_steps = self._every[id(checkpoint)]
        callbacks: list[pl.Callback] = self._trainer.callbacks  # type: ignore[attr-defined]
        if self in callbacks:
            callbacks.remove(self)
