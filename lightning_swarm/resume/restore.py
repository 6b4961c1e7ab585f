"""Restoring a swarm checkpoint: check everything, agree on every rank, then install.
Every rank runs the same collectives, failures included; a catch-up's old anchors are dropped
right after it."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_swarm.algorithm.diloco import catch_up_
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.compatibility import (
    compare_fingerprints,
    current_fingerprint,
    describe_changes,
    refuse_unusable,
)
from lightning_swarm.resume.files import (
    ANCHORS_FILE,
    anchor_shard_file_name,
    anchor_shard_names,
    island_file_name,
    island_rank_file_name,
    load_swarm_file,
    require_local_path,
    resolve_mmap,
    swarm_root,
    warn_legacy,
)
from lightning_swarm.resume.integrity import check_file, check_finite
from lightning_swarm.resume.records import AnchorsRecord, IslandRecord, SwarmRecord, merge_shards
from lightning_swarm.resume.reshard import Resharded, needs_reshard, reshard, saved_layout_text
from lightning_swarm.resume.training_view import Collectives, TrainingView, local_tensors
from lightning_swarm.transport.agree import agree

_T = TypeVar("_T")


@dataclass(frozen=True)
class Source:
    """Where one island's state comes from: a Lightning file and its swarm record."""

    ckpt_path: Path
    record: SwarmRecord

    @property
    def directory(self) -> Path:
        return swarm_root(os.path.realpath(self.ckpt_path)) / self.record.save_id


@dataclass
class Loaded:
    """Everything a rank installs, checked; ``legacy`` files were read eagerly."""

    island: IslandRecord
    own_anchors: AnchorsRecord
    newest: AnchorsRecord
    newest_rounds: list[int]
    legacy: list[Path]


def restore_swarm_state(host: TrainingView, main: Source, island_paths: Mapping[int, Path]) -> str:
    """Check and install ``main`` (and ``island_paths``) on this rank; returns the summary.
    When any rank cannot, ``SwarmCheckpointError`` on every rank, nothing installed."""
    comm = host.collectives
    use_mmap, how = resolve_mmap(host.anchors.mmap)
    own = attempt(host, lambda: choose_source(host, main, island_paths))
    moved: Resharded | None = None
    if needs_reshard(main.record.fingerprint, current_fingerprint(host)):
        # The same decision on every rank: it reads the shared record and this run's layout.
        moved = attempt(host, lambda: load_resharded(host, main, use_mmap))
        loaded = Loaded(
            moved.island, moved.anchors, moved.anchors, list(own.record.outer_steps), []
        )
    else:
        newest = newest_source(comm, own, main)
        loaded = attempt(host, lambda: load_sources(host, main, own, newest, use_mmap))
    warn_legacy(loaded.legacy)
    stale = install(host, loaded)
    if moved is None:
        summary = _summary(host, main, own, loaded, how, stale)
    else:
        summary = _reshard_summary(host, main, moved, how)
        if comm.rank == 0:
            warn_islands(main.record, host.topology.num_islands)
    if comm.rank == 0:  # one warning of the changed options that make it inexact
        residuals = any(state.get("residuals") for state in loaded.island.outer_island)
        saved = main.record
        changes = describe_changes(
            saved.options, host.options, inner_steps=saved.inner_steps, residuals_saved=residuals
        )
        if changes:
            warnings.warn(
                "resuming with options other than the checkpoint's; the run is no longer an "
                "exact continuation: " + "; ".join(changes) + ".",
                stacklevel=3,
            )
    return summary


