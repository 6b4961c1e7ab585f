"""A model's layout (parameter names, shapes, dtypes) and its fingerprint.

Two islands can average pseudo-gradients only when their parameters line up name by name. The
fingerprint is a 63-bit hash of the layout that travels in each round's header; the layout
itself travels with a heal, so that a joiner whose model differs is refused with the names of
the parameters that differ.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from torch import Tensor

Layout = dict[str, str]
"""Parameter name -> "shape dtype", e.g. ``{"fc.weight": "(4, 8) float32"}``."""


def model_layout(params: Mapping[str, Tensor]) -> Layout:
    return {
        name: f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
        for name, p in params.items()
    }


def fingerprint(layout: Layout) -> int:
    digest = hashlib.sha256(json.dumps(sorted(layout.items())).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def describe_difference(own: Layout, swarm: Layout, limit: int = 3) -> str:
    """The first differences between this island's layout and the swarm's, in words."""
    notes = [
        f"{name} is {own[name]} here but {swarm[name]} in the swarm"
        for name in own
        if name in swarm and own[name] != swarm[name]
    ]
    notes += [f"{name} exists only here" for name in own if name not in swarm]
    notes += [f"{name} exists only in the swarm" for name in swarm if name not in own]
    if not notes:
        return "the layouts agree; the parameter order differs"
    more = f" (and {len(notes) - limit} more)" if len(notes) > limit else ""
    return "; ".join(notes[:limit]) + more
