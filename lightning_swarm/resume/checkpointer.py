"""``SwarmCheckpointer``: the strategy's save and restore of swarm state, without Lightning.

``capture`` (from ``load_checkpoint``, before ``setup``) notes the checkpoint; ``restore`` (after
Lightning's optimizer load, before any step) consumes it, succeeded or not; a fit without
``ckpt_path`` forgets an earlier capture. Mapped tensors are held by the ``OuterSync``s only.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_swarm.resume.compatibility import describe_changes
from lightning_swarm.resume.files import (
    discard_save,
    prune_saves,
    require_local_path,
    resolve_mmap,
    swarm_root,
    warn_legacy,
)
from lightning_swarm.resume.records import SwarmRecord, check_loop_state, use_island_loops
from lightning_swarm.resume.restore import (
    Loaded,
    Source,
    attempt,
    choose_source,
    install,
    load_sources,
    newest_source,
)
from lightning_swarm.resume.save import save_swarm_state
from lightning_swarm.resume.training_view import TrainingView

log = logging.getLogger("lightning_swarm")


class SwarmCheckpointer:
    """Saves and restores a swarm run's state for one strategy.

    Attributes:
        island_ckpt_paths: ``{island_index: ckpt_path}`` (set by ``SwarmResume``) of islands that
            restore from another (older) checkpoint and catch up to the newest anchors.
        summary: after a restore, one line saying what this rank restored.
    """

    def __init__(self) -> None:
        self.island_ckpt_paths: dict[int, Path] = {}
        self.summary: str | None = None
        self._pending: Source | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def capture(
        self,
        ckpt_path: Any,
        checkpoint: dict[str, Any],
        *,
        rank: int,
        island: int = 0,
        own_pace: bool = False,
    ) -> None:
        """Note the checkpoint a fit resumes from (its swarm record is parsed, nothing read).

        Where the record holds each island's own loop state, island ``island``'s replaces the
        Lightning file's in ``checkpoint`` (``records.use_island_loops``); an island restored
        from ``island_ckpt_paths`` takes its loop state from there when that one has its own.
        """
        self.summary = None
        self._pending = None
        payload = checkpoint.get("swarm")
        if payload is None:
            if rank == 0:
                warnings.warn(
                    f"{ckpt_path} holds no swarm state (a plain Lightning checkpoint): anchors "
                    "start fresh from its weights and every island starts from rank 0's "
                    "weights and inner optimizer state. Resume from a SwarmStrategy checkpoint "
                    "for an exact restart.",
                    stacklevel=2,
                )
            return
        record = SwarmRecord.from_dict(payload, f"the swarm record of {ckpt_path}")
        check_loop_state(record, checkpoint, ckpt_path)
        use_island_loops(record, checkpoint, ckpt_path, island=island, own_pace=own_pace)
        if own_pace and island in self.island_ckpt_paths:
            _use_own_checkpoint_loops(checkpoint, self.island_ckpt_paths[island], island)
        self._pending = Source(require_local_path(ckpt_path, what="ckpt_path"), record)

    def defer_anchors(self, *, resuming: bool) -> bool:
        """Whether ``setup`` should build placeholder anchors; forgets a stale capture."""
        if not resuming:
            self._pending = None
            self.summary = None
        return self._pending is not None

    def restore(self, host: TrainingView) -> None:
        """Check and install the captured swarm state on this rank (collective); when any rank
        cannot, ``SwarmCheckpointError`` on every rank and nothing installed."""
        main = self._pending
        if main is None:
            return
        comm = host.collectives
        try:
            use_mmap, how = resolve_mmap(host.anchors.mmap)
            own = attempt(comm, lambda: choose_source(host, main, self.island_ckpt_paths))
            newest = newest_source(comm, own, main)
            loaded = attempt(comm, lambda: load_sources(host, main, own, newest, use_mmap))
            warn_legacy(loaded.legacy)
            stale = install(host, loaded)
            summary = _summary(host, main, own, loaded, how, stale)
        finally:
            self._pending = None
        if comm.rank == 0:  # one warning of the changed options that make it inexact
            residuals = any(state.get("residuals") for state in loaded.island.outer_island)
            saved = main.record
            changes = describe_changes(
                saved.options,
                host.options,
                inner_steps=saved.inner_steps,
                residuals_saved=residuals,
            )
            if changes:
                warnings.warn(
                    "resuming with options other than the checkpoint's; the run is no longer an "
                    "exact continuation: " + "; ".join(changes) + ".",
                    stacklevel=2,
                )
        self.summary = summary
        log.info("swarm resume: %s", self.summary)

    def save(self, host: TrainingView, checkpoint: dict[str, Any], filepath: Any) -> str:
        """Write the swarm files and put the record in ``checkpoint`` (collective)."""
        return save_swarm_state(host, checkpoint, filepath)

    @staticmethod
    def prune(filepath: Any, keep: str) -> None:
        """After the Lightning file names ``keep``: remove older saves (global rank 0)."""
        prune_saves(swarm_root(filepath), keep=keep)

    @staticmethod
    def discard(filepath: Any, save_id: str) -> None:
        """Remove save ``save_id``, whose Lightning file could not be written (rank 0)."""
        discard_save(swarm_root(filepath), save_id)

    @staticmethod
    def remove(filepath: Any) -> None:
        """Delete a removed checkpoint's swarm directory (global rank 0)."""
        shutil.rmtree(swarm_root(require_local_path(filepath, what="checkpoint path")), True)


def _use_own_checkpoint_loops(checkpoint: dict[str, Any], path: Path, island: int) -> None:
    # A file that cannot be read changes nothing here: the restore reads it again and refuses it
    # on every rank (only this island reads it now; a lone error would leave the others waiting).
    try:
        own = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        record = SwarmRecord.from_dict(own["swarm"], str(path))
        if record.island_loops is None:
            return  # its islands kept one step: the newest checkpoint's loop state serves
        use_island_loops(record, own, path, island=island, own_pace=True)
    except Exception:  # see above
        return
    checkpoint["loops"], checkpoint["global_step"] = own["loops"], own["global_step"]


def _summary(
    host: TrainingView, main: Source, own: Source, loaded: Loaded, how: str, stale: list[int]
) -> str:
    topology = host.topology
    if host.model_shards is not None:
        rounds, steps = main.record.outer_steps, main.record.inner_steps
        return (
            f"island {topology.island_index}, position {topology.local_index}: restored "
            f"round(s) {rounds} at inner step(s) {steps} from this rank's own files ({how})"
        )
    kib = sum(o.anchor_bytes for o in host.outer_syncs) / 2**10
    size = f"{kib / 2**10:.1f} MiB" if kib >= 2**10 else f"{kib:.1f} KiB"
    rounds, steps = own.record.outer_steps, own.record.inner_steps
    if host.loops_per_island:  # islands at their own pace: the island's own count, installed
        steps = [o.inner_steps for o in host.outer_syncs]
    legacy = ", legacy format read eagerly" if loaded.legacy else ""
    verified = "checksums verified" if host.anchors.verify else "unverified"
    caught = (
        f"caught up optimizer(s) {stale} to round(s) {loaded.newest_rounds}"
        if stale
        else "no catch-up needed"
    )
    return (
        f"island {topology.island_index}: restored round(s) {rounds} at inner step(s) "
        f"{steps}; anchors {size} ({how}{legacy}, written as {main.record.anchor_dtype}, "
        f"{verified}); {caught}"
    )
