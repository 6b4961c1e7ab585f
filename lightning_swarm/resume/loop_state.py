"""Lightning's own counters in a checkpoint dict, and their cross-check with the swarm record.

A resume takes the step from Lightning's loop state and the anchors from the swarm files; if they
disagreed the run would silently continue from a step the anchors were not saved at. So the save
writes Lightning's counters into the checksummed swarm record and a resume refuses a mismatch,
naming both. Counters a checkpoint lacks are ``None`` and not compared. No lightning import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.records import SwarmRecord

_AUTOMATIC = "epoch_loop.automatic_optimization.optim_progress"
_MANUAL = "epoch_loop.manual_optimization.optim_step_progress"


def optimizer_steps(checkpoint: Mapping[str, Any]) -> int | None:
    """Completed optimizer steps in Lightning's fit-loop state (automatic + manual)."""
    try:
        loop = checkpoint["loops"]["fit_loop"]
        automatic = int(loop[_AUTOMATIC]["optimizer"]["step"]["total"]["completed"])
        manual = int(loop[_MANUAL]["total"]["completed"])
    except (KeyError, TypeError, ValueError):
        return None
    return automatic + manual


def global_step(checkpoint: Mapping[str, Any]) -> int | None:
    value = checkpoint.get("global_step")
    return int(value) if isinstance(value, int) else None


def check_loop_state(record: SwarmRecord, checkpoint: Mapping[str, Any], ckpt_path: Any) -> None:
    """Refuse a Lightning file whose counters differ from the ones its swarm record saved.

    Raises:
        SwarmCheckpointError: naming the counter and both values.
    """
    pairs = (
        ("global_step", record.global_step, global_step(checkpoint)),
        (
            "optimizer steps (fit_loop's optimizer step progress)",
            record.optimizer_steps,
            optimizer_steps(checkpoint),
        ),
    )
    for name, saved, found in pairs:
        if saved is not None and found is not None and saved != found:
            raise SwarmCheckpointError(
                f"{ckpt_path}: Lightning's {name} is {found}, but its swarm record was saved at "
                f"{saved}; the file was changed or damaged after the save, and resuming would "
                "continue from a step the anchors were not saved at. Resume from another "
                "checkpoint."
            )
