"""Saving a swarm checkpoint: every island's file, the anchors, then the record that names them.

Collective: the file digests, or each writer's failure, are agreed (``transport.agree``), so every
rank holds the same ``SwarmRecord`` or raises the same error, and a failed save removes its files.
The caller then writes the Lightning file, last.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.tensor import DTensor

from lightning_swarm.errors import DiskFullError, SwarmCheckpointError
from lightning_swarm.resume.atomic import atomic_save, is_disk_full
from lightning_swarm.resume.compatibility import current_fingerprint
from lightning_swarm.resume.files import (
    ANCHORS_FILE,
    anchor_shard_file_name,
    begin_save,
    discard_save,
    island_file_name,
    island_rank_file_name,
    require_local_path,
    swarm_root,
)
from lightning_swarm.resume.integrity import file_digest
from lightning_swarm.resume.records import (
    AnchorsRecord,
    FileDigest,
    IslandLoops,
    IslandRecord,
    SwarmRecord,
    TotalsRecord,
    global_step,
    optimizer_steps,
)
from lightning_swarm.resume.training_view import TrainingView
from lightning_swarm.transport.agree import agree


def save_swarm_state(
    host: TrainingView,
    checkpoint: dict[str, Any],
    filepath: Any,
) -> str:
    """Write this rank's share of the swarm state and put the record in ``checkpoint["swarm"]``.

    With ``host.loops_per_island`` the record keeps every island's Lightning loop state (its
    counters are island 0's, as in the Lightning file global rank 0 writes). Returns the save
    id; the caller writes the Lightning file and then prunes older saves.
    """
    comm = host.collectives
    root = swarm_root(require_local_path(filepath, what="checkpoint path"))
    save_id = str(comm.broadcast(begin_save(root) if comm.rank == 0 else ""))
    directory = root / save_id
    written: dict[str, FileDigest] = {}
    error: SwarmCheckpointError | DiskFullError | None = None
    # A rank that failed must still reach the agreement, or the others would wait there for the
    # group's timeout: its error is raised on every rank by the agreement.
    try:
        _write_own_files(host, directory, save_id, written)
    except Exception as err:
        where = "" if host.topology.world_size == 1 else f"rank {comm.rank}: "
        error = save_failure(err, filepath, where)

    def remove_this_save() -> None:
        # Every writer is done (the gather waited for all): nothing of this save is kept, and
        # the previous save, which the existing Lightning file names, was never touched.
        for name in written:
            (directory / name).unlink(missing_ok=True)
        if comm.rank == 0:
            discard_save(root, save_id)
        # No rank raises before the files are gone: a launcher that sees one rank fail may
        # end the others at once.
        comm.barrier("swarm_save_failed")

    topology = host.topology
    own_loops = None
    if host.loops_per_island and topology.local_index == 0:
        own_loops = (topology.island_index, IslandLoops.of(checkpoint))
    agreed = agree(
        gather=comm.all_gather_object,
        error=error,
        share=(written, own_loops),
        before_raise=remove_this_save,
    )
    files: dict[str, FileDigest] = {}
    by_island: dict[int, IslandLoops] = {}
    for part, loops in agreed.shares:
        files.update(part)
        if loops is not None:
            by_island[loops[0]] = loops[1]
    island_loops = [by_island[i] for i in sorted(by_island)] if host.loops_per_island else None
    steps = (
        (island_loops[0].global_step, island_loops[0].optimizer_steps)
        if island_loops
        else (global_step(checkpoint), optimizer_steps(checkpoint))
    )
    outers = host.outer_syncs
    record = SwarmRecord(
        save_id=save_id,
        fingerprint=current_fingerprint(host),
        anchor_dtype=str(outers[0].anchor_dtype).removeprefix("torch.") if outers else None,
        outer_steps=[o.outer_steps for o in outers],
        inner_steps=[o.inner_steps for o in outers],
        files=dict(sorted(files.items())),
        options=host.options,
        # Lightning's own counters, which a resume cross-checks against the Lightning file.
        global_step=steps[0],
        optimizer_steps=steps[1],
        island_loops=island_loops,
    )
    comm.barrier("swarm_save")
    checkpoint["swarm"] = record.to_dict()
    return save_id


def write_file(directory: Path, name: str, payload: Any, written: dict[str, FileDigest]) -> None:
    """Save ``payload`` atomically as ``directory / name`` and note its digest in ``written``."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save(payload, directory / name)
    written[name] = file_digest(directory / name)


def _write_own_files(
    host: TrainingView, directory: Path, save_id: str, written: dict[str, FileDigest]
) -> None:
    """Each island's first rank writes its island file and rank 0 the anchors; with a sharded
    outer state every rank of island 0 writes its anchor shard; model-sharded islands write
    every rank's island file too, of ``to_local()`` tensors (``docs/fsdp.md``)."""
    topology, outers = host.topology, host.outer_syncs
    per_rank = host.model_shards is not None
    sharded = per_rank or any(len(o.owned) != len(o.params) for o in outers)
    # Sharded, collecting the island's state is collective over the island (every rank).
    outer_island = (
        [o.island_state_dict() for o in outers] if sharded or topology.local_index == 0 else []
    )
    if per_rank or topology.local_index == 0:
        module, optimizers = host.module.state_dict(), [o.state_dict() for o in host.optimizers]
        name = island_file_name(topology.island_index)
        if per_rank:
            module, optimizers = local_tensors(module), local_tensors(optimizers)
            name = island_rank_file_name(topology.island_index, topology.local_index)
        island = IslandRecord(
            save_id=save_id,
            island=topology.island_index,
            module=module,
            optimizers=optimizers,
            totals=TotalsRecord.of(host.totals),
            outer_island=outer_island,
        )
        write_file(directory, name, island.to_dict(), written)
    if (topology.island_index == 0 and sharded) or host.collectives.rank == 0:
        name = anchor_shard_file_name(topology.local_index) if sharded else ANCHORS_FILE
        anchors = AnchorsRecord(save_id=save_id, outer=[o.record() for o in outers])
        write_file(directory, name, anchors.to_dict(), written)


def local_tensors(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (a view; saving copies it)."""
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, Mapping):
        return {k: local_tensors(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_tensors(v) for v in state)
    return state


def save_failure(
    error: Exception, filepath: Any, where: str
) -> SwarmCheckpointError | DiskFullError:
    """The error every rank raises when ``where`` (e.g. ``"rank 3: "``, or ``""`` alone) could
    not write its part of checkpoint ``filepath`` (a swarm file, or the Lightning file);
    ``error`` is its cause. A full device gives a ``DiskFullError``."""
    text = (
        f"checkpoint {filepath} was not saved ({where}{type(error).__name__}: {error}); the "
        "files of this save were removed and the previous checkpoint is untouched."
    )
    failure = DiskFullError(text) if is_disk_full(error) else SwarmCheckpointError(text)
    failure.__cause__ = error
    return failure
