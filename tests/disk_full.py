"""Simulating a full disk for checkpoint writes, without root: a writer that fails part-way.

``fail_writes(monkeypatch, match)`` makes every checkpoint file whose temporary path contains
``match`` fail with ``OSError(ENOSPC)`` after ``after_bytes`` bytes, as a full device does: the
first bytes land, then the write is refused. It patches the one seam every checkpoint write
goes through (``lightning_swarm.resume.atomic._open_for_write``); forked ranks inherit it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any

import pytest

from lightning_swarm.resume import atomic


class FullAfter:
    """A binary file that accepts ``limit`` bytes and then fails with ENOSPC."""

    def __init__(self, handle: IO[bytes], limit: int) -> None:
        self.handle = handle
        self.limit = limit
        self.written = 0

    def write(self, data: Any) -> int:
        room = self.limit - self.written
        view = memoryview(data).cast("B")
        if len(view) > room:
            self.handle.write(view[: max(room, 0)])
            self.written = self.limit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += len(view)
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> FullAfter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fail_writes(
    monkeypatch: pytest.MonkeyPatch, where: str, name: str = "", *, after_bytes: int = 1000
) -> None:
    """Fail each checkpoint write whose path contains ``where`` and whose file name contains
    ``name``, after ``after_bytes`` bytes."""
    real = atomic._open_for_write

    def open_for_write(path: Path) -> Any:
        handle = real(path)
        hit = where in str(path) and name in path.name
        return FullAfter(handle, after_bytes) if hit else handle

    monkeypatch.setattr(atomic, "_open_for_write", open_for_write)


def leftovers(folder: Path) -> list[Path]:
    """Temporary files of interrupted writes anywhere under ``folder``."""
    return [p for p in folder.rglob("*") if ".tmp-" in p.name]
