"""Resume onto another layout: this rank's state cut out of a checkpoint another layout wrote.

A resume reshards when the saving run's islands differ from this run's in count or in their
mesh (DDP islands, or FSDP / tensor-parallel sizes). Every saved tensor is indexed by the
parameter it is a slice of (``global_model.Pieces``: files mapped, nothing read); this rank then
takes its own slice of each (its ``ParamLayout``). The result has the form this rank's own save
would have had, and goes through the checks and the install of every resume.

What each piece of state becomes:

- anchors and outer optimizer state: the saved global ones, sliced for this rank, bit for bit.
  A slice inside one saved tensor that is contiguous there is a view of the mapped file; any
  other is copied into one scratch mapping per rank, a file beside the checkpoint unlinked as
  soon as it is mapped (``Scratch``): pages of a file, not anonymous memory;
- an island in both runs: its own module state, inner optimizer state (elementwise states such
  as SGD's momentum and Adam's moments; a scalar such as Adam's step as saved) and
  error-feedback residuals, resliced;
- a new island (an index past the saved count): the anchors as its trained weights, island 0's
  buffers, frozen weights and inner optimizer state (warm, and counted like every island's),
  no residuals;
- a departed island: dropped, with a warning that names what it loses.

A mid-round checkpoint reshards like a round boundary: islands that stay keep their progress
since the last round, a new one joins from the anchors. Refused by name: a round in flight
(``sync_delay``), time budgets (``sync_every_s``: per-island loop state), islands catching up
from older checkpoints, and inner optimizer states that are not elementwise.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.model_layout import ParamLayout, model_layout
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.compatibility import MESH_KEY
from lightning_swarm.resume.files import ANCHORS_FILE, anchor_shard_names, island_file_name
from lightning_swarm.resume.global_model import (
    Pieces,
    add_piece,
    fill,
    layout_entry,
    whole_entry,
)
from lightning_swarm.resume.integrity import check_finite
from lightning_swarm.resume.outer_record import OuterRecord
from lightning_swarm.resume.records import AnchorsRecord, IslandRecord, SwarmRecord, TotalsRecord
from lightning_swarm.resume.training_view import (
    OuterState,
    TrainingView,
    optimizer_param_names,
)

_FIX = "Copy the checkpoint's whole .swarm directory, or resume on the layout that wrote it."
Read = Callable[[str], dict[str, Any]]  # a file of the save by name, checked and mapped


def saved_layout_text(fingerprint: Mapping[str, Any]) -> str:
    """How messages name the islands a fingerprint describes."""
    return layout_text(fingerprint.get(MESH_KEY), fingerprint.get("num_islands"))


def layout_text(mesh: Mapping[str, Any] | None, num_islands: Any) -> str:
    if mesh is None:
        return f"{num_islands} DDP island(s)"
    return (
        f"{num_islands} FSDP island(s) of data_parallel={mesh.get('data_parallel')} x "
        f"tensor_parallel={mesh.get('tensor_parallel')}"
    )


def needs_reshard(saved: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether the saving run's islands differ from this run's in count or mesh (a DDP
    island's size alone does not matter: its files are per island, whole tensors)."""
    return saved.get("num_islands") != current["num_islands"] or saved.get(MESH_KEY) != current.get(
        MESH_KEY
    )


