"""A model's layout on one rank: for each trained parameter, its global name, shape and dtype,
and the slice of it this rank holds (an FSDP shard, a tensor-parallel split, or the whole).

The package's one description of "which part of which parameter lives here", and its one
fingerprint: resumes (``resume.compatibility``), the round's pairing of counterparts (a round's
transport checks that peers hold the same slices), joining islands (``membership``) and heals
read it. Plain data (tuples of ints and strings), so it crosses the heal wire and lands in a
checkpoint as is. A DTensor's slice comes from its own chunk list (``__create_chunk_list__``,
what ``torch.distributed.checkpoint`` reads), so placements and device meshes are not restated
here; read by duck typing, as this layer never imports torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import NamedTuple

from torch import Tensor


class ParamLayout(NamedTuple):
    """One parameter: its global ``shape``, its dtype name (``"float32"``) and the slice this
    rank holds, ``offset`` (its first index per dimension) and ``local_shape``. A whole tensor
    has offset zeros and ``local_shape == shape``; ``()`` for either means "the whole tensor"
    (a layout written before slices were recorded)."""

    shape: tuple[int, ...]
    dtype: str
    offset: tuple[int, ...] = ()
    local_shape: tuple[int, ...] = ()

    @property
    def slice(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offset, local_shape)``, the whole tensor's when none was recorded."""
        if not self.local_shape:
            return tuple(0 for _ in self.shape), tuple(self.shape)
        return tuple(self.offset), tuple(self.local_shape)

    @property
    def whole(self) -> bool:
        return self.slice[1] == tuple(self.shape)

    def __str__(self) -> str:
        text = f"{tuple(self.shape)} {self.dtype}"
        if not self.whole:
            offset, local = self.slice
            text += f" (this rank: {local} at {offset})"
        return text


Layout = dict[str, ParamLayout]  # parameter name -> its layout, in the model's order


def param_layout(tensor: Tensor) -> ParamLayout:
    """The layout of one parameter: a DTensor's global shape and its local chunk, or a whole
    tensor."""
    shape = tuple(int(s) for s in tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    if hasattr(tensor, "placements"):  # a DTensor: its shape is the global one
        chunks = tensor.__create_chunk_list__()  # type: ignore[attr-defined]
        (chunk,) = chunks  # one per rank under FSDP2 and tensor parallel
        offset, local = tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)
        return ParamLayout(shape, dtype, offset, local)
    return ParamLayout(shape, dtype, tuple(0 for _ in shape), shape)


def model_layout(params: Mapping[str, Tensor]) -> Layout:
    """The layout of ``params`` on this rank (DTensors give their slices)."""
    return {name: param_layout(p) for name, p in params.items()}


def plain_layout(layout: Mapping[str, ParamLayout]) -> dict[str, list[list[int] | str]]:
    """``layout`` as plain lists (what a checkpoint stores); ``ParamLayout(*entry)`` reads an
    entry back."""
    return {
        name: [list(e.shape), e.dtype, list(e.slice[0]), list(e.slice[1])]
        for name, e in ((n, ParamLayout(*entry)) for n, entry in layout.items())
    }


def hash63(data: bytes) -> int:
    """The package's one short hash: the first 8 bytes of ``data``'s sha256, little-endian, top
    bit cleared, so that it fits a non-negative int64 (what a round header carries)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & ((1 << 63) - 1)


def fingerprint(layout: Mapping[str, ParamLayout], *, placement: bool = False) -> int:
    """A 63-bit hash (``hash63``) of ``layout``, independent of the parameters' order: of each
    name, global shape and dtype (the model), and with ``placement`` of this rank's slices too
    (two ranks that pair up in a round must agree on it)."""
    rows = []
    for name, entry in layout.items():
        entry = ParamLayout(*entry)
        row = [name, f"{tuple(entry.shape)} {entry.dtype}"]
        if placement:
            row.append(str(entry.slice))
        rows.append(row)
    return hash63(json.dumps(sorted(rows)).encode())


def describe_difference(
    own: Mapping[str, ParamLayout],
    other: Mapping[str, ParamLayout],
    limit: int = 3,
    *,
    here: str = "here",
    there: str = "in the swarm",
) -> str:
    """The first differences between two layouts, in words (slices included)."""
    mine = {name: ParamLayout(*entry) for name, entry in own.items()}
    theirs = {name: ParamLayout(*entry) for name, entry in other.items()}

    def key(entry: ParamLayout) -> tuple[object, ...]:
        return (tuple(entry.shape), entry.dtype, entry.slice)

    notes = [
        f"{name} is {mine[name]} {here} but {theirs[name]} {there}"
        for name in mine
        if name in theirs and key(mine[name]) != key(theirs[name])
    ]
    notes += [f"{name} exists only {here}" for name in mine if name not in theirs]
    notes += [f"{name} exists only {there}" for name in theirs if name not in mine]
    if not notes:
        return "the layouts agree; the parameter order differs"
    more = f" (and {len(notes) - limit} more)" if len(notes) > limit else ""
    return "; ".join(notes[:limit]) + more