def choose_source(host: TrainingView, main: Source, island_paths: Mapping[int, Path]) -> Source:
    """This island's source, after checking ``main`` and ``island_paths`` against this run."""
    if host.model_shards is not None and island_paths:
        raise SwarmCheckpointError(
            "SwarmResume(island_ckpt_paths=...) is not supported with island_parallel='fsdp' "
            "yet; resume every island from ckpt_path."
        )
    num_islands = host.topology.num_islands
    bad = sorted(i for i in island_paths if not 0 <= i < num_islands)
    if bad:
        raise SwarmCheckpointError(
            f"SwarmResume(island_ckpt_paths=...) names island(s) {bad}, but this run has "
            f"{num_islands} island(s), numbered 0 .. {num_islands - 1}; fix the keys of "
            "island_ckpt_paths."
        )
    current = current_fingerprint(host)
    compare_fingerprints(main.record.fingerprint, current)
    refuse_unusable(main.record.options, host.options)
    if needs_reshard(main.record.fingerprint, current):
        refuse_reshard(host, main, island_paths, current)
    island = host.topology.island_index
    if island not in island_paths:
        return main
    path = require_local_path(island_paths[island], what="island_ckpt_paths entry")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise SwarmCheckpointError(
            f"island {island}'s checkpoint {path} cannot be read ({err}); fix "
            "island_ckpt_paths or resume that island from the main checkpoint."
        ) from err
    record = SwarmRecord.of(ckpt, f"the swarm record of {path}")
    if record is None:
        raise SwarmCheckpointError(
            f"island {island}'s checkpoint {path} holds no swarm state; give "
            "island_ckpt_paths a checkpoint written by SwarmStrategy."
        )
    compare_fingerprints(record.fingerprint, current)
    return Source(path, record)


def refuse_reshard(
    host: TrainingView, main: Source, island_paths: Mapping[int, Path], current: Mapping[str, Any]
) -> None:
    """Refuse, by name, a move to another layout this resume cannot make."""
    move = f"{saved_layout_text(main.record.fingerprint)} to {saved_layout_text(current)}"
    if island_paths:
        raise SwarmCheckpointError(
            f"{main.ckpt_path} was written by {move.replace(' to ', ', this run has ')}: a "
            "move to another layout restores every island from ckpt_path, not from "
            "SwarmResume(island_ckpt_paths=...). Resume on the saving layout to catch the "
            "islands up, save, then change the layout."
        )
    if host.loops_per_island:
        raise SwarmCheckpointError(
            f"{main.ckpt_path}: moving from {move} is not supported under a time budget "
            "(sync_every_s), whose islands keep their own loop state. Resume with the layout "
            "the checkpoint was written by."
        )


def load_resharded(host: TrainingView, main: Source, use_mmap: bool) -> Resharded:
    """This rank's state from a save of another layout (``resume.reshard``), files checked."""
    legacy: list[Path] = []
    read = partial(read_file, main, verify=host.anchors.verify, use_mmap=use_mmap, legacy=legacy)
    moved = reshard(host, main.record, main.directory, read)
    check_island(host, moved.island, main.directory)
    check_outer_states(host, moved.anchors, str(main.directory))
    return moved


def warn_islands(record: SwarmRecord, num_islands: int) -> None:
    """One warning when the island count changed: what departed islands lose, what new ones
    start from."""
    saved = int(record.fingerprint.get("num_islands", 0))
    rounds, steps = record.outer_steps, record.inner_steps
    if num_islands < saved:
        warnings.warn(
            f"the checkpoint has {saved} islands, this run {num_islands}: island(s) "
            f"{list(range(num_islands, saved))} are dropped with their progress since the last "
            f"round (applied rounds {rounds}, inner steps {steps}) and their inner optimizer "
            "state.",
            stacklevel=3,
        )
    elif num_islands > saved:
        warnings.warn(
            f"the checkpoint has {saved} islands, this run {num_islands}: new island(s) "
            f"{list(range(saved, num_islands))} start from the anchors of round(s) {rounds} "
            "with island 0's inner optimizer state.",
            stacklevel=3,
        )


def newest_source(comm: Collectives, own: Source, main: Source) -> tuple[list[int], str]:
    """The most advanced rounds among all islands' sources, and that source's path (ties go to
    the main checkpoint, so every rank picks the same)."""
    mine = (list(own.record.outer_steps), str(own.ckpt_path))
    everyone = comm.all_gather_object(mine)
    rounds, path = max(everyone, key=lambda item: (tuple(item[0]), item[1] == str(main.ckpt_path)))
    return list(rounds), str(path)


