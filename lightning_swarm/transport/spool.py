"""The aggregator's spool: one run-scoped directory of per-peer, per-round safetensors files.

Ownership and lifecycle:
- ``Spool`` is the single owner of its root directory (mode 0700, created under ``base_dir`` or
  TMPDIR) and of every file in it (mode 0600). Nothing else creates or deletes files there.
- A file is written through a ``SpoolWriter``: created as ``<name>.partial``, sized up front
  from the payload layout (``posix_fallocate``, so a full disk is reported before any data
  arrives), filled chunk by chunk at known offsets, and renamed to its final name only when
  every byte is in place. A failed or abandoned write removes the partial file.
- A file is read through a ``SpoolReader``, which copies blocks out of a ``safe_open`` mapping
  into caller-owned tensors; no tensor backed by the file ever leaves the reader. The mapping is
  reopened every ``remap_bytes`` so pages already consumed stop counting in this process's RSS.
- Every writer and reader holds a lease on its file. ``release_round`` refuses new leases for
  the round, waits (up to ``cleanup_timeout_s``) for the leases in flight, deletes the round's
  files, and defers deleting any file still leased past the deadline to the moment its last
  lease is released (with a warning). A reader therefore never meets a vanished file, and no
  file outlives the spool. ``close`` does the same for every round, then removes the root;
  a finalizer removes it if ``close`` is never called.

Errors (disk full, unwritable root, a truncated or corrupt file) raise ``SpoolError`` with what
happened and what to do; a failed write leaves no file behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import Tensor

from lightning_swarm.transport.layout import PayloadLayout

WriteAt = Callable[[int, memoryview, int], int]  # os.pwrite's signature: (fd, data, offset)
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


class SpoolError(RuntimeError):
    """A spool file could not be written or read; the round cannot use it."""


def filesystem_type(path: str | os.PathLike[str], mounts: str | None = None) -> str | None:
    """The type of the filesystem holding ``path`` (longest matching mount point), or ``None``.

    ``mounts`` is the text of ``/proc/mounts``; read from the system when not given.
    """
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, fields[2]
    return best_type


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


class Spool:
    """Run-scoped spool directory with leased files; see the module docstring.

    Args:
        base_dir: where the run's root directory is created; ``None`` means TMPDIR.
        cleanup_timeout_s: how long cleanup waits for in-flight writers and readers.
        write_at: the positional write used by writers (``os.pwrite``; tests inject faults).

    Raises:
        SpoolError: the root cannot be created (the message names the directory and the fix).
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        cleanup_timeout_s: float = 60.0,
        write_at: WriteAt = os.pwrite,
    ) -> None:
        base = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix=f"lightning_swarm-{os.getpid()}-", dir=base))
        except OSError as err:
            raise SpoolError(
                f"cannot create the spool under spool_dir={str(base)!r} ({err.strerror or err}); "
                "point spool_dir at a writable local directory, or leave it unset to use TMPDIR"
            ) from err
        os.chmod(self.root, 0o700)
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.cleanup_timeout_s = cleanup_timeout_s
        self.write_at = write_at
        self._cond = threading.Condition()
        self._leases: dict[Path, int] = {}
        self._files: dict[int, set[Path]] = {}
        self._released: set[int] = set()
        self._doomed: set[Path] = set()
        self._allocated: dict[Path, int] = {}
        self._closed = False
        self.disk_bytes = 0
        self.peak_disk_bytes = 0
        self.cleanup_waits = 0  # cleanups that found a lease in flight and waited for it
        fs = filesystem_type(self.root)
        if fs in _MEMORY_FILESYSTEMS:
            warnings.warn(
                f"the spool root {self.root} is on {fs}, which lives in RAM: spooled "
                "contributions would use host memory and defeat offload; set spool_dir to a "
                "directory on a local disk",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- paths and leases -----------------------------------------------------------------
    def path(self, round_id: int, island: int) -> Path:
        return self.root / f"round{round_id:06d}-island{island:04d}.safetensors"

    def _acquire(self, round_id: int, path: Path) -> None:
        with self._cond:
            if self._closed or round_id in self._released:
                raise SpoolError(
                    f"the spool of round {round_id} is already cleaned up; a file of that round "
                    "can no longer be written or read"
                )
            self._leases[path] = self._leases.get(path, 0) + 1
            self._files.setdefault(round_id, set()).add(path)

    def _release(self, path: Path) -> None:
        with self._cond:
            left = self._leases[path] - 1
            if left:
                self._leases[path] = left
            else:
                del self._leases[path]
                if path in self._doomed:
                    self._doomed.discard(path)
                    self._unlink(path)
                    if self._closed and not self._leases:
                        self._remove_root()
            self._cond.notify_all()

    def _unlink(self, path: Path) -> None:
        """Delete a file and its partial twin; caller holds the lock."""
        for candidate in (path, _partial(path)):
            candidate.unlink(missing_ok=True)
        self.disk_bytes -= self._allocated.pop(path, 0)

    def _note_allocated(self, path: Path, nbytes: int) -> None:
        with self._cond:
            self._allocated[path] = nbytes
            self.disk_bytes += nbytes
            self.peak_disk_bytes = max(self.peak_disk_bytes, self.disk_bytes)

    # -- verbs ----------------------------------------------------------------------------
    def writer(self, round_id: int, island: int, layout: PayloadLayout) -> SpoolWriter:
        """Create, size and lease the file for ``island``'s contribution to ``round_id``."""
        path = self.path(round_id, island)
        self._acquire(round_id, path)
        try:
            return SpoolWriter(self, path, layout, {"round": str(round_id), "island": str(island)})
        except BaseException:
            self._release(path)
            raise

    def reader(
        self, round_id: int, island: int, layout: PayloadLayout, *, remap_bytes: int = 64 * 2**20
    ) -> SpoolReader:
        """Lease and check the committed file of ``island`` in ``round_id`` for reading."""
        path = self.path(round_id, island)
        self._acquire(round_id, path)
        try:
            return SpoolReader(self, path, layout, remap_bytes=remap_bytes)
        except BaseException:
            self._release(path)
            raise

    def release_round(self, round_id: int) -> None:
        """Delete ``round_id``'s files once their leases are gone (bounded wait, see above)."""
        with self._cond:
            self._released.add(round_id)
            paths = self._files.pop(round_id, set())
            self._drain(paths, f"round {round_id}")

    def _drain(self, paths: set[Path], what: str) -> None:
        """Wait for leases on ``paths``, delete the free ones, defer the rest; holds the lock."""
        deadline = time.monotonic() + self.cleanup_timeout_s
        if any(p in self._leases for p in paths):
            self.cleanup_waits += 1
        while any(p in self._leases for p in paths):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
        busy = {p for p in paths if p in self._leases}
        for p in paths - busy:
            self._unlink(p)
        if busy:
            self._doomed.update(busy)
            warnings.warn(
                f"spool cleanup of {what} waited {self.cleanup_timeout_s:g}s and {len(busy)} "
                "file(s) are still in use; each is deleted when its last user releases it",
                RuntimeWarning,
                stacklevel=3,
            )

    def close(self) -> None:
        """Clean up every round and remove the root (deferred while leases remain). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            paths = set().union(*self._files.values()) if self._files else set()
            self._files.clear()
            self._drain(paths, "the spool")
            if not self._leases:
                self._remove_root()

    def _remove_root(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.disk_bytes = 0
        self._finalizer.detach()

    def files(self) -> list[Path]:
        """Files currently in the root (committed or partial), for tests and diagnostics."""
        return sorted(self.root.iterdir()) if self.root.exists() else []


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


class SpoolWriter:
    """Fills one preallocated spool file; ``commit`` publishes it, ``abort`` removes it.

    Use as a context manager: leaving the block by an exception aborts.
    """

    def __init__(
        self, spool: Spool, path: Path, layout: PayloadLayout, metadata: dict[str, str]
    ) -> None:
        self.spool, self.path, self.layout = spool, path, layout
        self.header = layout.safetensors_header(metadata)
        self.total_bytes = len(self.header) + layout.data_bytes
        self.written = 0
        self._fd: int | None = None
        self._done = False  # committed or discarded: the lease is gone
        self._committed = False
        what = f"creating {path.name} ({self.total_bytes} bytes)"
        try:
            self._fd = os.open(
                _partial(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600
            )
            spool._note_allocated(path, self.total_bytes)
            _preallocate(self._fd, self.total_bytes)
            self._write_all(memoryview(self.header), 0)
        except OSError as err:
            # Remove what exists but keep the lease: ``Spool.writer`` releases it.
            self._close_and_unlink()
            self._done = True
            raise SpoolError(_describe_os_error(err, what, spool.root)) from err

    def _write_all(self, data: memoryview, offset: int) -> None:
        assert self._fd is not None
        while len(data):
            n = self.spool.write_at(self._fd, data, offset)
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
            raise SpoolError(_describe_os_error(err, what, self.spool.root)) from err
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
            os.replace(_partial(self.path), self.path)
        except OSError as err:
            self._discard()
            raise SpoolError(_describe_os_error(err, "publishing", self.spool.root)) from err
        self._done = self._committed = True
        self.spool._release(self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file; a committed file is the spool's to delete. Idempotent."""
        if not self._committed:
            self._discard()

    def _discard(self) -> None:
        if not self._done:
            self._close_and_unlink()
            self._done = True
            self.spool._release(self.path)

    def _close_and_unlink(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with self.spool._cond:
            self.spool._unlink(self.path)

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

    def __init__(self, spool: Spool, path: Path, layout: PayloadLayout, *, remap_bytes: int):
        self.spool, self.path, self.layout = spool, path, layout
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
            self.spool._release(self.path)

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
