"""``SwarmResume``: restore some islands from other, older checkpoints (a thin adapter). Its
``state_dict`` stays empty: Lightning deep-copies callback state on load; mapped tensors must
not be there."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

from lightning_swarm.errors import SwarmConfigTypeError
from lightning_swarm.resume import SwarmCheckpointer


class SwarmResume(pl.Callback):
    """Restore islands from their own older checkpoints (``{island_index: ckpt_path}``; an
    index that names no island is refused on every rank before anything is restored) and catch
    them up. ``summary``: after a restore, one line saying what this rank restored."""

    def __init__(self, island_ckpt_paths: Mapping[int, str | os.PathLike[str]] | None = None):
        self.island_ckpt_paths = {int(k): Path(v) for k, v in (island_ckpt_paths or {}).items()}
        self._checkpointer: SwarmCheckpointer | None = None

    @property
    def summary(self) -> str | None:
        return self._checkpointer.summary if self._checkpointer is not None else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before Lightning loads the checkpoint: the paths are in place in time.
        checkpointer = getattr(trainer.strategy, "checkpointer", None)
        if not isinstance(checkpointer, SwarmCheckpointer):
            raise SwarmConfigTypeError(
                f"SwarmResume needs Trainer(strategy=SwarmStrategy(...)), got "
                f"{type(trainer.strategy).__name__}; remove the callback or use SwarmStrategy."
            )
        checkpointer.island_ckpt_paths = dict(self.island_ckpt_paths)
        self._checkpointer = checkpointer
