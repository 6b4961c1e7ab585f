"""Integrity of a checkpoint: file sizes and XXH3-128 checksums, finite values, completeness.
Hashing reuses one chunk buffer; the finiteness scan only reads, so mapped anchors stay mapped."""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import Tensor

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.errors import IntegrityError
from lightning_swarm.resume.files import access_problem, swarm_root, unreadable_error
from lightning_swarm.resume.records import FileDigest, SwarmRecord, check_loop_state

CHUNK_BYTES = 8 * 2**20
_SCAN_NUMEL = 2**22


def file_digest(path: Path, *, chunk_bytes: int = CHUNK_BYTES) -> FileDigest:
    state = xxhash.xxh3_128()
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            state.update(view[:count])
            total += count
    return FileDigest(total, state.hexdigest())


def check_file(path: Path, expected: FileDigest, *, verify: bool) -> None:
    """Raise ``IntegrityError`` if ``path`` differs from its record: the size always, the
    checksum only with ``verify``; ``SwarmCheckpointError`` if it cannot be read
    (``access_problem``)."""
    try:
        _check_file(path, expected, verify=verify)
    except OSError as err:
        unreadable = unreadable_error("swarm state file", path, err)
        if unreadable is None:
            raise
        raise unreadable from err


def _check_file(path: Path, expected: FileDigest, *, verify: bool) -> None:
    size = path.stat().st_size
    if size != expected.num_bytes:
        raise IntegrityError(
            f"swarm state file {path} is truncated or corrupt ({size} bytes, its checkpoint "
            f"recorded {expected.num_bytes}); resume from another checkpoint."
        )
    if not verify:
        return
    found = file_digest(path)
    if found.digest != expected.digest:
        raise IntegrityError(
            f"swarm state file {path}: checksum mismatch (xxh3-128 {found.digest}, its "
            f"checkpoint recorded {expected.digest}); the file was damaged after it was written "
            "(disk, copy or transfer). Resume from another checkpoint, or restore the file from "
            "a good copy. anchors.verify=false skips this check."
        )


def check_finite(tensors: Mapping[str, Any], *, source: Path, what: str) -> None:
    """Raise ``IntegrityError`` naming ``source`` and the first floating tensor holding NaN or
    inf (values that are not floating tensors are skipped)."""
    for name, value in tensors.items():
        if isinstance(value, Tensor) and value.is_floating_point() and not _finite(value):
            raise IntegrityError(
                f"non-finite values in {source}: {name} ({what} holds NaN or inf). The run "
                "had diverged before this checkpoint was saved; the file itself is intact. "
                "Resume from an earlier checkpoint."
            )


def _finite(tensor: Tensor) -> bool:
    # min and max of each chunk: NaN propagates into both, an inf is one of them. Unlike
    # isfinite(), no chunk-sized temporary is allocated (faster, and no heap growth).
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), _SCAN_NUMEL):
        low, high = torch.aminmax(flat[start : start + _SCAN_NUMEL])
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            return False
    return True


def checkpoint_problem(path: Path) -> str | None:
    """What keeps ``path`` from being resumed (one line), or ``None`` when it is complete, without
    loading it: ``ckpt_path=last`` must never choose a checkpoint a resume would refuse."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        problem = access_problem(err)
        return f"truncated or corrupt ({err})" if problem is None else f"unreadable: {problem}"
    if bad is not None:
        return f"corrupt: member {bad} fails its CRC-32"
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # any failure to read is a reason not to choose it
        return f"unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    try:
        record = SwarmRecord.of(checkpoint, "its swarm record")
        if record is None:
            return None  # a plain Lightning checkpoint: nothing more to check
        check_loop_state(record, checkpoint, path)
        for name, expected in sorted(record.files.items()):
            file = swarm_root(path) / record.save_id / name
            if not file.is_file():
                return f"swarm file {file} is missing"
            check_file(file, expected, verify=True)
    except SwarmCheckpointError as err:
        return str(err)
    return None
