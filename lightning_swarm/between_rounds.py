"""What Lightning sends between outer rounds, kept inside the island (Lightning glue).

Between rounds nothing may cross islands: each message costs a slow round trip and would let a
slow island pace the others. ``IslandSigterm`` replaces Lightning's per-batch SIGTERM broadcast:
the island agrees every batch, the islands once per round, and every rank stops at the same batch
after the next round (a grace period must cover ``sync_every`` steps). ``max_time`` and
``train_time_interval`` cannot be confined; ``warn_of_world_collectives`` names alternatives.
The Lightning private names read here are read nowhere else, each tested in
``tests/test_between_rounds.py``.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.callbacks.timer import Interval
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_swarm.errors import PeerLostError, SwarmError
from lightning_swarm.transport.link import is_peer_loss, peer_lost_message

log = logging.getLogger(__name__)


class IslandSigterm:
    """SIGTERM handling of one fit of a static swarm of several islands (module docstring).

    Args:
        trainer: the fitting trainer; its signal handler and per-batch check are replaced
            before Lightning registers its handlers (the strategy's ``setup``).
        island_group: the island's group for messages between rounds (``SwarmGroups.
            between_rounds``: no round or worker thread uses it); ``None`` for islands of one
            rank.
        device: where the flags live (the backend of the groups must reach it).

    Lifetime: ``install`` at setup; ``close`` when the fit ends normally (every rank ends at
    the same batch), which waits for an agreement still in flight before the groups go. After a
    failed fit the strategy drops the object without waiting: a peer may be gone.
    """

    def __init__(
        self, trainer: pl.Trainer, island_group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        self._trainer = trainer
        self._island_group = island_group
        self._device = device
        self._signalled = False  # this rank received SIGTERM
        self._island_signalled = False  # some rank of this island did (agreed at a batch)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def install(self) -> None:
        """Take over Lightning's SIGTERM handler and per-batch check on this trainer."""
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
        """At every training batch: agree inside the island; stop if the islands agreed to.

        Raises:
            SIGTERMException: the last round's agreement said some island was signalled.
        """
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
            raise SIGTERMException()

    def on_round(self) -> None:
        """After a round applied, on every rank: start the islands' agreement (no wait)."""
        flag = torch.tensor([int(self._island_signalled)], device=self._device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        assert work is not None
        self._pending.append((work, flag))

    def _agreed_to_stop(self) -> bool:
        stop = False
        for work, flag in self._pending:
            work.wait()
            stop = stop or bool(flag.item())
        self._pending.clear()
        return stop

    def close(self) -> None:
        """Wait for an agreement still in flight (the fit ended right after its round)."""
        try:
            self._agreed_to_stop()
        finally:
            self._pending.clear()


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
