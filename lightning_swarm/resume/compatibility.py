"""What the resuming run must share with the saving one, and what it may change. The layout
(no dtypes) must match before any tensor is read; a changed outer optimizer is refused; every
other changed option is described for one warning."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_swarm.algorithm.codecs import NO_CODEC
from lightning_swarm.algorithm.model_layout import Layout
from lightning_swarm.config import RESUME_OPTIONS
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.records import OptionsRecord
from lightning_swarm.resume.training_view import TrainingView

MESH_KEY = "island_mesh"


def layout_record(num_islands: int, layouts: Sequence[Layout], fragments: Any) -> dict[str, Any]:
    """The checkpoint's record of the layouts (one per optimizer): rank-independent, so each
    parameter's name and global shape only (a rank's slice follows from them and the mesh;
    dtypes may change between save and resume)."""
    return {
        "num_islands": int(num_islands),
        "params": [[[name, list(e.shape)] for name, e in layout.items()] for layout in layouts],
        "fragments": fragments,
    }


def current_fingerprint(host: TrainingView) -> dict[str, Any]:
    """This run's fingerprint, read off each outer state's ``layout``: the island count, every
    parameter's name and global shape, the island mesh when model-sharded (which, with the
    shapes, fixes each rank's slice) and, with Streaming DiLoCo, the fragments and schedule (a
    round in flight is applied at ``send_step + sync_delay`` to the fragment it was sent for)."""
    options, shards = host.options, host.model_shards
    fragments = None
    if options["num_fragments"] > 1 or options["sync_delay"] > 0:
        fragments = {
            "sync_every": options["sync_every"],
            "sync_delay": options["sync_delay"],
            "layout": [o.fragments for o in host.outer_syncs],
        }
    fingerprint = layout_record(
        host.topology.num_islands, [o.layout for o in host.outer_syncs], fragments
    )
    if shards is not None:
        fingerprint[MESH_KEY] = dict(shards.mesh)
    return fingerprint


def union_params(per_rank: Sequence[Sequence[Any]]) -> list[list[list[Any]]]:
    """Every rank's ``params`` of a fingerprint joined, per optimizer, in rank order (each name
    once): the whole model when pipeline stages hold different parameters; any rank's list
    otherwise."""
    merged: list[dict[str, Any]] = []
    for params in per_rank:
        for index, entries in enumerate(params):
            if len(merged) <= index:
                merged.append({})
            for name, shape in entries:
                merged[index].setdefault(name, shape)
    return [[[name, shape] for name, shape in m.items()] for m in merged]


def staged(fingerprint: Mapping[str, Any]) -> bool:
    """Whether the fingerprint's islands have pipeline stages."""
    return "pipeline_parallel" in (fingerprint.get(MESH_KEY) or {})


