"""Per-rank swarm files for model-sharded islands (``island_parallel="fsdp"``).

Every rank writes ``island-IIIII-rank-PPPPP.pt``, and island 0's ranks ``anchors-rank-PPPPP.pt``,
as ``to_local()`` tensors. Not ``torch.distributed.checkpoint``: it deduplicates (FQN, offset)
across its group and would keep one island. A rank touches only its own files; another mesh is
refused naming both; nothing is installed unless every rank checked its files.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.files import anchor_shard_file_name
from lightning_swarm.resume.fingerprint import compare_fingerprints
from lightning_swarm.resume.integrity import check_finite
from lightning_swarm.resume.option_changes import refuse_unusable
from lightning_swarm.resume.records import AnchorsRecord, FileDigest, IslandRecord, TotalsRecord
from lightning_swarm.resume.restore import (
    Source,
    attempt,
    check_island,
    check_outer_states,
    install_states,
    read_file,
)
from lightning_swarm.resume.save import current_fingerprint, save_swarm_state, write_file
from lightning_swarm.resume.training_view import TrainingView

MESH_KEY = "island_mesh"


def island_rank_file_name(island: int, position: int) -> str:
    return f"island-{island:05d}-rank-{position:05d}.pt"


def mesh_fingerprint(host: TrainingView) -> dict[str, Any]:
    """``current_fingerprint`` with global shapes (equal on every rank) and the island mesh."""
    shards = host.model_shards
    assert shards is not None, "a per-rank save needs a model-sharded view"
    fingerprint = current_fingerprint(host, shards.global_shapes)
    fingerprint[MESH_KEY] = dict(shards.mesh)
    return fingerprint


def check_layout(
    saved: Mapping[str, Any], mesh: Mapping[str, int] | None, num_islands: int
) -> None:
    """Refuse a resume across DDP and model-sharded islands, or onto another island mesh.

    ``saved`` is the checkpoint's fingerprint, ``mesh`` this run's island mesh (None: DDP).
    Run once, by the strategy's ``load_model_state_dict``, before Lightning loads any weight.
    """
    saved_mesh = saved.get(MESH_KEY)
    current_mesh = dict(mesh) if mesh is not None else None
    if saved_mesh == current_mesh:
        return
    raise SwarmCheckpointError(
        f"the checkpoint was written by {_layout(saved_mesh, saved.get('num_islands'))}, this "
        f"run has {_layout(current_mesh, num_islands)}; model-sharded saves hold each rank's "
        "local shards of their own layout (no re-sharding yet). Resume with the "
        "island_parallel, island_size and tensor_parallel_size it was written with."
    )


def _layout(mesh: Mapping[str, Any] | None, num_islands: Any) -> str:
    if mesh is None:
        return f"{num_islands} DDP island(s) (island_parallel='ddp')"
    return (
        f"{num_islands} island(s) of data_parallel={mesh.get('data_parallel')} x "
        f"tensor_parallel={mesh.get('tensor_parallel')} (island_parallel='fsdp')"
    )


# -- save -------------------------------------------------------------------------------------
def save_per_rank(host: TrainingView, checkpoint: dict[str, Any], filepath: Any) -> str:
    """``save_swarm_state`` with this rank's own files and the mesh in the fingerprint."""
    return save_swarm_state(
        host, checkpoint, filepath, write=_write_rank_files, fingerprint=mesh_fingerprint
    )


def _write_rank_files(
    host: TrainingView, directory: Path, save_id: str, written: dict[str, FileDigest]
) -> None:
    """Every rank writes its island file of local shards; island 0's ranks, their anchors."""
    topology, outers = host.topology, host.outer_syncs
    island = IslandRecord(
        save_id=save_id,
        island=topology.island_index,
        module=local_tensors(host.module.state_dict()),
        optimizers=[local_tensors(opt.state_dict()) for opt in host.optimizers],
        totals=TotalsRecord.of(host.totals),
        outer_island=[o.island_state_dict() for o in outers],
    )
    name = island_rank_file_name(topology.island_index, topology.local_index)
    write_file(directory, name, island.to_dict(), written)
    if topology.island_index == 0:
        anchors = AnchorsRecord(save_id=save_id, outer=[o.record() for o in outers])
        write_file(
            directory, anchor_shard_file_name(topology.local_index), anchors.to_dict(), written
        )


def local_tensors(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (a view; saving copies it)."""
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, Mapping):
        return {k: local_tensors(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_tensors(v) for v in state)
    return state


# -- restore ----------------------------------------------------------------------------------
def restore_per_rank(
    host: TrainingView, main: Source, *, use_mmap: bool, island_paths: Mapping[int, Any]
) -> IslandRecord:
    """Check this rank's two files against ``main``'s record, then install them (collective).

    Returns:
        This rank's island record, installed (its residuals decide the option-change warning).

    Raises:
        SwarmCheckpointError: on every rank, when any rank cannot restore; nothing has been
            installed then.
    """
    comm = host.collectives
    island, anchors = attempt(comm, lambda: _load(host, main, use_mmap, island_paths))
    _install(host, island, anchors)
    return island


def _load(
    host: TrainingView, main: Source, use_mmap: bool, island_paths: Mapping[int, Any]
) -> tuple[IslandRecord, AnchorsRecord]:
    if island_paths:
        raise SwarmCheckpointError(
            "SwarmResume(island_ckpt_paths=...) is not supported with island_parallel='fsdp' "
            "yet; resume every island from ckpt_path."
        )
    compare_fingerprints(main.record.fingerprint, mesh_fingerprint(host))
    refuse_unusable(main.record.options, host.options)
    topology = host.topology
    island_name = island_rank_file_name(topology.island_index, topology.local_index)
    anchor_name = anchor_shard_file_name(topology.local_index)
    verify = host.anchors.verify
    island_data, _ = read_file(main, island_name, verify=verify, use_mmap=use_mmap)
    anchors_data, _ = read_file(main, anchor_name, verify=verify, use_mmap=use_mmap)
    island = IslandRecord.from_dict(island_data, island_name)
    anchors = AnchorsRecord.from_dict(anchors_data, anchor_name)
    path = main.directory / anchor_name
    check_outer_states(host, anchors, str(path))
    module = {k: tuple(v.shape) for k, v in local_tensors(host.module.state_dict()).items()}
    check_island(host, island, module, main.directory / island_name)
    if verify:
        for state in anchors.outer:
            check_finite(dict(state.anchors), source=path, what="an anchor")
        check_finite(island.module, source=main.directory / island_name, what="the module shard")
    return island, anchors


@torch.no_grad()
def _install(host: TrainingView, island: IslandRecord, anchors: AnchorsRecord) -> None:
    """Copy the shards into the live module and optimizers; adopt the outer state."""
    live = local_tensors(host.module.state_dict())
    for name, target in live.items():
        target.copy_(island.module[name])
    install_states(host, island, anchors, adapt=_shard_optimizer_state)


def _shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Turn a restored local state tensor back into a DTensor shaped like its parameter.

    ``Optimizer.load_state_dict`` hands back plain tensors; a sharded parameter's step needs its
    state as the same DTensor (same mesh, placements, global shape and stride: shards may be
    uneven, so they are given explicitly).
    """
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
