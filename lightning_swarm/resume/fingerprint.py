"""The checkpoint's fingerprint: what must match between the run that saved and the one resuming.

A fingerprint is plain data (island count, parameter names and shapes per optimizer, the
fragment layout and schedule), stored in the checkpoint's swarm record and compared on resume
before any tensor is read. The names and shapes come from the model's layout
(``algorithm.model_layout``); its dtypes are not recorded, so a resume may change precision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_swarm.algorithm.model_layout import Layout
from lightning_swarm.errors import SwarmCheckpointError


def layout_fingerprint(
    num_islands: int,
    layouts: Sequence[Layout],
    fragments: Any = None,
) -> dict[str, Any]:
    """What must match between the saving and the resuming run.

    ``layouts`` holds each optimizer's parameters (``model_layout``); ``fragments`` is Streaming
    DiLoCo's layout and schedule (``None`` for plain DiLoCo: one fragment, no delay); it is
    compared as plain data.
    """
    return {
        "num_islands": int(num_islands),
        # Every record's stored form, [[name, shape], ...] per optimizer: no dtypes.
        "params": [
            [[name, list(entry.shape)] for name, entry in layout.items()] for layout in layouts
        ],
        "fragments": fragments,
    }


def compare_fingerprints(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise ``SwarmCheckpointError`` naming every difference between two fingerprints."""
    problems: list[str] = []
    if saved.get("num_islands") != current["num_islands"]:
        problems.append(
            f"island count: checkpoint has {saved.get('num_islands')}, this run has "
            f"{current['num_islands']} (devices x num_nodes / island_size)"
        )
    saved_params, current_params = saved.get("params", []), current["params"]
    if len(saved_params) != len(current_params):
        problems.append(
            f"optimizers: checkpoint has {len(saved_params)}, this run has {len(current_params)}"
        )
    for index, (old, new) in enumerate(zip(saved_params, current_params, strict=False)):
        problems.extend(_param_differences(index, dict(old), dict(new)))
    if saved.get("fragments") != current.get("fragments"):
        problems.append(
            f"fragment layout: checkpoint has {saved.get('fragments')!r}, this run has "
            f"{current.get('fragments')!r}"
        )
    if problems:
        raise SwarmCheckpointError(
            "the checkpoint's swarm layout does not match this run: "
            + "; ".join(problems)
            + ". Resume with the same model, optimizers, island count and fragments, or start "
            "from the plain weights (load them into the module without ckpt_path)."
        )


def _param_differences(
    index: int, old: dict[str, list[int]], new: dict[str, list[int]]
) -> list[str]:
    out: list[str] = []
    missing, extra = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    if missing or extra:
        out.append(
            f"optimizer {index} parameters renamed or changed: only in checkpoint {missing}, "
            f"only in this run {extra}"
        )
    for name in sorted(old.keys() & new.keys()):
        if list(old[name]) != list(new[name]):
            out.append(f"parameter {name!r} reshaped: checkpoint {old[name]}, this run {new[name]}")
    return out
