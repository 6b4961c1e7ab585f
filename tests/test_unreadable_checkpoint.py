"""A checkpoint this user cannot read is called that, not "truncated or corrupt" (issue 39,
item 5): the Lightning file, a swarm state file (its checksum and its load) and a candidate of
``ckpt_path=last`` each name the file, the permission and the fix.

The failures are real ones: the file's mode is 000, and where the tests run as root (which
ignores permission bits) the read runs with the effective user ``nobody``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.lightning_file import read_lightning_file
from lightning_swarm.resume.files import access_problem, load_swarm_file
from lightning_swarm.resume.integrity import check_file, checkpoint_problem, file_digest

NOBODY = 65534
DENIED = "cannot be read: permission denied ([Errno 13] Permission denied: "
FIX = "give the user running the fit read access to it, its folder and its .swarm folder"


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder ``nobody`` can enter (pytest's own are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="lightning_swarm-unreadable-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@contextlib.contextmanager
def unreadable(path: Path) -> Iterator[None]:
    """``path`` cannot be read for the block: mode 000, read as ``nobody`` when root."""
    path.chmod(0)
    root = os.geteuid() == 0
    if root:
        try:
            os.seteuid(NOBODY)
        except OSError as err:
            pytest.skip(f"cannot act as an unprivileged user here: {err}")
    try:
        yield
    finally:
        if root:
            os.seteuid(0)
        path.chmod(0o644)


def _saved(path: Path) -> Path:
    torch.save({"format": 1, "state_dict": {"w": torch.ones(3)}}, path)
    return path


def test_a_lightning_file_without_read_permission_says_so(folder: Path) -> None:
    ckpt = _saved(folder / "step=4.ckpt")
    with unreadable(ckpt), pytest.raises(SwarmCheckpointError) as caught:
        read_lightning_file(ckpt, lambda: TorchCheckpointIO().load_checkpoint(ckpt))
    message = str(caught.value)
    assert message.startswith(f"checkpoint {ckpt} {DENIED}'{ckpt}')"), message
    assert FIX in message and "truncated or corrupt" not in message
    assert isinstance(caught.value.__cause__, PermissionError)


def test_a_swarm_file_without_read_permission_says_so(folder: Path) -> None:
    path = _saved(folder / "anchors.pt")
    with unreadable(path), pytest.raises(SwarmCheckpointError) as caught:
        load_swarm_file(path, mmap=True)
    message = str(caught.value)
    assert message.startswith(f"swarm state file {path} {DENIED}"), message
    assert FIX in message and "truncated or corrupt" not in message


def test_a_swarm_file_checksum_without_read_permission_says_so(folder: Path) -> None:
    path = _saved(folder / "island-00000.pt")
    expected = file_digest(path)
    with unreadable(path), pytest.raises(SwarmCheckpointError) as caught:
        check_file(path, expected, verify=True)
    message = str(caught.value)
    assert message.startswith(f"swarm state file {path} {DENIED}"), message
    assert FIX in message


def test_last_names_an_unreadable_candidate_for_what_it_is(folder: Path) -> None:
    ckpt = _saved(folder / "step=4.ckpt")
    with unreadable(ckpt):
        problem = checkpoint_problem(ckpt)
    assert problem is not None and problem.startswith("unreadable: permission denied"), problem
    assert FIX in problem


def test_a_format_error_is_not_taken_for_the_filesystems() -> None:
    # torch's reader fails some truncated files with EINVAL (a seek before the start): damage.
    assert access_problem(OSError(errno.EINVAL, "Invalid argument")) is None
    assert access_problem(RuntimeError("PytorchStreamReader failed reading zip archive")) is None


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.EISDIR, "it is a directory ([Errno 21] x: 'f'); give the path of a checkpoint"),
        (errno.EIO, "the filesystem failed (OSError: [Errno 5] x: 'f'), not the file's format"),
    ],
)
def test_other_errors_of_the_filesystem_are_named(code: int, reason: str) -> None:
    problem = access_problem(OSError(code, "x", "f"))
    assert problem is not None and problem.startswith(reason), problem