def load_sources(
    host: TrainingView, main: Source, own: Source, newest: tuple[list[int], str], use_mmap: bool
) -> Loaded:
    """Read, check and validate every file this rank installs from."""
    island, position = host.topology.island_index, host.topology.local_index
    per_rank = host.model_shards is not None
    legacy: list[Path] = []
    verify = host.anchors.verify
    read = partial(read_file, verify=verify, use_mmap=use_mmap, legacy=legacy)

    def read_anchors(source: Source) -> tuple[AnchorsRecord, str]:
        # The save's anchors (its shards merged) and how messages name them.
        shards = anchor_shard_names(source.record.files)
        names = [anchor_shard_file_name(position)] if per_rank else shards or [ANCHORS_FILE]
        records = []
        for name in names:
            path = source.directory / name
            record = AnchorsRecord.from_dict(read(source, name), str(path))
            if verify:
                # Per file, before a merge loses which shard holds a value.
                for state in record.outer:
                    check_finite(dict(state.anchors), source=path, what="an anchor")
            records.append(record)
        if per_rank or not shards:
            return records[0], str(source.directory / names[0])
        merged = merge_shards(records, str(source.directory))
        return merged, str(source.directory / "anchors-rank-*.pt")

    name = island_rank_file_name(island, position) if per_rank else island_file_name(island)
    island_path = own.directory / name
    island_state = IslandRecord.from_dict(read(own, name), str(island_path))
    own_anchors, own_label = read_anchors(own)
    newest_rounds, newest_path = newest
    newest_anchors, newest_label = own_anchors, own_label
    if newest_path != str(own.ckpt_path):
        # Every island must reach the newest source (shared filesystem, as for ckpt_path).
        if newest_path != str(main.ckpt_path):
            raise SwarmCheckpointError(
                f"island_ckpt_paths holds a newer island state than ckpt_path: {newest_path} "
                f"is at outer round(s) {newest_rounds}, ckpt_path {main.ckpt_path} at "
                f"{main.record.outer_steps}. Lightning restores its loops and the other "
                "islands from ckpt_path: pass the newest checkpoint as ckpt_path and the "
                "older ones of the islands that are behind in island_ckpt_paths."
            )
        newest_anchors, newest_label = read_anchors(main)
    # Everything ``install`` relies on, so that it cannot fail half-way.
    check_island(host, island_state, island_path)
    if newest_anchors is not own_anchors:
        # Only the anchors of the island's own, older save are used (by the catch-up).
        check_outer_states(host, own_anchors, own_label, anchors_only=True)
    check_outer_states(host, newest_anchors, newest_label)
    if verify:
        what = "the module shard" if per_rank else "the island's module state"
        check_finite(island_state.module, source=island_path, what=what)
    return Loaded(island_state, own_anchors, newest_anchors, newest_rounds, legacy)


def read_file(
    source: Source, name: str, *, verify: bool, use_mmap: bool, legacy: list[Path]
) -> dict[str, Any]:
    """File ``name`` of ``source``'s save, checked against its record and save id; its path
    joins ``legacy`` when it was in torch's legacy format."""
    path = source.directory / name
    files = source.record.files
    if name not in files:
        raise SwarmCheckpointError(
            f"{source.ckpt_path} records no file {name}; the save is incomplete, was written "
            "by another layout or the directory was mixed up. Resume from another checkpoint."
        )
    if path.is_file():
        check_file(path, files[name], verify=verify)
    payload, was_legacy = load_swarm_file(path, mmap=use_mmap)
    if was_legacy:
        legacy.append(path)
    if payload.get("save_id") != source.record.save_id:
        raise SwarmCheckpointError(
            f"{path} belongs to another save than {source.ckpt_path}; the directory was mixed "
            "up. Resume from another checkpoint."
        )
    return payload


def check_island(host: TrainingView, island: IslandRecord, path: Path) -> None:
    """``island`` (from ``path``) is this island's and fits this rank's module and optimizers."""
    index = host.topology.island_index
    if island.island != index:
        raise SwarmCheckpointError(
            f"{path} says it holds island {island.island}, not {index}; the directory was "
            "tampered with. Resume from another checkpoint."
        )
    module = {k: tuple(v.shape) for k, v in local_tensors(host.module.state_dict()).items()}
    saved = {k: tuple(v.shape) for k, v in island.module.items()}
    if module != saved:
        differ = sorted(k for k in module.keys() | saved.keys() if module.get(k) != saved.get(k))
        raise SwarmCheckpointError(
            f"{path}: the saved module state does not fit this model (entries {differ[:5]} "
            "differ); resume with the model and layout the checkpoint was written by."
        )
    if len(island.optimizers) != len(host.optimizers):
        raise SwarmCheckpointError(
            f"{path} holds {len(island.optimizers)} optimizer states, this run has "
            f"{len(host.optimizers)} optimizers; use the same configure_optimizers."
        )


