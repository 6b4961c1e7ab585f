"""The swarm part of a checkpoint on disk: ``model.ckpt.swarm/<save_id>/`` beside ``model.ckpt``.
Files are renamed into place, the Lightning file last, so a crash leaves the previous checkpoint
whole and a mapped file is never rewritten. Everything loads with ``weights_only=True``."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import re
import shutil
import socket
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_swarm.errors import SwarmCheckpointError, SwarmConfigError
from lightning_swarm.memory.procfs import pid_alive

MMAP_ENV = "LIGHTNING_SWARM_ANCHOR_MMAP"
ANCHORS_FILE = "anchors.pt"
_CLAIM_SUFFIX = ".writing"
log = logging.getLogger("lightning_swarm")
_ZIP_MAGIC = b"PK\x03\x04"
_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
# What a save directory may hold: its files, and the temporary names they are written under.
_SAVE_FILE = re.compile(
    r"\.?(anchors\.pt|anchors-rank-\d{5}\.pt|island-\d{5}(-rank-\d{5})?\.pt)(\.tmp-\d+)?"
)


def swarm_root(ckpt_path: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(ckpt_path) + ".swarm")


def island_file_name(island: int) -> str:
    return f"island-{island:05d}.pt"


def island_rank_file_name(island: int, position: int) -> str:
    return f"island-{island:05d}-rank-{position:05d}.pt"


def anchor_shard_file_name(position: int) -> str:
    return f"anchors-rank-{position:05d}.pt"


def anchor_shard_names(files: Mapping[str, Any]) -> list[str]:
    """The anchor shard files a record lists, in position order (none unsharded)."""
    return sorted(n for n in files if n.startswith("anchors-rank-") and n.endswith(".pt"))


def require_local_path(path: str | os.PathLike[str], *, what: str) -> Path:
    """``path`` as a local ``Path``; fsspec URLs such as ``s3://`` are refused."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise SwarmCheckpointError(
            f"{what} {text!r} is not a local path; SwarmStrategy writes each island's state and "
            "maps the anchors next to the checkpoint, which needs a local or shared filesystem. "
            "Point ModelCheckpoint(dirpath=...) / ckpt_path at one."
        )
    return Path(text.removeprefix("file://"))


def check_writable(dirpath: str | os.PathLike[str], *, where: str = "") -> None:
    """Create checkpoint directory ``dirpath`` if missing (as Lightning does at its first save)
    and create and remove an empty file in it, so that a directory no save could write is
    found before training. An fsspec URL is not checked (Lightning writes it through fsspec;
    the first swarm save refuses it).
    ``where`` (``"rank 3: "`` or ``""``) opens the message.

    Raises:
        SwarmCheckpointError: the directory cannot be created or written (a read-only
            filesystem, no permission, a file in its place); the message names it and the fix.
    """
    text = os.fspath(dirpath)
    if "://" in text and not text.startswith("file://"):
        return
    path = Path(text.removeprefix("file://"))
    probe = path / f".lightning_swarm-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        probe.unlink()
    except OSError as err:
        raise SwarmCheckpointError(
            f"{where}checkpoint directory {path} cannot be written ({type(err).__name__}: "
            f"{err}), so no checkpoint could be saved in it. Point ModelCheckpoint"
            "(dirpath=...) (or Trainer(default_root_dir=...)) at a directory every saving rank "
            "can write, or make this one writable (its permissions, or a read-write mount)."
        ) from err


def resolve_mmap(config_mmap: bool) -> tuple[bool, str]:
    """Whether to map anchors, and which switch decided it: the config (``anchors.mmap``) and
    ``LIGHTNING_SWARM_ANCHOR_MMAP=0`` can only turn mapping off, never silently."""
    raw = os.environ.get(MMAP_ENV)
    if raw is not None:
        value = raw.strip().lower()
        if value not in _FALSE | _TRUE:
            raise SwarmConfigError(
                f"{MMAP_ENV}={raw!r} is not understood; set it to 0 to read anchors eagerly or "
                "1 (or unset it) to map them."
            )
        if value in _FALSE:
            return False, f"eager read ({MMAP_ENV}={raw})"
    if not config_mmap:
        return False, "eager read (anchors.mmap=false)"
    return True, "memory-mapped"


def prune_saves(root: Path, keep: str) -> None:
    """Remove every save directory under ``root`` except ``keep`` (after the new file exists)."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:  # a writer's claim (``claim_save``), this save's included: it is complete now
            entry.unlink(missing_ok=True)


def claim_save(root: Path, save_id: str) -> Path:
    """Mark save ``save_id`` as being written by this process, so another process sharing the
    folder (an elastic island) never takes it for an orphan. The claim goes when the save
    completes or is discarded; one left by a crash holds until its writer is known dead."""
    root.mkdir(parents=True, exist_ok=True)
    claim = root / f"{save_id}{_CLAIM_SUFFIX}"
    tmp = root / f".{claim.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    os.replace(tmp, claim)
    return claim


def begin_save(root: Path) -> str:
    """Draw a new save id, claim it, and remove interrupted saves of the folder (rank 0). The
    claim comes first: an elastic island pruning the same folder must not take this save."""
    save_id = uuid.uuid4().hex[:12]
    claim_save(root, save_id)
    for orphan in remove_orphan_saves(root.parent, keep=root):
        log.info("removed %s: its checkpoint file was never written (interrupted save)", orphan)
    return save_id


def discard_save(root: Path, save_id: str) -> None:
    """Remove the files of save ``save_id`` (and ``root`` when nothing else is in it)."""
    shutil.rmtree(root / save_id, ignore_errors=True)
    (root / f"{save_id}{_CLAIM_SUFFIX}").unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: an older save lives there
        root.rmdir()


def _writer_may_live(claim: Path) -> bool:
    # Only a writer on this host whose pid is gone is known dead: a save is never removed
    # while it might be in progress.
    try:
        writer = json.loads(claim.read_text())
        host, pid = str(writer["host"]), int(writer["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return host != socket.gethostname() or pid_alive(pid)


def remove_orphan_saves(folder: Path, *, keep: Path) -> list[Path]:
    """Remove (and return) ``<name>.swarm`` directories in ``folder`` whose ``<name>`` file does
    not exist, except ``keep``, one holding anything a save does not write, or one claimed by a
    writer that may still be alive."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if entry.name.endswith(".swarm") and entry.name != keep.name and _is_orphan(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _is_orphan(root: Path) -> bool:
    # lexists: a dangling last.ckpt symlink still names its directory.
    if not root.is_dir() or root.is_symlink() or os.path.lexists(str(root)[: -len(".swarm")]):
        return False
    for save in root.iterdir():
        if save.name.endswith(_CLAIM_SUFFIX) and save.is_file():
            if _writer_may_live(save):  # another process's save in progress
                return False
            continue
        if not save.is_dir() or save.is_symlink():
            return False
        if not all(_SAVE_FILE.fullmatch(f.name) and f.is_file() for f in save.iterdir()):
            return False
    return True