# -- scratch: file-backed memory for the slices that are not views ----------------------------
class Scratch:
    """One shared mapping of a file created in ``directory`` and unlinked at once: its pages
    belong to the (nameless) file, so tensors cut into it add no anonymous memory. The mapping
    lives as long as any tensor taken from it; with no usable directory, plain memory."""

    ALIGN = 64

    def __init__(self, directory: Path, nbytes: int) -> None:
        self.file_backed = False
        self._used = 0
        self._buffer: Tensor | None = None
        if nbytes == 0:
            return
        try:
            fd, path = tempfile.mkstemp(prefix=".reshard-", dir=directory)
            try:
                os.ftruncate(fd, nbytes)
                self._buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                self.file_backed = True
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)

    @staticmethod
    def size_of(shape: Sequence[int], dtype: torch.dtype) -> int:
        return -(-math.prod(shape) * dtype.itemsize // Scratch.ALIGN) * Scratch.ALIGN

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """A new tensor of ``shape`` inside the mapping (uninitialised)."""
        assert self._buffer is not None
        size = self.size_of(shape, dtype)
        start, self._used = self._used, self._used + size
        raw = self._buffer[start : start + math.prod(shape) * dtype.itemsize]
        return raw.view(dtype).view(tuple(shape))


def _inside(
    piece: tuple[tuple[int, ...], Tensor, str], offset: Sequence[int], shape: Sequence[int]
) -> Tensor | None:
    """The box (``offset``, ``shape``) as a view of ``piece``'s tensor if it lies inside it."""
    start, tensor, _ = piece
    if tensor.dim() != len(shape):
        return None
    index = []
    for o, s, p, n in zip(offset, shape, start, tensor.shape, strict=True):
        if o < p or o + s > p + n:
            return None
        index.append(slice(o - p, o - p + s))
    return tensor[tuple(index)]


def view_of(pieces: Pieces, offset: Sequence[int], shape: Sequence[int]) -> Tensor | None:
    """The slice as a contiguous view of one saved tensor, or None when it needs a copy."""
    for piece in pieces.slices:
        view = _inside(piece, offset, shape)
        if view is not None and view.is_contiguous():
            return view
    return None


@dataclass
class Cuts:
    """Slices to cut for this rank: ``wanted[key] = (pieces, offset, shape)``; ``cut`` returns
    them as views where possible, else in one ``Scratch`` (``file_backed``) or plain memory."""

    wanted: dict[Any, tuple[Pieces, tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    def add(self, key: Any, pieces: Pieces, part: ParamLayout) -> None:
        offset, shape = part.slice
        self.wanted[key] = (pieces, tuple(offset), tuple(shape))

    def cut(
        self, name_of: Callable[[Any], str], scratch_dir: Path | None
    ) -> tuple[dict[Any, Tensor], int, bool]:
        """Every slice, and the bytes copied (not views) and whether they are file-backed."""
        views: dict[Any, Tensor | None] = {
            key: view_of(p, o, s) for key, (p, o, s) in self.wanted.items()
        }
        dtypes = {key: _dtype_of(p) for key, (p, _, _) in self.wanted.items()}
        copies = [key for key, v in views.items() if v is None]
        nbytes = sum(Scratch.size_of(self.wanted[k][2], dtypes[k]) for k in copies)
        scratch = None
        if scratch_dir is not None and nbytes:
            scratch = Scratch(scratch_dir, nbytes)
        out: dict[Any, Tensor] = {}
        for key, (pieces, offset, shape) in self.wanted.items():
            view = views[key]
            if view is None:
                dtype = dtypes[key]
                target = scratch.take(shape, dtype) if scratch else torch.empty(shape, dtype=dtype)
                view = fill(name_of(key), pieces, offset, target, fix=_FIX)
            out[key] = view
        return out, nbytes, scratch is not None and scratch.file_backed


def _dtype_of(pieces: Pieces) -> torch.dtype:
    # The saved tensors' own dtype (the anchors' anchor_dtype, not their parameter's).
    return pieces.slices[0][1].dtype if pieces.slices else pieces.dtype


# -- the saved run, indexed by parameter ------------------------------------------------------
@dataclass
class IslandPieces:
    """One saved island's own state, every tensor as the pieces of its parameter."""

    module: dict[str, Pieces]
    optimizers: list[dict[tuple[str, str], Pieces]]  # (parameter, state key) -> pieces
    scalars: list[dict[tuple[str, str], Any]]  # (parameter, state key) -> a non-sliced value
    groups: list[list[dict[str, Any]]]  # each optimizer's saved param_groups
    optimizer_params: list[list[str]]
    residuals: list[dict[str, Pieces]]
    totals: TotalsRecord


@dataclass
class OuterPieces:
    """One outer optimizer's saved global state, by parameter."""

    record: OuterRecord  # the first file's (counters, hyperparameters)
    anchors: dict[str, Pieces]
    state: dict[tuple[str, str], Pieces]
    scalars: dict[tuple[str, str], Any]


def island_file_names(record: SwarmRecord, island: int) -> list[str]:
    """The files of one saved island: per-rank files (model-sharded) or its one file."""
    per_rank = sorted(n for n in record.files if n.startswith(f"island-{island:05d}-rank-"))
    if per_rank:
        return per_rank
    whole = island_file_name(island)
    return [whole] if whole in record.files else []


def _state_pieces(
    state: Mapping[Any, Any],
    names: Sequence[str],
    layout: Mapping[str, Any],
    where: str,
    pieces: dict[tuple[str, str], Pieces],
    scalars: dict[tuple[str, str], Any],
) -> None:
    """An optimizer's positional ``state`` into ``pieces`` and ``scalars`` by (name, key)."""
    for position, entries in state.items():
        name = names[int(position)]
        for key, value in entries.items():
            if not isinstance(value, Tensor) or value.dim() == 0:
                scalars.setdefault((name, key), value)
                continue
            part = layout_entry(dict(layout), name) or whole_entry(value)
            if tuple(value.shape) != part.slice[1]:
                raise SwarmCheckpointError(
                    f"{where}: the optimizer state {key!r} of {name} has shape "
                    f"{tuple(value.shape)}, not its parameter's slice {part.slice[1]}; only "
                    "elementwise optimizer states (SGD, Adam, AdamW, ...) can move to another "
                    "layout. Resume on the layout the checkpoint was written by."
                )
            add_piece(pieces, (name, key), value, part, where)


def load_island(read: Read, record: SwarmRecord, island: int, directory: Path) -> IslandPieces:
    """Saved island ``island``'s state, indexed by parameter."""
    names = island_file_names(record, island)
    if not names:
        raise SwarmCheckpointError(
            f"{directory} holds no file of island {island}; the save is incomplete. Resume "
            "from another checkpoint."
        )
    module: dict[str, Pieces] = {}
    optimizers: list[dict[tuple[str, str], Pieces]] = []
    scalars: list[dict[tuple[str, str], Any]] = []
    residuals: list[dict[str, Pieces]] = []
    union: list[list[str]] = []
    first: IslandRecord | None = None
    for name in names:
        where = str(directory / name)
        saved = IslandRecord.from_dict(read(name), where)
        first = first or saved
        if saved.optimizer_params is None:
            raise SwarmCheckpointError(
                f"{where} does not record which parameter each inner optimizer state belongs "
                "to (it was written before lightning_swarm could reshard); resume it on the "
                "layout that wrote it, save again, then change the layout."
            )
        layout = saved.module_layout or {}
        for key, tensor in saved.module.items():
            add_piece(module, key, tensor, layout_entry(layout, key) or whole_entry(tensor), where)
        while len(optimizers) < len(saved.optimizers):
            optimizers.append({})
            scalars.append({})
        while len(union) < len(saved.optimizer_params):
            union.append([])
        for k, names in enumerate(saved.optimizer_params):
            union[k] += [n for n in names if n not in union[k]]  # a stage's files add theirs
        for k, state in enumerate(saved.optimizers):
            params = saved.optimizer_params[k]
            _state_pieces(state.get("state", {}), params, layout, where, optimizers[k], scalars[k])
        while len(residuals) < len(saved.outer_island):
            residuals.append({})
        for k, outer in enumerate(saved.outer_island):
            for key, tensor in dict(outer.get("residuals", {})).items():
                part = layout_entry(layout, key) or whole_entry(tensor)
                add_piece(residuals[k], key, tensor, part, where)
    assert first is not None and first.optimizer_params is not None
    return IslandPieces(
        module=module,
        optimizers=optimizers,
        scalars=scalars,
        groups=[list(s.get("param_groups", [])) for s in first.optimizers],
        optimizer_params=union,
        residuals=residuals,
        totals=first.totals,
    )


def load_outer(read: Read, record: SwarmRecord, directory: Path, verify: bool) -> list[OuterPieces]:
    """The saved anchors and outer optimizer states, by parameter (island 0's files).

    Raises:
        SwarmCheckpointError: a round was in flight (it cannot be resharded).
    """
    outers: list[OuterPieces] = []
    for name in anchor_shard_names(record.files) or [ANCHORS_FILE]:
        where = str(directory / name)
        for k, outer in enumerate(AnchorsRecord.from_dict(read(name), where).outer):
            if verify:
                check_finite(dict(outer.anchors), source=Path(where), what="an anchor")
            if outer.pending is not None:
                raise SwarmCheckpointError(
                    f"{where}: a round of fragment {outer.pending.fragment} was in flight at "
                    f"this checkpoint (sync_delay), and a round in flight cannot move to "
                    "another layout. Resume on the layout that wrote it until a checkpoint "
                    "without a round in flight (one sync_delay past a round), then change it."
                )
            if len(outers) <= k:
                outers.append(OuterPieces(outer, {}, {}, {}))
            target = outers[k]
            layout = outer.layout or {}
            for key, tensor in outer.anchors.items():
                part = layout_entry(layout, key) or whole_entry(tensor)
                add_piece(target.anchors, key, tensor, part, where)
            state = outer.outer_optimizer.get("state", {})
            _state_pieces(state, outer.names, layout, where, target.state, target.scalars)
    return outers


# -- this rank's state, in the form of its own save --------------------------------------------
@dataclass
class Resharded:
    """This rank's island and outer records, and what the cut cost (for the summary)."""

    island: IslandRecord
    anchors: AnchorsRecord
    copied_bytes: int
    file_backed: bool
    new_island: bool


def reshard(host: TrainingView, record: SwarmRecord, directory: Path, read: Read) -> Resharded:
    """This rank's state out of a save written by another layout (see the module docstring).
    ``directory`` is the save's folder; the scratch file, if any, goes beside it.

    Raises:
        SwarmCheckpointError: the save cannot be resharded onto this run (named, with the fix).
    """
    saved_islands = int(record.fingerprint.get("num_islands", 0))
    own = host.topology.island_index
    new_island = own >= saved_islands
    outers = load_outer(read, record, directory, host.anchors.verify)
    syncs = host.outer_syncs
    if len(outers) != len(syncs):
        raise SwarmCheckpointError(
            f"{directory} holds {len(outers)} outer states for {len(syncs)} optimizers; use "
            "the same configure_optimizers."
        )
    island = load_island(read, record, 0 if new_island else own, directory)
    params = [optimizer_param_names(o, host.module) for o in host.optimizers]
    saved_params = island.optimizer_params
    unknown = [
        [n for n in names if n not in set(saved_params[k] if k < len(saved_params) else [])]
        for k, names in enumerate(params)
    ]
    if len(params) != len(saved_params) or any(unknown):
        raise SwarmCheckpointError(
            f"{directory}: the saved inner optimizers hold the parameters {saved_params}, this "
            f"run's {params} (not saved: {unknown}); use the same configure_optimizers."
        )
    targets = [(list(o.owned), o.layout) for o in syncs]
    cut, copied, file_backed = cut_outer_state(outers, targets, directory)
    anchors = AnchorsRecord(
        record.save_id,
        [
            _outer_record(k, o, saved, cut)
            for k, (o, saved) in enumerate(zip(syncs, outers, strict=True))
        ],
    )
    island_record = _island_record(host, record, island, outers, params, new_island)
    return Resharded(island_record, anchors, copied, file_backed, new_island)


def cut_outer_state(
    outers: Sequence[OuterPieces],
    targets: Sequence[tuple[Sequence[str], Mapping[str, ParamLayout]]],
    directory: Path,
) -> tuple[dict[Any, Tensor], int, bool]:
    """Per outer optimizer, the anchors and outer state of ``targets[k]``'s (owned names,
    layout), keyed ``("anchor", k, name)`` and ``("state", k, name, key)``: views of the saved
    files or copies in a scratch mapping beside ``directory``. Also returns the bytes copied
    and whether the scratch is file-backed."""
    cuts = Cuts()
    for k, (saved, (owned, layout)) in enumerate(zip(outers, targets, strict=True)):
        for name in owned:
            cuts.add(("anchor", k, name), _require(saved.anchors, name, directory), layout[name])
        mine = set(owned)
        for (name, key), pieces in saved.state.items():
            if name in mine:
                cuts.add(("state", k, name, key), pieces, layout[name])
    return cuts.cut(lambda key: ".".join(map(str, key[2:])), directory.parent)


def _require(pieces: Mapping[str, Pieces], name: str, directory: Path) -> Pieces:
    found = pieces.get(name)
    if found is None:
        raise SwarmCheckpointError(
            f"{directory}: the saved anchors lack parameter {name!r}; the save is damaged or of "
            "another model. Resume from another checkpoint."
        )
    return found


def _outer_record(
    k: int, outer: OuterState, saved: OuterPieces, cut: Mapping[Any, Tensor]
) -> OuterRecord:
    """Optimizer ``k``'s outer record for this rank: its owned anchors and state, in order.
    Parameters it does not own (a DDP island's sharded outer state) get memory-less anchors of
    their shape, which the checks read and the install drops."""
    owned = list(outer.owned)
    mine = set(owned)
    anchors = {
        name: cut[("anchor", k, name)]
        if name in mine
        else torch.empty(outer.layout[name].slice[1], device="meta")
        for name in outer.params
    }
    state: dict[int, dict[str, Any]] = {}
    for position, name in enumerate(owned):
        entries = {key: value for (n, key), value in saved.scalars.items() if n == name}
        entries |= {key[3]: t for key, t in cut.items() if key[:3] == ("state", k, name)}
        if entries:
            state[position] = entries
    groups = [dict(g) for g in saved.record.outer_optimizer.get("param_groups", [])]
    if len(groups) != 1:
        raise SwarmCheckpointError(
            f"the saved outer optimizer {k} has {len(groups)} param groups; only one group of "
            "anchors can move to another layout. Resume on the layout the checkpoint was "
            "written by."
        )
    groups[0]["params"] = list(range(len(owned)))
    return OuterRecord(
        anchors=anchors,
        outer_optimizer={"state": state, "param_groups": groups},
        counters=saved.record.counters,
        param_names=owned,
    )


def _island_record(
    host: TrainingView,
    record: SwarmRecord,
    island: IslandPieces,
    outers: Sequence[OuterPieces],
    params: Sequence[Sequence[str]],
    new_island: bool,
) -> IslandRecord:
    """This rank's island record: its island's (or, new, island 0's and the anchors') state,
    sliced as this rank holds it. Resident state, cut into plain memory."""
    layout = model_layout(dict(host.module.state_dict()))
    module: dict[str, Tensor] = {}
    anchors = {name: p for saved in outers for name, p in saved.anchors.items()}
    for key, part in layout.items():
        if new_island and key in anchors:  # a new island starts from the global model
            module[key] = _cut(key, anchors[key], part).to(getattr(torch, part.dtype))
        elif key in island.module:
            module[key] = _cut(key, island.module[key], part)
        else:
            raise SwarmCheckpointError(
                f"the checkpoint holds no {key!r} of the module; it was written by another "
                "model. Resume with the model the checkpoint was written by."
            )
    optimizers = []
    for k, names in enumerate(params):
        state: dict[int, dict[str, Any]] = {}
        for position, name in enumerate(names):
            entries = {key: v for (n, key), v in island.scalars[k].items() if n == name}
            for (n, key), pieces in island.optimizers[k].items():
                if n == name:
                    entries[key] = _cut(f"{name} ({key})", pieces, layout[name])
            if entries:
                state[position] = entries
        optimizers.append({"state": state, "param_groups": _groups(host, k, island.groups[k])})
    outer_island = []
    for k, outer in enumerate(host.outer_syncs):
        saved = {} if new_island or k >= len(island.residuals) else island.residuals[k]
        residuals = {n: _cut(n, p, outer.layout[n]) for n, p in saved.items() if n in outer.layout}
        outer_island.append({"residuals": residuals})
    totals = island.totals
    if new_island:  # nothing sent or received yet, but the rounds it joins count on
        totals = TotalsRecord(outer_steps=totals.outer_steps)
    return IslandRecord(
        save_id=record.save_id,
        island=host.topology.island_index,
        module=module,
        optimizers=optimizers,
        totals=totals,
        outer_island=outer_island,
        optimizer_params=[list(n) for n in params],
    )


def _groups(host: TrainingView, k: int, saved: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Optimizer ``k``'s param groups: the saved hyperparameters (a scheduled lr included),
    this run's numbering of the parameters (another stage split numbers them otherwise)."""
    current = host.optimizers[k].state_dict()["param_groups"]
    if len(current) != len(saved):
        raise SwarmCheckpointError(
            f"inner optimizer {k} has {len(current)} param group(s), the checkpoint's "
            f"{len(saved)}; use the same configure_optimizers."
        )
    return [
        {**dict(old), "params": list(new["params"])}
        for old, new in zip(saved, current, strict=True)
    ]


def _cut(name: str, pieces: Pieces, part: ParamLayout) -> Tensor:
    """One slice of resident state, in plain memory."""
    offset, shape = part.slice
    view = view_of(pieces, offset, shape)
    if view is not None:
        return view
    return fill(name, pieces, offset, torch.empty(shape, dtype=_dtype_of(pieces)), fix=_FIX)