def check_outer_states(
    host: TrainingView, record: AnchorsRecord, path: str, *, anchors_only: bool = False
) -> None:
    """Each saved outer state against its sync (``OuterSync.check_state_dict``), or only its
    anchors; an error names ``path``."""
    syncs = host.outer_syncs
    if len(record.outer) != len(syncs):
        raise SwarmCheckpointError(
            f"{path} holds {len(record.outer)} anchor sets for {len(syncs)} "
            "optimizers; resume from another checkpoint."
        )
    for index, (outer, state) in enumerate(zip(syncs, record.outer, strict=True)):
        try:
            if anchors_only:
                outer.check_anchors(state.anchors)
            else:
                outer.check_state_dict(state)
        except SwarmCheckpointError as err:
            where = path if len(syncs) == 1 else f"{path} (optimizer {index})"
            raise SwarmCheckpointError(f"{where}: {err}") from err


def install(host: TrainingView, loaded: Loaded) -> list[int]:
    """Install checked state on this rank: module, catch-up, inner optimizer states (on the
    module's device, ``step`` left put), outer states, residuals, totals. Returns the
    optimizers caught up."""
    island = loaded.island
    if host.model_shards is not None:
        with torch.no_grad():
            for name, target in local_tensors(host.module.state_dict()).items():
                target.copy_(island.module[name])
    else:
        host.module.load_state_dict(island.module, strict=True)
    stale: list[int] = []
    own_rounds = [s.counters.outer_steps for s in loaded.own_anchors.outer]
    for index, outer in enumerate(host.outer_syncs):
        if own_rounds[index] < loaded.newest_rounds[index]:
            stale.append(index)
            old = loaded.own_anchors.outer[index].anchors
            new = loaded.newest.outer[index].anchors
            for name, p in outer.params.items():
                catch_up_(p.data, old[name], new[name])
    # The old anchors were needed for the catch-up only.
    loaded.own_anchors = AnchorsRecord(loaded.own_anchors.save_id, [])
    for optimizer, saved in zip(host.optimizers, island.optimizers, strict=True):
        optimizer.load_state_dict(saved)
        for state in optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(host.device)
        if host.model_shards is not None:
            _shard_optimizer_state(optimizer)
    for outer, outer_state in zip(host.outer_syncs, loaded.newest.outer, strict=True):
        outer.load_checked_state_dict(outer_state)  # checked before anything was installed
    for outer, island_state in zip(host.outer_syncs, island.outer_island, strict=False):
        outer.load_island_state_dict(island_state)
    island.totals.install(host.totals)
    return stale


def _shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Turn each restored local state tensor back into a DTensor like its parameter (same mesh,
    placements, global shape and stride: shards may be uneven, so these are given)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            local_shape = param.to_local().shape
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                plain = isinstance(value, Tensor) and not isinstance(value, DTensor)
                if plain and value.dim() > 0 and value.shape == local_shape:
                    state[key] = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )


def attempt(host: TrainingView, step: Callable[[], _T]) -> _T:
    """Run ``step`` on every rank; if it failed on any rank, raise ``SwarmCheckpointError`` on
    all of them, naming the lowest failing rank and why."""
    result: _T | None = None
    error: SwarmCheckpointError | None = None
    try:
        result = step()
    except Exception as err:  # any failure must reach the other ranks, or they would hang
        why = str(err) if isinstance(err, SwarmCheckpointError) else f"{type(err).__name__}: {err}"
        where = "" if host.topology.world_size == 1 else f"rank {host.collectives.rank}: "
        error = SwarmCheckpointError(f"cannot resume the swarm state: {where}{why}")
        error.__cause__ = err
    agree(gather=host.collectives.all_gather_object, error=error)
    assert result is not None
    return result


def _reshard_summary(host: TrainingView, main: Source, moved: Resharded, how: str) -> str:
    topology, record = host.topology, main.record
    current = current_fingerprint(host)
    source = "the anchors (a new island)" if moved.new_island else f"island {topology.island_index}"
    mib = moved.copied_bytes / 2**20
    where = "a file-backed scratch mapping" if moved.file_backed else "memory"
    return (
        f"island {topology.island_index}, position {topology.local_index}: moved from "
        f"{saved_layout_text(record.fingerprint)} to {saved_layout_text(current)}; restored "
        f"round(s) {record.outer_steps} at inner step(s) {record.inner_steps} from {source} "
        f"({how}; anchor and outer state slices: {mib:.1f} MiB copied into {where}, the rest "
        "views of the saved files)"
    )


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
