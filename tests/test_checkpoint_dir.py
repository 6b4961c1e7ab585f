"""A checkpoint directory no save could write is found before training (issue 39, item 5):
``SwarmCheckpointer.check_dirs`` raises one ``SwarmCheckpointError`` on every rank, naming the
directory and the fix, instead of a raw ``OSError`` on rank 0 at the first save while the other
islands see their peer's connection close.

The failures are real ones: a read-only filesystem (a tmpfs mounted read-only; root only, since
root ignores permission bits) and a regular file where a parent directory should be.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_swarm.errors import SwarmCheckpointError, SwarmError
from lightning_swarm.resume import Collectives, SwarmCheckpointer
from lightning_swarm.resume.files import check_writable
from tests.dist_utils import run_ranks

FIX = "Point ModelCheckpoint(dirpath=...) (or Trainer(default_root_dir=...)) at a directory"


@contextlib.contextmanager
def read_only_mount(path: Path) -> Iterator[None]:
    """``path`` as an empty read-only tmpfs for the block; skips where this cannot be done."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only tmpfs needs root")
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_missing_directory_is_created_and_left_empty(tmp_path: Path) -> None:
    dirpath = tmp_path / "runs" / "checkpoints"
    check_writable(dirpath)
    assert dirpath.is_dir() and list(dirpath.iterdir()) == []


def test_a_directory_on_a_read_only_filesystem_is_refused(tmp_path: Path) -> None:
    # The directory exists: creating it succeeds, only writing in it fails.
    mounted = tmp_path / "ro"
    with read_only_mount(mounted), pytest.raises(SwarmCheckpointError) as caught:
        check_writable(mounted)
    message = str(caught.value)
    assert message.startswith(f"checkpoint directory {mounted} cannot be written (OSError: ")
    assert "Read-only file system" in message
    assert FIX in message and "a read-write mount" in message
    assert isinstance(caught.value.__cause__, OSError)


def test_a_directory_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    (tmp_path / "logs").write_text("a file where the directory should be")
    dirpath = tmp_path / "logs" / "checkpoints"
    with pytest.raises(SwarmCheckpointError) as caught:
        check_writable(dirpath, where="rank 2: ")
    message = str(caught.value)
    assert message.startswith(f"rank 2: checkpoint directory {dirpath} cannot be written")
    assert "NotADirectoryError" in message and FIX in message
    assert isinstance(caught.value, SwarmError)


def test_unresolved_and_remote_directories_are_left_to_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a URL taken for a path would be made here, as "s3:/bucket"
    comm = Collectives(0, lambda obj: obj, lambda name: None)
    SwarmCheckpointer().check_dirs([None, "s3://bucket/checkpoints"], comm)
    assert list(tmp_path.iterdir()) == []


def _check_on_two_ranks(rank: int, world: int, tmp: str) -> None:
    # Rank 0's directory cannot be created; rank 1's is fine: both must raise rank 0's error.
    root = Path(tmp)
    dirpath = root / "blocked" / "checkpoints" if rank == 0 else root / f"rank{rank}"
    comm = Collectives(rank, lambda obj: obj, lambda name: None)
    try:
        SwarmCheckpointer().check_dirs([dirpath], comm)
        outcome = ("no error", "")
    except Exception as err:  # the test reports whatever was raised
        outcome = (type(err).__name__, str(err))
    torch.save(outcome, root / f"outcome{rank}.pt")


def test_every_rank_raises_when_one_rank_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "blocked").write_text("a file where the directory should be")
    run_ranks(_check_on_two_ranks, 2, str(tmp_path), timeout_s=60)
    outcomes = [torch.load(tmp_path / f"outcome{r}.pt") for r in range(2)]
    blocked = tmp_path / "blocked" / "checkpoints"
    for kind, message in outcomes:
        assert kind == "SwarmCheckpointError", (kind, message)
        assert message.startswith(f"rank 0: checkpoint directory {blocked} cannot be written")
        assert FIX in message
    assert (tmp_path / "rank1").is_dir()