# A read that failed for one of these is the filesystem's doing, not the bytes' (a truncated
# file can make torch's reader fail with EINVAL, which therefore is not among them).
_NO_ACCESS = {errno.EACCES, errno.EPERM}
_NOT_FORMAT = _NO_ACCESS | {errno.EISDIR, errno.ENOTDIR, errno.EIO, errno.ESTALE}


def access_problem(err: BaseException) -> str | None:
    """Why a file could not be read where its filesystem, not its contents, is at fault (no
    permission, a directory in its place, an I/O error), with the fix; ``None`` for any other
    error (the file's format, e.g. a truncated file)."""
    if not isinstance(err, OSError) or err.errno not in _NOT_FORMAT:
        return None
    if err.errno in _NO_ACCESS:
        return (
            f"permission denied ({err}); the file may well be intact: give the user running "
            "the fit read access to it, its folder and its .swarm folder"
        )
    if err.errno == errno.EISDIR:
        return f"it is a directory ({err}); give the path of a checkpoint file"
    return (
        f"the filesystem failed ({type(err).__name__}: {err}), not the file's format; check "
        "the path, the disk or the mount"
    )


def unreadable_error(what: str, path: Any, err: BaseException) -> SwarmCheckpointError | None:
    """``SwarmCheckpointError`` saying why ``what`` ``path`` could not be read when
    ``access_problem`` knows; ``None`` otherwise (the caller reports damage)."""
    problem = access_problem(err)
    if problem is None:
        return None
    return SwarmCheckpointError(
        f"{what} {path} cannot be read: {problem}; then try again, or resume from another "
        "checkpoint."
    )


def load_swarm_file(path: Path, *, mmap: bool) -> tuple[dict[str, Any], bool]:
    """Load one swarm file: ``(payload, legacy)``; a torch legacy (non-zipfile) file cannot be
    mapped and is read eagerly. A missing, unreadable (``access_problem``), truncated or corrupt
    file is a ``SwarmCheckpointError``."""
    if not path.is_file():
        raise SwarmCheckpointError(
            f"swarm state file {path} is missing; the checkpoint is incomplete (a save was "
            "interrupted, or the .swarm directory was not copied with the .ckpt file). Copy it "
            "along or resume from another checkpoint."
        )
    try:
        with open(path, "rb") as handle:
            legacy = handle.read(4) != _ZIP_MAGIC
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and not legacy)
    except Exception as err:
        raise _load_error(path, err) from err
    if not isinstance(payload, dict) or not isinstance(payload.get("format"), int):
        raise SwarmCheckpointError(
            f"{path} is not a lightning_swarm state file (no format number); resume from a "
            "checkpoint written by SwarmStrategy."
        )
    return payload, legacy


def _load_error(path: Path, err: Exception) -> SwarmCheckpointError:
    # A file this user cannot read, and a refusal to unpickle one object (the file is fine),
    # are told from damage.
    unreadable = unreadable_error("swarm state file", path, err)
    if unreadable is not None:
        return unreadable
    text = str(err)
    if isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in text:
        match = _REFUSED_GLOBAL.search(text)
        name = match.group(1) if match else None
        what = f"an object of type {name}" if name else "an object"
        allow = name or "TheClass"
        return SwarmCheckpointError(
            f"swarm state file {path} is readable, but torch.load(weights_only=True) refuses to "
            f"unpickle {what} in it: the module's state (get_extra_state()) or an optimizer's "
            "state holds something other than tensors, numbers, strings and plain containers. "
            "Keep extra and optimizer state to those types and save again, or, if you trust "
            f"the file, allow the type before resuming: torch.serialization.add_safe_globals"
            f"([{allow}])."
        )
    first_line = text.splitlines()[0] if text else ""
    return SwarmCheckpointError(
        f"swarm state file {path} is truncated or corrupt ({type(err).__name__}: {first_line}); "
        "resume from another checkpoint."
    )


def warn_legacy(paths: Sequence[Path]) -> None:
    if paths:
        warnings.warn(
            f"{', '.join(str(p) for p in paths)} use torch's legacy (non-zipfile) format, which "
            "cannot be memory-mapped; read eagerly into RAM instead. Re-save with a current "
            "torch.save (zipfile format) to restore mapping.",
            stacklevel=4,
        )
