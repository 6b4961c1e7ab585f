"""``SwarmCheckpointer``: the strategy's save and restore of swarm state, without Lightning.
A capture lives until the restore that consumes it; mapped tensors are held by ``OuterSync``s."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_swarm.algorithm.model_layout import model_layout, plain_layout
from lightning_swarm.errors import DiskFullError, SwarmCheckpointError
from lightning_swarm.resume.atomic import atomic_save, is_disk_full
from lightning_swarm.resume.compatibility import current_fingerprint, union_params
from lightning_swarm.resume.files import (
    ANCHORS_FILE,
    anchor_shard_file_name,
    begin_save,
    check_writable,
    discard_save,
    island_file_name,
    island_rank_file_name,
    prune_saves,
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
    check_loop_state,
    global_step,
    optimizer_steps,
    use_island_loops,
)
from lightning_swarm.resume.restore import Source, restore_swarm_state
from lightning_swarm.resume.training_view import (
    Collectives,
    TrainingView,
    local_tensors,
    optimizer_param_names,
)
from lightning_swarm.transport.agree import agree

log = logging.getLogger("lightning_swarm")


class SwarmCheckpointer:
    """Saves and restores a swarm run's state for one strategy. ``island_ckpt_paths`` (set by
    ``SwarmResume``): islands that restore from an older checkpoint and catch up; ``summary``:
    after a restore, one line saying what this rank restored."""

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
        """Note the checkpoint a fit resumes from (its record is parsed, nothing read); put
        island ``island``'s own loop state, where saved, into ``checkpoint`` for Lightning."""
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
        try:
            summary = restore_swarm_state(host, main, self.island_ckpt_paths)
        finally:
            self._pending = None
        self.summary = summary
        log.info("swarm resume: %s", self.summary)

    def check_dirs(self, dirpaths: Iterable[Any], comm: Collectives) -> None:
        """Before training: check that every checkpoint directory in ``dirpaths`` (``None``
        entries, not resolved yet, are skipped) can be created and written on this rank
        (``check_writable``), and agree on it across ranks (collective; call it on every rank
        with the same directories): where any rank cannot, every rank raises the same
        ``SwarmCheckpointError``, naming the directory and the rank."""
        error: SwarmCheckpointError | None = None
        try:
            for dirpath in dirpaths:
                if dirpath is not None:
                    check_writable(dirpath, where=f"rank {comm.rank}: ")
        except SwarmCheckpointError as err:  # raised below, on every rank, once all checked
            error = err
        agree(gather=comm.all_gather_object, error=error)

    def save(
        self,
        host: TrainingView,
        checkpoint: dict[str, Any],
        filepath: Any,
        write_lightning: Callable[[], None],
    ) -> None:
        """Write this rank's swarm files, put the record in ``checkpoint["swarm"]``, then call
        ``write_lightning`` (global rank 0 writes the Lightning file, last). Every rank holds the
        same record or raises the same error, a failed save's files removed; once the Lightning
        file names the new save, older saves are removed."""
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
            error = _save_failure(err, filepath, where)

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
            # Pipeline stages hold different parameters: the record lists every rank's.
            share=(written, own_loops, current_fingerprint(host)["params"]),
            before_raise=remove_this_save,
        )
        record = _record(host, checkpoint, save_id, agreed.shares)
        comm.barrier("swarm_save")
        checkpoint["swarm"] = record.to_dict()
        error = None
        try:
            write_lightning()
        except Exception as err:  # raised below, on every rank, once the others know
            where = "" if topology.world_size == 1 else f"global rank {comm.rank}: "
            error = _save_failure(err, filepath, where)
        # Global rank 0 wrote (or failed to write) the Lightning file; every rank learns it. A
        # failed one names no new swarm file: they go, the previous checkpoint untouched.
        agree(gather=comm.all_gather_object, error=error, before_raise=remove_this_save)
        if comm.rank == 0:
            # Only now does the Lightning file name the new save; older ones can go.
            prune_saves(root, keep=save_id)


def _record(
    host: TrainingView, checkpoint: dict[str, Any], save_id: str, shares: Sequence[Any]
) -> SwarmRecord:
    """The save's record, from every rank's (file digests, island loop state)."""
    files: dict[str, FileDigest] = {}
    by_island: dict[int, IslandLoops] = {}
    for part, loops, _ in shares:
        files.update(part)
        if loops is not None:
            by_island[loops[0]] = loops[1]
    island_loops = [by_island[i] for i in sorted(by_island)] if host.loops_per_island else None
    steps = (
        (island_loops[0].global_step, optimizer_steps({"loops": island_loops[0].loops}))
        if island_loops
        else (global_step(checkpoint), optimizer_steps(checkpoint))
    )
    outers = host.outer_syncs
    return SwarmRecord(
        save_id=save_id,
        fingerprint={**current_fingerprint(host), "params": union_params([s[2] for s in shares])},
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
        name, module_layout = island_file_name(topology.island_index), None
        if per_rank:
            module_layout = plain_layout(model_layout(module))  # before the DTensors go local
            module, optimizers = local_tensors(module), local_tensors(optimizers)
            name = island_rank_file_name(topology.island_index, topology.local_index)
        island = IslandRecord(
            save_id=save_id,
            island=topology.island_index,
            module=module,
            optimizers=optimizers,
            totals=TotalsRecord.of(host.totals),
            outer_island=outer_island,
            module_layout=module_layout,
            optimizer_params=[optimizer_param_names(o, host.module) for o in host.optimizers],
        )
        write_file(directory, name, island.to_dict(), written)
    if (topology.island_index == 0 and sharded) or host.collectives.rank == 0:
        name = anchor_shard_file_name(topology.local_index) if sharded else ANCHORS_FILE
        anchors = AnchorsRecord(save_id=save_id, outer=[o.record() for o in outers])
        write_file(directory, name, anchors.to_dict(), written)


def _save_failure(
    error: Exception, filepath: Any, where: str
) -> SwarmCheckpointError | DiskFullError:
    """The error every rank raises when ``where`` (``"rank 3: "`` or ``""``) could not write its
    part of checkpoint ``filepath``, caused by ``error`` (a full device: ``DiskFullError``)."""
    text = (
        f"checkpoint {filepath} was not saved ({where}{type(error).__name__}: {error}); the "
        "files of this save were removed and the previous checkpoint is untouched."
    )
    failure = DiskFullError(text) if is_disk_full(error) else SwarmCheckpointError(text)
    failure.__cause__ = error
    return failure
