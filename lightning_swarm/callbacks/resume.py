"""Exact resume of a swarm run: save every island's state, restore it, catch stale islands up.

Saving (``save_swarm_state``, called by ``SwarmStrategy.save_checkpoint`` on every rank):
one rank per island (its first) writes ``island-NNNNN.pt`` with the island's module state,
inner optimizer states and counters; global rank 0 writes ``anchors.pt`` (anchors, outer
optimizer state, counters, layout fingerprint); after a barrier the Lightning file, which names
the save directory, is written last. Layout and atomicity: ``lightning_swarm.checkpoint``.

Restoring (``SwarmResume``): the strategy hands the loaded Lightning dict to ``capture`` (before
``setup``, so the strategy can build memory-less placeholder anchors), then calls ``restore``
from ``load_optimizer_state_dict`` -- after setup and after Lightning loaded rank 0's optimizer
state, before any training or sanity check. ``restore`` loads and validates everything first
(fingerprint, files, shapes), agrees with every rank that nothing failed, and only then
installs: a bad checkpoint aborts the fit on every rank and nothing half-loaded is trained on.

Mapped tensors are held by the ``OuterSync`` objects only, never in callback state (Lightning
deep-copies callback state on load); this callback's ``state_dict`` is empty.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_swarm.algorithm.catchup import catch_up_
from lightning_swarm.checkpoint import (
    ANCHORS_FILE,
    FORMAT_VERSION,
    SwarmCheckpointError,
    atomic_save,
    check_anchor_shapes,
    compare_fingerprints,
    island_file_name,
    layout_fingerprint,
    load_swarm_file,
    remove_orphan_saves,
    require_local_path,
    resolve_mmap,
    swarm_root,
    warn_legacy,
)

if TYPE_CHECKING:
    from lightning_swarm.strategy import SwarmStrategy

log = logging.getLogger("lightning_swarm")
_T = TypeVar("_T")


def current_fingerprint(strategy: SwarmStrategy) -> dict[str, Any]:
    return layout_fingerprint(
        strategy.topology.num_islands,
        [o.params for o in strategy.outer_syncs],
        fragments=_fragment_fingerprint(strategy),
    )


def _fragment_fingerprint(strategy: SwarmStrategy) -> dict[str, Any] | None:
    """Streaming DiLoCo's layout and schedule; ``None`` for plain DiLoCo (older saves too).

    A round in flight is applied at ``send_step + sync_delay`` to the fragment it was sent for,
    so a resume needs the same fragments, ``sync_every`` and ``sync_delay``.
    """
    config = strategy.config
    if config.num_fragments == 1 and config.sync_delay == 0:
        return None
    return {
        "sync_every": config.sync_every,
        "sync_delay": config.sync_delay,
        "layout": [o.fragments for o in strategy.outer_syncs],
    }


# -- saving -----------------------------------------------------------------------------------
def save_swarm_state(strategy: SwarmStrategy, checkpoint: dict[str, Any], filepath: Any) -> str:
    """Write this rank's share of the swarm state and add the record to ``checkpoint``.

    Collective: every rank calls it. Returns the save id; the caller writes the Lightning file
    and then prunes older save directories (``prune_saves``). Global rank 0 first removes the
    swarm directories of saves that crashed before their Lightning file was written (any
    ``<name>.swarm`` next to this checkpoint whose ``<name>`` does not exist).
    """
    root = swarm_root(require_local_path(filepath, what="checkpoint path"))
    if strategy.global_rank == 0:
        for orphan in remove_orphan_saves(root.parent, keep=root):
            log.info("removed %s: its checkpoint file was never written (interrupted save)", orphan)
    save_id = strategy.broadcast(uuid.uuid4().hex[:12] if strategy.global_rank == 0 else "")
    directory = root / save_id
    topology, outers = strategy.topology, strategy.outer_syncs
    record = {
        "format": FORMAT_VERSION,
        "save_id": save_id,
        "fingerprint": current_fingerprint(strategy),
        "anchor_dtype": str(outers[0].anchor_dtype).removeprefix("torch.") if outers else None,
        "outer_steps": [o.outer_steps for o in outers],
        "inner_steps": [o.inner_steps for o in outers],
    }
    if topology.local_index == 0:
        directory.mkdir(parents=True, exist_ok=True)
        module = strategy.lightning_module
        assert module is not None
        island_state = {
            **record,
            "island": topology.island_index,
            "module": module.state_dict(),
            "optimizers": [opt.state_dict() for opt in strategy.optimizers],
            "totals": dict(vars(strategy.totals)),
            # Error-feedback residuals differ per island, like the inner optimizer state.
            "outer_island": [o.island_state_dict() for o in outers],
        }
        atomic_save(island_state, directory / island_file_name(topology.island_index))
        if strategy.global_rank == 0:
            anchors_state = {**record, "outer": [o.state_dict() for o in outers]}
            atomic_save(anchors_state, directory / ANCHORS_FILE)
    strategy.barrier("swarm_save")
    checkpoint["swarm"] = record
    return save_id


def remove_swarm_state(filepath: Any) -> None:
    """Delete the swarm directory of a Lightning checkpoint (ModelCheckpoint's top-k pruning)."""
    shutil.rmtree(swarm_root(require_local_path(filepath, what="checkpoint path")), True)


# -- restoring --------------------------------------------------------------------------------
@dataclass
class _Source:
    """Where one island's state comes from: a Lightning file and its swarm record."""

    ckpt_path: Path
    record: dict[str, Any]

    @property
    def directory(self) -> Path:
        return swarm_root(os.path.realpath(self.ckpt_path)) / str(self.record["save_id"])


@dataclass
class _Loaded:
    island: dict[str, Any]
    own_anchors: dict[str, Any]
    newest: dict[str, Any]
    newest_rounds: list[int]
    legacy: list[Path] = field(default_factory=list)


class SwarmResume(pl.Callback):
    """Restores anchors, outer state and each island's own state; catches stale islands up.

    Added by ``SwarmStrategy`` when the trainer has none. Add one yourself to choose a different
    checkpoint for some islands (a rejoining island whose newest save is older than its peers').

    Args:
        island_ckpt_paths: optional ``{island_index: ckpt_path}``; those islands restore their
            local parameters and inner optimizer state from that (older) checkpoint and are
            rebased onto the newest anchors among all islands (catch-up).

    Attributes:
        summary: after a restore, one line saying what this rank restored.
    """

    def __init__(self, island_ckpt_paths: Mapping[int, str | os.PathLike[str]] | None = None):
        self.island_ckpt_paths = {int(k): Path(v) for k, v in (island_ckpt_paths or {}).items()}
        self.summary: str | None = None
        self._pending: _Source | None = None

    @property
    def pending(self) -> bool:
        """A swarm checkpoint was loaded and its state is not installed yet."""
        return self._pending is not None

    def capture(self, ckpt_path: Any, checkpoint: Mapping[str, Any]) -> None:
        """Note the checkpoint being resumed (called by the strategy right after loading it)."""
        self.summary = None
        record = checkpoint.get("swarm")
        if record is None:
            self._pending = None
            rank_zero_warn(
                f"{ckpt_path} holds no swarm state (a plain Lightning checkpoint): anchors start "
                "fresh from its weights and every island starts from rank 0's weights and inner "
                "optimizer state. Resume from a SwarmStrategy checkpoint for an exact restart."
            )
            return
        if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
            raise SwarmCheckpointError(
                f"{ckpt_path} has swarm state of an unknown format; resume with the "
                "lightning_swarm version that wrote it."
            )
        path = require_local_path(ckpt_path, what="ckpt_path")
        self._pending = _Source(path, record)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls this before it loads a checkpoint: forget whatever an earlier fit on
        # this Trainer captured, so a fit without ckpt_path never restores someone else's save.
        self._pending = None
        self.summary = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Safety net: the strategy restores in load_optimizer_state_dict; never train unrestored.
        if self._pending is not None:
            self.restore(trainer.strategy)  # type: ignore[arg-type]

    def restore(self, strategy: SwarmStrategy) -> None:
        """Validate and install the captured swarm state on this rank (collective).

        The captured checkpoint is consumed whether or not this succeeds: after a failure the
        next fit restores only what its own ``ckpt_path`` names.
        """
        source = self._pending
        if source is None:
            return
        try:
            use_mmap, how = resolve_mmap(strategy.config.anchors.mmap)
            # Every collective below runs on every rank in the same order, failures included.
            own = _attempt(lambda: self._own_source(strategy, source))
            newest = _newest(own, source)
            loaded = _attempt(lambda: self._load(strategy, source, own, newest, use_mmap))
            warn_legacy(loaded.legacy)
            stale = self._install(strategy, loaded)
        finally:
            self._pending = None
        kib = sum(o.anchor_bytes for o in strategy.outer_syncs) / 2**10
        size = f"{kib / 2**10:.1f} MiB" if kib >= 2**10 else f"{kib:.1f} KiB"
        dtype = source.record.get("anchor_dtype")
        self.summary = (
            f"island {strategy.topology.island_index}: restored round(s) "
            f"{loaded.island['outer_steps']} at inner step(s) {loaded.island['inner_steps']}; "
            f"anchors {size} ({how}{', legacy format read eagerly' if loaded.legacy else ''}"
            f", written as {dtype}); "
            + (
                f"caught up optimizer(s) {stale} to round(s) {loaded.newest_rounds}"
                if stale
                else "no catch-up needed"
            )
        )
        log.info("SwarmResume: %s", self.summary)
        rank_zero_info(f"SwarmResume: {self.summary}")

    def _own_source(self, strategy: SwarmStrategy, main: _Source) -> _Source:
        compare_fingerprints(main.record["fingerprint"], current_fingerprint(strategy))
        island = strategy.topology.island_index
        if island not in self.island_ckpt_paths:
            return main
        path = require_local_path(self.island_ckpt_paths[island], what="island_ckpt_paths entry")
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:
            raise SwarmCheckpointError(
                f"island {island}'s checkpoint {path} cannot be read ({err}); fix "
                "island_ckpt_paths or resume that island from the main checkpoint."
            ) from err
        record = ckpt.get("swarm") if isinstance(ckpt, dict) else None
        if record is None:
            raise SwarmCheckpointError(
                f"island {island}'s checkpoint {path} holds no swarm state; give "
                "island_ckpt_paths a checkpoint written by SwarmStrategy."
            )
        compare_fingerprints(record["fingerprint"], current_fingerprint(strategy))
        return _Source(path, record)

    def _load(
        self,
        strategy: SwarmStrategy,
        main: _Source,
        own: _Source,
        newest_source: tuple[list[int], str],
        use_mmap: bool,
    ) -> _Loaded:
        island = strategy.topology.island_index
        legacy: list[Path] = []

        def read(source: _Source, name: str) -> dict[str, Any]:
            path = source.directory / name
            payload, was_legacy = load_swarm_file(path, mmap=use_mmap)
            if was_legacy:
                legacy.append(path)
            if payload.get("save_id") != source.record["save_id"]:
                raise SwarmCheckpointError(
                    f"{path} belongs to another save than {source.ckpt_path}; the directory was "
                    "mixed up. Resume from another checkpoint."
                )
            return payload

        island_state = read(own, island_file_name(island))
        own_anchors = read(own, ANCHORS_FILE)
        newest_rounds, newest_path = newest_source
        newest = own_anchors
        if newest_path != str(own.ckpt_path):
            # Every island must reach the newest source (shared filesystem, as for ckpt_path).
            if newest_path != str(main.ckpt_path):
                raise SwarmCheckpointError(
                    f"the newest island state is in {newest_path}, which island {island} does "
                    "not know; pass the newest checkpoint as ckpt_path."
                )
            newest = read(main, ANCHORS_FILE)
        _validate(strategy, island_state, own_anchors, newest, own.directory)
        return _Loaded(island_state, own_anchors, newest, newest_rounds, legacy)

    def _install(self, strategy: SwarmStrategy, loaded: _Loaded) -> list[int]:
        module = strategy.lightning_module
        assert module is not None
        module.load_state_dict(loaded.island["module"], strict=True)
        stale: list[int] = []
        own_rounds = list(loaded.island["outer_steps"])
        for index, outer in enumerate(strategy.outer_syncs):
            if own_rounds[index] < loaded.newest_rounds[index]:
                stale.append(index)
                old = loaded.own_anchors["outer"][index]["anchors"]
                new = loaded.newest["outer"][index]["anchors"]
                for name, p in outer.params.items():
                    catch_up_(p.data, old[name], new[name])
        # The old anchors were needed for the catch-up only.
        loaded.own_anchors = {}
        for optimizer, state in zip(strategy.optimizers, loaded.island["optimizers"], strict=True):
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, strategy.root_device)
        for outer, state in zip(strategy.outer_syncs, loaded.newest["outer"], strict=True):
            outer.load_state_dict(state)
        for outer, own in zip(
            strategy.outer_syncs, loaded.island.get("outer_island", []), strict=False
        ):
            outer.load_island_state_dict(own)
        for key, value in loaded.island.get("totals", {}).items():
            if hasattr(strategy.totals, key):
                setattr(strategy.totals, key, value)
        return stale


