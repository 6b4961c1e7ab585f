"""The global model (or one island's local weights) out of any swarm checkpoint, offline: no
Trainer, no process group, whatever layout wrote it (DDP, FSDP or tensor-parallel islands, a
sharded outer state).

Every saved tensor says which slice of which parameter it is (``algorithm.model_layout``): the
anchors through ``OuterRecord.layout``, a model-sharded rank's module state through
``IslandRecord.module_layout``; a tensor without one is whole. ``model_pieces`` indexes a
checkpoint's tensors by parameter, every file memory-mapped and none read; ``assemble`` builds
one parameter from its pieces, checking that they tile it exactly; ``load_global_state_dict``
and ``export`` (``swarm-export``) are the two ways out. The mapped pieces reference the
checkpoint's files, which a save never rewrites in place: reading them later is safe, and they
cost no memory until read. ``export`` holds about one parameter at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.model_layout import ParamLayout
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.atomic import is_disk_full
from lightning_swarm.resume.files import (
    ANCHORS_FILE,
    anchor_shard_names,
    island_file_name,
    load_swarm_file,
    swarm_root,
    unreadable_error,
)
from lightning_swarm.resume.integrity import check_file
from lightning_swarm.resume.records import AnchorsRecord, IslandRecord, SwarmRecord
from lightning_swarm.transport.payload import PayloadMap, byte_view

# Hugging Face's names: one file, or numbered shards beside an index of which holds what.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class Pieces:
    """One parameter (or buffer) of the model: its global ``shape`` and ``dtype``, and the
    saved tensors that tile it, each at its ``offset`` (mapped, read-only)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    slices: list[tuple[tuple[int, ...], Tensor, str]] = field(default_factory=list)


def model_pieces(
    ckpt_path: str | os.PathLike[str], *, island: int | None = None
) -> dict[str, Pieces]:
    """Every tensor of the module's state dict, in its order, as its saved pieces: the
    anchors where there are some (the global model), else island 0's values (buffers, frozen
    parameters); with ``island``, that island's own local weights instead.

    Raises:
        SwarmCheckpointError: no swarm state, a missing, truncated or damaged file, an island
            the checkpoint lacks, or pieces that do not tile their parameter.
    """
    path = Path(ckpt_path)
    ckpt = _load_lightning_file(path)
    record = SwarmRecord.of(ckpt, f"the swarm record of {path}")
    if record is None:
        raise SwarmCheckpointError(
            f"{path} holds no swarm state; if a plain Lightning strategy wrote it, its "
            "state_dict already is the model: load that."
        )
    directory = swarm_root(path) / record.save_id

    def read(name: str) -> dict[str, Any]:
        file = directory / name
        if name in record.files and file.is_file():  # a missing one: load_swarm_file says so
            check_file(file, record.files[name], verify=False)  # the size: a truncated file
        return load_swarm_file(file, mmap=True)[0]

    per_rank = sorted(n for n in record.files if n.startswith("island-") and "-rank-" in n)
    module = _module_entries(ckpt, record, read, directory, island)
    if not module:
        where = "its state_dict" if island is None and not per_rank else f"island {island or 0}"
        raise SwarmCheckpointError(
            f"{path} holds no module state for {where}: the checkpoint has islands "
            f"{_islands(record.files, per_rank)}. Name one of them (--local ISLAND)."
        )
    anchors = {} if island is not None else _anchor_pieces(record, read, directory, per_rank)
    pieces: dict[str, Pieces] = {}
    for key, tensor, entry, where in module:
        entry = entry or whole_entry(tensor)
        if key in anchors:  # the global model, in the module's own dtype
            anchors[key].dtype = _dtype(entry.dtype)
            pieces.setdefault(key, anchors[key])
            continue
        add_piece(pieces, key, tensor, entry, where)
    unknown = sorted(set(anchors) - set(pieces))
    if unknown:
        raise SwarmCheckpointError(
            f"{path}: anchors {unknown[:3]} name no entry of the module's state; the checkpoint "
            "was edited or mixes two runs. Use one written by SwarmStrategy as it is."
        )
    return pieces


Entry = tuple[str, Tensor, ParamLayout | None, str]  # name, tensor, its slice, its file


def _module_entries(
    ckpt: dict[str, Any],
    record: SwarmRecord,
    read: Callable[[str], dict[str, Any]],
    directory: Path,
    island: int | None,
) -> list[Entry]:
    """The module state of ``island`` (None: island 0's, from the Lightning file unless its
    islands are model-sharded, whose ranks' files hold their slices); [] if the save has none."""
    target = 0 if island is None else island
    per_rank = [n for n in sorted(record.files) if n.startswith(f"island-{target:05d}-rank-")]
    if per_rank:
        module: list[Entry] = []
        for name in per_rank:
            saved = IslandRecord.from_dict(read(name), str(directory / name))
            if not saved.module_layout:
                raise _no_slices(directory / name)
            layout = saved.module_layout
            module += [(k, t, layout_entry(layout, k), name) for k, t in saved.module.items()]
        return module
    if island is None:
        return [(k, t, None, "state_dict") for k, t in dict(ckpt.get("state_dict", {})).items()]
    name = island_file_name(target)
    if name not in record.files:
        return []
    saved = IslandRecord.from_dict(read(name), str(directory / name))
    return [(k, t, None, name) for k, t in saved.module.items()]


