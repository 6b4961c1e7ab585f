"""Writing one checkpoint file all at once or not at all, and saying so when the disk is full.
``atomic_save`` is the package's only writer: a reader sees the old file or the whole new one."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from lightning_swarm.errors import DiskFullError

_FULL = (errno.ENOSPC, errno.EDQUOT)


def _open_for_write(path: Path) -> IO[bytes]:
    # One seam for tests: a full disk is simulated by returning a writer that fails.
    return open(path, "wb")


class _ErrorKeepingWriter:
    """The file object torch writes through: keeps the ``OSError`` torch's zip writer hides."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        try:
            self.handle.flush()
        except OSError as err:
            self.error = err
            raise


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` into ``path`` through a temporary file in the same directory, fsync,
    rename and fsync of the directory; ``DiskFullError`` (nothing new left) on a full device."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer: _ErrorKeepingWriter | None = None
    try:
        with _open_for_write(tmp) as handle:
            writer = _ErrorKeepingWriter(handle)
            torch.save(obj, writer)  # type: ignore[arg-type]  # has write(): all torch needs
            writer.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if is_disk_full(err, writer.error if writer is not None else None):
            raise disk_full(path, needed=payload_bytes(obj)) from err
        raise
    directory = os.open(path.parent, os.O_RDONLY)  # make the rename durable
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def is_disk_full(err: BaseException, seen: OSError | None = None) -> bool:
    """Whether ``err`` (or what caused it, or the write error ``seen``) is a full device."""
    return any(isinstance(c, OSError) and c.errno in _FULL for c in (seen, *_chain(err)))


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def disk_full(path: Path, *, needed: int) -> DiskFullError:
    try:
        free: int | None = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    free_text = f"{free:,} bytes are free there" if free is not None else "free space unknown"
    return DiskFullError(
        f"no space left on device writing {path}: it needs about {needed:,} bytes "
        f"({needed / 2**20:.1f} MiB), {free_text}. The partial file was removed. Free space "
        "on that filesystem, or write checkpoints to a larger one (ModelCheckpoint(dirpath=...)).",
        str(path),
    )


def payload_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor storage in ``obj``: about what ``torch.save`` writes."""
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return sum(seen.values())
