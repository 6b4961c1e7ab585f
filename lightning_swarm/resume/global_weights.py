"""The global model out of any swarm checkpoint, with no Trainer and no process group: the
anchors, where the Lightning file's ``state_dict`` holds island 0's *local* weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.files import (
    ANCHORS_FILE,
    anchor_shard_names,
    load_swarm_file,
    swarm_root,
)
from lightning_swarm.resume.records import AnchorsRecord, SwarmRecord


def load_global_state_dict(ckpt_path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The LightningModule's state dict with every anchored parameter replaced by its anchor.

    Anchors are cast to their parameter's dtype; parameters without an anchor and buffers keep
    island 0's values (every island holds the same). The caller owns the new CPU tensors.

    Raises:
        SwarmCheckpointError: no swarm state, missing or damaged swarm files, an anchor that
            names no entry, or model-sharded islands (their weights are per rank).
    """
    path = Path(ckpt_path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    record = SwarmRecord.of(ckpt, f"the swarm record of {path}")
    if record is None:
        raise SwarmCheckpointError(
            f"{path} holds no swarm state; if a plain Lightning strategy wrote it, its "
            "state_dict already is the model: load that."
        )
    if any("-rank-" in name and name.startswith("island-") for name in record.files):
        raise SwarmCheckpointError(
            f"{path} was written by model-sharded islands (island_parallel='fsdp'): each rank "
            "holds its own shard. Resume it in a run with the same layout and save the "
            "consolidated weights there (docs/fsdp.md)."
        )
    directory = swarm_root(path) / record.save_id
    anchors: dict[str, Tensor] = {}
    for name in anchor_shard_names(record.files) or [ANCHORS_FILE]:
        saved, _ = load_swarm_file(directory / name, mmap=False)
        for outer in AnchorsRecord.from_dict(saved, str(directory / name)).outer:
            anchors.update(outer.anchors)
    state: dict[str, Tensor] = dict(ckpt.get("state_dict", {}))
    unknown = sorted(set(anchors) - set(state))
    if unknown:
        raise SwarmCheckpointError(
            f"{path}: anchors {unknown[:3]} name no entry of its state_dict; the checkpoint "
            "was edited or mixes two runs. Use one written by SwarmStrategy as it is."
        )
    for name, anchor in anchors.items():
        state[name] = anchor.to(dtype=state[name].dtype, copy=True)
    return state
