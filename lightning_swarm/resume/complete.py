"""Whether a checkpoint on disk is complete enough to resume from, without loading it.

``ckpt_path=last`` must never choose a checkpoint a resume would refuse or half-use.
``checkpoint_problem`` says what is wrong, or ``None``: a zip member failing its CRC, a swarm
record failing its checksum or Lightning's counters, a swarm file missing or with another size or
checksum. Imports torch only.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.errors import IntegrityError
from lightning_swarm.resume.files import swarm_root
from lightning_swarm.resume.integrity import check_file
from lightning_swarm.resume.records import SwarmRecord, check_loop_state


def checkpoint_problem(path: Path) -> str | None:
    """What keeps ``path`` from being resumed (one line), or ``None`` when it is complete."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"truncated or corrupt ({err})"
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
    except SwarmCheckpointError as err:
        return str(err)
    return _swarm_files_problem(path, record)


def _swarm_files_problem(path: Path, record: SwarmRecord) -> str | None:
    directory = swarm_root(path) / record.save_id
    for name, expected in sorted(record.files.items()):
        file = directory / name
        if not file.is_file():
            return f"swarm file {file} is missing"
        try:
            check_file(file, expected, verify=True)
        except IntegrityError as err:
            return str(err)
    return None