def _anchor_pieces(
    record: SwarmRecord, read: Callable[[str], dict[str, Any]], directory: Path, per_rank: Any
) -> dict[str, Pieces]:
    """The anchors' pieces: whole tensors, or slices under model-sharded islands."""
    pieces: dict[str, Pieces] = {}
    for name in anchor_shard_names(record.files) or [ANCHORS_FILE]:
        for outer in AnchorsRecord.from_dict(read(name), str(directory / name)).outer:
            if outer.layout is None and per_rank:
                raise _no_slices(directory / name)
            for key, tensor in outer.anchors.items():
                entry = layout_entry(outer.layout or {}, key) or whole_entry(tensor)
                add_piece(pieces, key, tensor, entry, name)
    return pieces


def add_piece(
    pieces: dict[Any, Pieces], key: Any, tensor: Tensor, entry: ParamLayout, where: str
) -> None:
    """Index ``tensor`` (the slice ``entry`` of parameter ``key``, from file ``where``) into
    ``pieces``; ``SwarmCheckpointError`` when it contradicts its layout or another file."""
    offset, local = entry.slice
    if tuple(tensor.shape) != local:
        raise SwarmCheckpointError(
            f"{where}: {key} holds a tensor of shape {tuple(tensor.shape)} where its layout "
            f"says {local}; the file is damaged or was edited. Export another checkpoint."
        )
    found = pieces.setdefault(key, Pieces(tuple(entry.shape), _dtype(entry.dtype)))
    if found.shape != tuple(entry.shape):
        raise SwarmCheckpointError(
            f"{where}: {key} is a slice of shape {tuple(entry.shape)}, another file's of "
            f"{found.shape}; the checkpoint mixes two runs. Export one written as it is."
        )
    found.slices.append((offset, tensor, where))


def assemble(name: str, pieces: Pieces, dtype: torch.dtype | None = None) -> Tensor:
    """One parameter from its pieces (a new CPU tensor the caller owns), in ``dtype`` or its
    own; a whole piece in its own dtype is copied once.

    Raises:
        SwarmCheckpointError: the pieces do not tile the parameter (one outside it, or the
            elements do not add up: a rank file is missing).
    """
    shape = torch.Size(pieces.shape)
    for offset, tensor, where in pieces.slices:
        bounds = list(zip(offset, tensor.shape, shape, strict=False))
        inside = len(offset) == len(shape) == tensor.dim()
        if not (inside and all(o >= 0 and o + s <= n for o, s, n in bounds)):
            raise SwarmCheckpointError(
                f"{where}: {name}'s slice at {offset} of shape {tuple(tensor.shape)} lies "
                f"outside its shape {tuple(shape)}; the file is damaged. Export another "
                "checkpoint."
            )
    out = torch.empty(shape, dtype=dtype or pieces.dtype)
    fix = "Copy the checkpoint's whole .swarm directory, or export another checkpoint."
    return fill(name, pieces, (0,) * len(shape), out, fix=fix)


def fill(name: str, pieces: Pieces, offset: Sequence[int], out: Tensor, *, fix: str) -> Tensor:
    """Fill ``out``, the box of the parameter at ``offset``, from every saved piece that
    overlaps it (cast to ``out``'s dtype); returns ``out``.

    Raises:
        SwarmCheckpointError: the pieces leave part of the box empty (a rank's file missing);
            the message ends with ``fix``.
    """
    covered = 0
    for start, tensor, _ in pieces.slices:
        lo = [max(o, p) for o, p in zip(offset, start, strict=True)]
        hi = [
            min(o + s, p + n)
            for o, s, p, n in zip(offset, out.shape, start, tensor.shape, strict=True)
        ]
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        source = tensor[tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, start, strict=True))]
        out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))].copy_(
            source
        )
        covered += source.numel()
    if covered != out.numel():
        files = sorted({where for _, _, where in pieces.slices})
        raise SwarmCheckpointError(
            f"{name}: the saved slices hold {covered} of the {out.numel()} elements wanted "
            f"(from {files}); a rank's file of this checkpoint is missing or from another "
            f"save. {fix}"
        )
    return out


