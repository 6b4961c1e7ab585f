"""Options changed between the saving and the resuming run: what still works, and what follows.

``describe_changes`` names each change that leaves the saved state usable, with its old and new
value and the consequence, for the caller to warn once; ``refuse_unusable`` raises for the rest.
Layout changes are refused earlier, by the layout fingerprint (``resume/fingerprint.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_swarm.algorithm.codecs import NO_CODEC
from lightning_swarm.config import RESUME_OPTIONS
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.records import OptionsRecord


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
                lines.append(
                    f"{where}{key} {_text(old_hp.get(key))} -> {_text(new_hp.get(key))}: the "
                    f"checkpoint's {_text(old_hp.get(key))} stays in force (torch's "
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
        return f"each island's saved state now seeds {current['island_size']} rank(s)"
    return "the resumed run differs from an uninterrupted one"


def _text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _one(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else str(list(names))
