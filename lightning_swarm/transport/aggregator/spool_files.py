"""Spool files: one peer's contribution to one round, written and read under a lease.

``SpoolWriter`` writes ``<name>.partial`` (mode 0600), sized up front with ``posix_fallocate``
(a full disk fails before data arrives), and renames it only once every byte is in place; an
error removes it. ``SpoolReader`` checks the file against the layout and copies element ranges
out of a ``safe_open`` mapping into caller-owned tensors, remapping every ``remap_bytes``. Both
hold a ``Lease`` from construction to ``commit`` / ``abort`` / ``close``.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from safetensors import SafetensorError, safe_open
from torch import Tensor

from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadLayout

WriteAt = Callable[[int, memoryview, int], int]  # os.pwrite's signature: (fd, data, offset)


class Lease(Protocol):
    """One writer's or reader's hold on one spool file, handed out by the spool.

    Attributes:
        path: the file's final name (a writer fills ``partial_path(path)`` first).
        root: the spool root, for error messages.
        write_at: the positional write to use (``os.pwrite``; tests inject faults).
    """

    path: Path
    root: Path
    write_at: WriteAt

    def allocated(self, nbytes: int) -> None:
        """Count ``nbytes`` of disk as held by this file."""

    def remove(self) -> None:
        """Delete the file and its partial twin now, and forget its bytes."""

    def release(self) -> None:
        """Drop the hold; the spool may delete the file once no lease remains. Call once."""


def _describe_os_error(err: OSError, what: str, root: Path) -> str:
    if err.errno == errno.ENOSPC:
        return (
            f"out of disk space (ENOSPC) {what} in spool root {root}; free space there or set "
            "spool_dir to a local disk with room for about peers x payload bytes per round"
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"spool root {root} is not writable ({err.strerror}) {what}; set spool_dir to a "
            "writable local directory"
        )
    return f"spool I/O error {what} in {root}: {err}"


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


class SpoolWriter:
    """Fills one preallocated spool file; ``commit`` publishes it, ``abort`` removes it.

    Use as a context manager: leaving the block by an exception aborts.
    """

    def __init__(self, lease: Lease, layout: PayloadLayout, metadata: dict[str, str]) -> None:
        self.lease, self.path, self.layout = lease, lease.path, layout
        path = self.path
        self.header = layout.safetensors_header(metadata)
        self.total_bytes = len(self.header) + layout.data_bytes
        self.written = 0
        self._fd: int | None = None
        self._done = False  # committed or discarded: the lease is gone
        self._committed = False
        what = f"creating {path.name} ({self.total_bytes} bytes)"
        try:
            self._fd = os.open(
                partial_path(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600
            )
            lease.allocated(self.total_bytes)
            _preallocate(self._fd, self.total_bytes)
            self._write_all(memoryview(self.header), 0)
        except OSError as err:
            # Remove what exists but keep the lease: ``Spool.writer`` releases it.
            self._close_and_unlink()
            self._done = True
            raise SpoolError(_describe_os_error(err, what, lease.root)) from err

    def _write_all(self, data: memoryview, offset: int) -> None:
        assert self._fd is not None
        while len(data):
            n = self.lease.write_at(self._fd, data, offset)
            if n <= 0:
                raise OSError(errno.EIO, "positional write made no progress")
            data, offset = data[n:], offset + n

    def write(self, data_offset: int, chunk: Tensor) -> None:
        """Write ``chunk`` (contiguous CPU uint8) at ``data_offset`` of the data section."""
        if self._done:
            raise SpoolError(f"{self.path.name} is already committed or aborted")
        if data_offset < 0 or data_offset + chunk.numel() > self.layout.data_bytes:
            self._discard()
            raise SpoolError(
                f"chunk [{data_offset}, {data_offset + chunk.numel()}) lies outside the "
                f"{self.layout.data_bytes}-byte payload of {self.path.name}"
            )
        try:
            self._write_all(chunk.numpy().data.cast("B"), len(self.header) + data_offset)
        except OSError as err:
            self._discard()
            what = f"writing {self.path.name} at byte {data_offset}"
            raise SpoolError(_describe_os_error(err, what, self.lease.root)) from err
        self.written += chunk.numel()

    def commit(self) -> Path:
        """Check that every byte arrived, close and publish the file under its final name."""
        if self._done:
            raise SpoolError(f"{self.path.name} is already committed or aborted")
        if self.written != self.layout.data_bytes:
            self._discard()
            raise SpoolError(
                f"{self.path.name} is incomplete: {self.written} of {self.layout.data_bytes} "
                "payload bytes were written"
            )
        assert self._fd is not None
        try:
            os.close(self._fd)
            self._fd = None
            os.replace(partial_path(self.path), self.path)
        except OSError as err:
            self._discard()
            raise SpoolError(_describe_os_error(err, "publishing", self.lease.root)) from err
        self._done = self._committed = True
        self.lease.release()
        return self.path

    def abort(self) -> None:
        """Drop the partial file; a committed file is the spool's to delete. Idempotent."""
        if not self._committed:
            self._discard()

    def _discard(self) -> None:
        if not self._done:
            self._close_and_unlink()
            self._done = True
            self.lease.release()

    def _close_and_unlink(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.lease.remove()

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def _preallocate(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        # Some filesystems cannot preallocate; a sparse file of the right size still works,
        # and a full disk is then reported by the first write that hits it.
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)


class SpoolReader:
    """Copies element ranges of one committed spool file into caller-owned tensors."""

    def __init__(self, lease: Lease, layout: PayloadLayout, *, remap_bytes: int):
        self.lease, self.path, self.layout = lease, lease.path, layout
        self.remap_bytes = remap_bytes
        self._handle: Any = None
        self._touched = 0
        self._closed = False
        self._check()

    def _check(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
                header = head + f.read(max(0, min(header_len, 2**26)))
        except FileNotFoundError as err:
            raise SpoolError(
                f"no committed spool file {self.path.name}: its write never completed"
            ) from err
        meta_free = self.layout.safetensors_header()
        expected = len(header) + self.layout.data_bytes
        if header_len < 0 or len(header) < 8 + header_len:
            raise SpoolError(f"spool file {self.path.name} is truncated inside its header")
        if not _same_tensors(header, meta_free):
            raise SpoolError(
                f"spool file {self.path.name} is corrupt: its header does not describe the "
                "expected tensors"
            )
        if size != expected:
            state = "truncated" if size < expected else "corrupt (longer than its layout)"
            raise SpoolError(f"spool file {self.path.name} is {state}: {size} of {expected} bytes")

    def read_into(self, name: str, start: int, out: Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` of tensor ``name`` into ``out``."""
        if self._closed:
            raise SpoolError(f"reader of {self.path.name} is closed")
        try:
            if self._handle is None:
                self._handle = safe_open(str(self.path), framework="pt")
            view = self._handle.get_slice(name)[start : start + out.numel()]
            out.copy_(view)
            del view
        except SafetensorError as err:
            raise SpoolError(f"spool file {self.path.name} is corrupt: {err}") from err
        self._touched += out.numel() * out.element_size()
        if self._touched >= self.remap_bytes:
            # Dropping the mapping returns the pages read so far from this process's RSS.
            self._handle, self._touched = None, 0

    def close(self) -> None:
        """Drop the mapping and the lease. Idempotent."""
        if not self._closed:
            self._closed = True
            self._handle = None
            self.lease.release()

    def __enter__(self) -> SpoolReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _same_tensors(header: bytes, expected: bytes) -> bool:
    """Compare two safetensors headers ignoring ``__metadata__``."""
    try:
        found = json.loads(header[8:].decode())
        want = json.loads(expected[8:].decode())
    except (UnicodeDecodeError, ValueError):
        return False
    if not isinstance(found, dict):
        return False
    found.pop("__metadata__", None)
    return bool(found == want)