def load_global_state_dict(ckpt_path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The LightningModule's state dict with every anchored parameter replaced by its anchor,
    whatever the layout that wrote the checkpoint.

    Anchors are cast to their parameter's dtype; parameters without an anchor and buffers keep
    island 0's values (every island holds the same). The caller owns the new CPU tensors.

    Raises:
        SwarmCheckpointError: as ``model_pieces`` and ``assemble``.
    """
    return {name: assemble(name, p) for name, p in model_pieces(ckpt_path).items()}


def export(
    ckpt_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    island: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[Path]:
    """Write the global model (``island``: that island's local weights) of ``ckpt_path`` as
    safetensors under ``out_dir``: ``model.safetensors``, or shards of at most about
    ``max_shard_bytes`` beside ``model.safetensors.index.json``, with the module's own names.
    Each tensor is assembled, written and dropped in turn. Returns the files written.

    Raises:
        SwarmCheckpointError: as ``model_pieces``; or ``out_dir`` cannot be written (a full
            disk included), in which case nothing of this export is left behind.
    """
    pieces = model_pieces(ckpt_path, island=island)
    shards = _plan_shards(pieces, dtype, max_shard_bytes)
    out = Path(out_dir)
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for k, names in enumerate(shards):
            name = SINGLE_FILE if len(shards) == 1 else _shard_name(k, len(shards))
            written.append(_write_shard(out / name, names, pieces, dtype))
        if len(shards) > 1:
            written.append(_write_index(out, shards, pieces, dtype))
    except OSError as err:
        for path in written:
            path.unlink(missing_ok=True)
        full = " (the device is full)" if is_disk_full(err) else ""
        raise unreadable_error("export directory", out, err) or SwarmCheckpointError(
            f"cannot write the export to {out}{full}: {type(err).__name__}: {err}; nothing of "
            "it was left there. Free space or give another directory."
        ) from err
    return written


def _plan_shards(
    pieces: dict[str, Pieces], dtype: torch.dtype | None, max_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, p in pieces.items():
        nbytes = _nbytes(p, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(
    path: Path, names: list[str], pieces: dict[str, Pieces], dtype: torch.dtype | None
) -> Path:
    entries = [(n, pieces[n].shape, dtype or pieces[n].dtype) for n in names]
    header = PayloadMap(entries).safetensors_header({"format": "pt"}, flat=False)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        handle.write(header)
        for name in names:
            # One statement, so that each tensor is freed before the next is assembled (a loop
            # variable would hold the last one meanwhile: two parameters alive, not one).
            # ``assemble`` returns a new contiguous tensor: its bytes are written as they are.
            handle.write(byte_view(assemble(name, pieces[name], dtype)).numpy().data)
    os.replace(partial, path)
    return path


def _write_index(
    out: Path, shards: list[list[str]], pieces: dict[str, Pieces], dtype: torch.dtype | None
) -> Path:
    weight_map = {n: _shard_name(k, len(shards)) for k, names in enumerate(shards) for n in names}
    total = sum(_nbytes(p, dtype) for p in pieces.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path = out / INDEX_FILE
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


def _shard_name(k: int, count: int) -> str:
    return f"model-{k + 1:05d}-of-{count:05d}.safetensors"


def _nbytes(p: Pieces, dtype: torch.dtype | None) -> int:
    return int(torch.Size(p.shape).numel()) * (dtype or p.dtype).itemsize


def layout_entry(layout: dict[str, Any], key: str) -> ParamLayout | None:
    entry = layout.get(key)
    return None if entry is None else ParamLayout(*entry)


def whole_entry(tensor: Tensor) -> ParamLayout:
    shape = tuple(int(s) for s in tensor.shape)
    return ParamLayout(shape, str(tensor.dtype).removeprefix("torch."), (0,) * len(shape), shape)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SwarmCheckpointError(f"a saved layout names the dtype {name!r}, which torch lacks")
    return dtype


def _islands(files: dict[str, Any], per_rank: list[str]) -> list[int]:
    names = per_rank or [n for n in files if n.startswith("island-")]
    return sorted({int(n.split("-")[1].split(".")[0]) for n in names})


def _no_slices(path: Path) -> SwarmCheckpointError:
    return SwarmCheckpointError(
        f"{path} holds a model-sharded rank's tensors but not which slice of each it holds (it "
        "was written before lightning_swarm recorded slices); resume it on the layout that "
        "wrote it and save again, then export that checkpoint."
    )


def _load_lightning_file(path: Path) -> dict[str, Any]:
    """The Lightning file, mapped (as ``lightning_file.read_lightning_file`` names a damaged one,
    a layer up)."""
    if not path.is_file():
        raise SwarmCheckpointError(f"checkpoint {path} does not exist; give the .ckpt file's path.")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        unreadable = unreadable_error("checkpoint", path, err)
        raise unreadable or SwarmCheckpointError(
            f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); export another checkpoint."
        ) from err
    if not isinstance(loaded, dict):
        raise SwarmCheckpointError(f"{path} is not a Lightning checkpoint (no dict inside)")
    return loaded
