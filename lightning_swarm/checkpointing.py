"""Lightning's checkpoint hooks for the swarm strategy (glue).

``CheckpointingStrategy`` sits between ``IslandDDPStrategy`` and ``SwarmStrategy``. Lightning's
load, save and remove hooks hand the swarm part of every checkpoint (anchors, outer state, each
island's own state) to a ``SwarmCheckpointer`` (``lightning_swarm.resume``, no Lightning). The
subclass provides the state (``config``, ``totals``, ``outer_syncs``) that ``_resume_host``
hands over; this class holds no training state of its own.

Order inside ``Trainer.fit(ckpt_path=...)``: ``load_checkpoint`` (the record is captured before
setup, so the outer loop can build placeholder anchors), ``setup``, then
``load_optimizer_state_dict`` (after Lightning loaded rank 0's optimizer state): the restore runs
there, before any sanity check or training step. On save, the swarm files are written first and
the Lightning file last, so a crash in between leaves the previous checkpoint intact.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_swarm.config import SwarmConfig
from lightning_swarm.islands import IslandDDPStrategy
from lightning_swarm.outer import OuterSync, SwarmTotals
from lightning_swarm.resume import Collectives, ResumeHost, SwarmCheckpointer, options_of


class CheckpointingStrategy(IslandDDPStrategy):
    """Island DDP whose checkpoints carry the swarm state; see the module docstring.

    The subclass sets ``config`` and ``totals`` in its constructor and overrides
    ``outer_syncs``; this class only reads them.
    """

    config: SwarmConfig
    totals: SwarmTotals

    @property
    def outer_syncs(self) -> list[OuterSync]:
        """The outer syncs whose state a checkpoint carries (none before setup)."""
        return []

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

    @functools.cached_property
    def checkpointer(self) -> SwarmCheckpointer:
        """Saves and restores the swarm state (``SwarmResume`` sets its island_ckpt_paths)."""
        return SwarmCheckpointer()

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
            rank_zero_info(f"swarm resume: {self.checkpointer.summary}")

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self.outer_syncs or "optimizer_states" not in checkpoint:
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
