"""Lightning's checkpoint file: written atomically in place, and read with damage named (glue).
``TorchCheckpointIO``'s move of a temporary file is a copy across filesystems, which a full disk
leaves truncated; ``AtomicCheckpointIO`` writes local paths through ``atomic_save``."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.atomic import atomic_save
from lightning_swarm.resume.files import unreadable_error

_T = TypeVar("_T")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and name a full disk."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        text = str(path)
        if storage_options is not None or ("://" in text and not text.startswith("file://")):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        target = Path(text.removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(checkpoint, target)


def read_lightning_file(path: Any, load: Callable[[], _T]) -> _T:
    """``load()`` (Lightning reading ``path``); a truncated or corrupt file, and one this user
    cannot read (``access_problem``), raise ``SwarmCheckpointError`` naming ``path``. A missing
    file and a refusal to unpickle an object (the file is fine) keep their own errors."""
    try:
        return load()
    except (FileNotFoundError, SwarmCheckpointError):
        raise
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            raise
        raise _damaged(path, err) from err
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise (unreadable_error("checkpoint", path, err) or _damaged(path, err)) from err


def _damaged(path: Any, err: BaseException) -> SwarmCheckpointError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return SwarmCheckpointError(
        f"checkpoint {path} is truncated or corrupt and cannot be read ({type(err).__name__}: "
        f"{first}); a save into it was cut short or the file was damaged since. Resume from "
        "another checkpoint (ckpt_path=last in the CLI picks the newest complete one)."
    )