def _newest(own: _Source, main: _Source) -> tuple[list[int], str]:
    """The most advanced rounds among all islands' sources, and that source's path.

    Ties go to the main checkpoint, so every rank picks the same source.
    """
    mine = (list(own.record["outer_steps"]), str(own.ckpt_path))
    everyone: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    rounds, path = max(everyone, key=lambda item: (tuple(item[0]), item[1] == str(main.ckpt_path)))
    return list(rounds), str(path)


def _validate(
    strategy: SwarmStrategy,
    island: Mapping[str, Any],
    own_anchors: Mapping[str, Any],
    newest: Mapping[str, Any],
    directory: Path,
) -> None:
    index = strategy.topology.island_index
    if island.get("island") != index:
        raise SwarmCheckpointError(
            f"{directory / island_file_name(index)} says it holds island {island.get('island')}, "
            f"not {index}; the directory was tampered with. Resume from another checkpoint."
        )
    module = strategy.lightning_module
    assert module is not None
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in island["module"].items()}
    if expected != saved:
        differ = sorted(
            k for k in expected.keys() | saved.keys() if expected.get(k) != saved.get(k)
        )
        raise SwarmCheckpointError(
            f"island {index}'s saved module state does not fit this model (entries {differ[:5]} "
            "differ); resume with the model the checkpoint was written by."
        )
    if len(island["optimizers"]) != len(strategy.optimizers):
        raise SwarmCheckpointError(
            f"island {index}'s file holds {len(island['optimizers'])} optimizer states, this run "
            f"has {len(strategy.optimizers)} optimizers; use the same configure_optimizers."
        )
    for payload in (own_anchors, newest):
        outer_states = payload["outer"]
        if len(outer_states) != len(strategy.outer_syncs):
            raise SwarmCheckpointError(
                f"{directory / ANCHORS_FILE} holds {len(outer_states)} anchor sets for "
                f"{len(strategy.outer_syncs)} optimizers; resume from another checkpoint."
            )
        for outer, state in zip(strategy.outer_syncs, outer_states, strict=True):
            check_anchor_shapes(state["anchors"], outer.params, source=directory / ANCHORS_FILE)


def _attempt(step: Callable[[], _T]) -> _T:
    """Run ``step`` on every rank; if it failed on any rank, raise on all of them."""
    result: _T | None = None
    error: str | None = None
    try:
        result = step()
    except SwarmCheckpointError as err:
        error = str(err)
    except Exception as err:  # any failure must reach the other ranks, or they would hang
        error = f"{type(err).__name__}: {err}"
    _agree(error)
    assert result is not None
    return result


def _agree(error: str | None) -> None:
    """Raise on every rank if any rank failed to load, so no rank waits forever on another."""
    errors = [error]
    if dist.is_available() and dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        where = "" if len(errors) == 1 else f"rank {rank}: "
        raise SwarmCheckpointError(f"cannot resume the swarm state: {where}{message}")
