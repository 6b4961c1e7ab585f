"""A model's layout: each parameter's name, shape and dtype, and the fingerprint of it.

The one description of "the same model", for resumes (``resume.compatibility``) and joining islands
(``membership.torchft_quorum``); plain data, so it crosses the heal wire as is."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from torch import Tensor


class ParamLayout(NamedTuple):
    """One parameter's shape and dtype name (``"float32"``)."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.shape} {self.dtype}"


Layout = dict[str, ParamLayout]  # parameter name -> shape and dtype, in the model's order


def model_layout(
    params: Mapping[str, Tensor], global_shapes: Mapping[str, Sequence[int]] | None = None
) -> Layout:
    """The layout of ``params``; ``global_shapes`` replaces the shapes of local shards."""
    shapes = global_shapes or {}
    return {
        name: ParamLayout(
            tuple(int(s) for s in shapes.get(name, p.shape)),
            str(p.dtype).removeprefix("torch."),
        )
        for name, p in params.items()
    }


def hash63(data: bytes) -> int:
    """The package's one short hash: the first 8 bytes of ``data``'s sha256, little-endian, top
    bit cleared, so that it fits a non-negative int64 (what a round header carries)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & ((1 << 63) - 1)


def fingerprint(layout: Mapping[str, ParamLayout]) -> int:
    """A 63-bit hash (``hash63``) of ``layout``, independent of the parameters' order."""
    text = json.dumps(sorted((name, str(ParamLayout(*entry))) for name, entry in layout.items()))
    return hash63(text.encode())


def describe_difference(
    own: Mapping[str, ParamLayout], swarm: Mapping[str, ParamLayout], limit: int = 3
) -> str:
    """The first differences between this island's layout and the swarm's, in words."""
    mine = {name: ParamLayout(*entry) for name, entry in own.items()}
    theirs = {name: ParamLayout(*entry) for name, entry in swarm.items()}
    notes = [
        f"{name} is {mine[name]} here but {theirs[name]} in the swarm"
        for name in mine
        if name in theirs and mine[name] != theirs[name]
    ]
    notes += [f"{name} exists only here" for name in mine if name not in theirs]
    notes += [f"{name} exists only in the swarm" for name in theirs if name not in mine]
    if not notes:
        return "the layouts agree; the parameter order differs"
    more = f" (and {len(notes) - limit} more)" if len(notes) > limit else ""
    return "; ".join(notes[:limit]) + more