def compare_fingerprints(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise ``SwarmCheckpointError`` naming every difference between two fingerprints that a
    resume cannot bridge: the parameters and their global shapes, the optimizers, the
    fragments. The island count and mesh may differ (``resume.reshard``); a rank of a pipeline
    stage holds part of the saved parameters."""
    problems: list[str] = []
    saved_params, current_params = saved.get("params", []), current["params"]
    if len(saved_params) != len(current_params):
        problems.append(
            f"optimizers: checkpoint has {len(saved_params)}, this run has {len(current_params)}"
        )
    for index, (old_list, new_list) in enumerate(zip(saved_params, current_params, strict=False)):
        old, new = dict(old_list), dict(new_list)
        missing, extra = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
        if staged(current):
            missing = []  # this rank's stage holds some of the checkpoint's parameters
        if missing or extra:
            problems.append(
                f"optimizer {index} parameters renamed or changed: only in checkpoint {missing}, "
                f"only in this run {extra}"
            )
        for name in sorted(old.keys() & new.keys()):
            if list(old[name]) != list(new[name]):
                problems.append(
                    f"parameter {name!r} reshaped: checkpoint {old[name]}, this run {new[name]}"
                )
    if saved.get("fragments") != current.get("fragments"):
        problems.append(
            f"fragment layout: checkpoint has {saved.get('fragments')!r}, this run has "
            f"{current.get('fragments')!r}"
        )
    if problems:
        raise SwarmCheckpointError(
            "the checkpoint's swarm layout does not match this run: "
            + "; ".join(problems)
            + ". Resume with the same model, optimizers and fragments, or start from the plain "
            "weights (load them into the module without ckpt_path)."
        )


def refuse_unusable(saved: OptionsRecord, current: OptionsRecord) -> None:
    """Raise ``SwarmCheckpointError`` when the saved outer state cannot serve this run."""
    if saved.outer_optimizer != current.outer_optimizer:
        raise SwarmCheckpointError(
            f"outer optimizer {_one(saved.outer_optimizer)} -> {_one(current.outer_optimizer)}: "
            "the checkpoint's outer optimizer state belongs to the optimizer that wrote it and "
            "cannot be loaded into another. Resume with the same outer_optimizer, or start "
            "from the plain weights (load them into the module without ckpt_path)."
        )


def describe_changes(
    saved: OptionsRecord,
    current: OptionsRecord,
    *,
    inner_steps: Sequence[int],
    residuals_saved: bool,
) -> list[str]:
    """One line per changed option: ``name old -> new: what follows``."""
    lines: list[str] = []
    for name in RESUME_OPTIONS:
        old, new = saved[name], current[name]
        if old != new:
            effect = _effect(name, saved, current, inner_steps, residuals_saved)
            lines.append(f"{name} {_text(old)} -> {_text(new)}: {effect}")
    for index, (old_hp, new_hp) in enumerate(
        zip(saved.outer_hyperparameters, current.outer_hyperparameters, strict=False)
    ):
        for key in sorted(old_hp.keys() | new_hp.keys()):
            if old_hp.get(key) != new_hp.get(key):
                where = f"outer optimizer {index} " if len(current.outer_optimizer) > 1 else ""
                change = f"{where}{key} {_text(old_hp.get(key))} -> {_text(new_hp.get(key))}"
                if key == "momentum":  # a ramp sets it before every round from the built value
                    lines.append(
                        f"{change}: an outer momentum ramp scales the new {_text(new_hp.get(key))} "
                        f"from the next round on; with none (outer_momentum_warmup and _cooldown "
                        f"both 0) the checkpoint's {_text(old_hp.get(key))} stays in force"
                    )
                    continue
                lines.append(
                    f"{change}: the checkpoint's {_text(old_hp.get(key))} stays in force (torch's "
                    "Optimizer.load_state_dict restores the saved hyperparameters with the "
                    "outer state); set param_groups after the resume to change it"
                )
    return lines


def _effect(
    name: str,
    saved: OptionsRecord,
    current: OptionsRecord,
    inner_steps: Sequence[int],
    residuals_saved: bool,
) -> str:
    dropped = "the saved error-feedback residuals are dropped"
    if name == "sync_every":
        step = inner_steps[0] if inner_steps else 0
        due = (step // current["sync_every"] + 1) * current["sync_every"]
        was = (step // saved["sync_every"] + 1) * saved["sync_every"]
        return f"the next round comes at inner step {due} (it would have come at {was})"
    if name in ("num_fragments", "fragment_layout", "sync_delay"):
        return "the fragments and their schedule come out the same, so nothing changes"
    if name == "merge_alpha":
        alpha = current["merge_alpha"]
        return f"applied rounds now merge local <- (1 - {alpha:g}) * global + {alpha:g} * local"
    if name == "quantize":
        text = f"the next rounds send {current['quantize']} pseudo-gradients"
        if current["quantize"] == NO_CODEC and residuals_saved:
            text += f"; error feedback stops and {dropped}"
        return text
    if name == "quantize_block_size":
        return f"int8/int4 scales now cover blocks of {current['quantize_block_size']} elements"
    if name == "transport":
        return f"pseudo-gradients are averaged by the {current['transport']} transport from now on"
    if name == "error_feedback":
        if not current["error_feedback"]:
            return dropped if residuals_saved else "no residuals were saved, nothing is lost"
        return "residuals start at zero"
    if name == "anchor_dtype":
        return (
            f"the saved {saved['anchor_dtype']} anchors are converted to "
            f"{current['anchor_dtype']} on load (an eager copy in RAM, not memory-mapped)"
        )
    if name == "island_size":
        return f"the saved state is resharded onto islands of {current['island_size']} rank(s)"
    return "the resumed run differs from an uninterrupted one"


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _one(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else str(list(names))
