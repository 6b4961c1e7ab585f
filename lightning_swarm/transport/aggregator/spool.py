"""The aggregator's spool: a run-scoped directory (0700) of per-peer, per-round safetensors
files (0600), each written and read under a lease; no file outlives the spool or vanishes under
a reader, and errors (disk full, unwritable root, a corrupt file) raise ``SpoolError`` saying
what to do."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import Tensor

from lightning_swarm.memory.procfs import pid_alive
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadMap, TensorSpec

WriteAt = Callable[[int, memoryview, int], int]  # os.pwrite's signature: (fd, data, offset)
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_ROOT_PREFIX = "lightning_swarm-"
# <pid>, then (since the host was added) @<host>, then mkdtemp's 8 random characters.
_ROOT_NAME = re.compile(r"lightning_swarm-(\d+)(?:@(.+))?-[a-z0-9_]{8}")


def sweep_dead_roots(base: Path) -> list[Path]:
    """Remove (and return) the spool roots in ``base`` of this user's dead processes on this
    host (a SIGKILL leaves them); never another user's, host's or live process's."""
    host, uid = socket.gethostname(), os.getuid()
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _ROOT_NAME.fullmatch(entry.name)
        if match is None or (match.group(2) is not None and match.group(2) != host):
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        pid = int(match.group(1))
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or pid == os.getpid():
            continue
        if not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def filesystem_type(path: str | os.PathLike[str], mounts: str | None = None) -> str | None:
    """The type of the filesystem holding ``path`` (longest matching mount point of
    ``mounts``, the text of ``/proc/mounts``), or ``None``."""
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


class Spool:
    """Run-scoped spool directory under ``base_dir`` (``None``: TMPDIR) with leased files;
    raises ``SpoolError`` if it cannot be created. ``release_round`` refuses new leases for the
    round, waits up to ``cleanup_timeout_s`` for those in flight, deletes the round's files and
    defers any still leased to its last release; ``close`` does this for every round and removes
    the root (a finalizer does, if ``close`` is never called). ``write_at``: the writers'
    positional write (tests inject faults)."""

    def __init__(
        self,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        cleanup_timeout_s: float = 60.0,
        write_at: WriteAt = os.pwrite,
    ) -> None:
        base = Path(base_dir).expanduser() if base_dir is not None else None
        base = base or Path(tempfile.gettempdir())
        prefix = f"{_ROOT_PREFIX}{os.getpid()}@{socket.gethostname()}-"
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.swept = sweep_dead_roots(base)
            self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
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
        self.disk_bytes = self.peak_disk_bytes = 0
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

    def writer(
        self, round_id: int, island: int, layout: PayloadMap, *, remap_bytes: int = 64 * 2**20
    ) -> SpoolWriter:
        """Create, size and lease the file for ``island``'s contribution to ``round_id``
        (``remap_bytes``: its reader's, once ``finish``\\ ed)."""
        return SpoolWriter(self, round_id, island, layout, remap_bytes)

    def reader(
        self, round_id: int, island: int, layout: PayloadMap, *, remap_bytes: int = 64 * 2**20
    ) -> SpoolReader:
        """Lease and check the committed file of ``island`` in ``round_id`` for reading."""
        return SpoolReader(self, round_id, island, layout, remap_bytes)

    def path(self, round_id: int, island: int) -> Path:
        return self.root / f"round{round_id:06d}-island{island:04d}.safetensors"

    def _acquire(self, round_id: int, island: int) -> Path:
        path = self.path(round_id, island)
        with self._cond:
            if self._closed or round_id in self._released:
                raise SpoolError(
                    f"the spool of round {round_id} is already cleaned up; a file of that round "
                    "can no longer be written or read"
                )
            self._leases[path] = self._leases.get(path, 0) + 1
            self._files.setdefault(round_id, set()).add(path)
        return path

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

    def release_round(self, round_id: int) -> None:
        """Delete ``round_id``'s files once their leases are gone (bounded wait, see above)."""
        with self._cond:
            self._released.add(round_id)
            paths = self._files.pop(round_id, set())
            self._drain(paths, f"round {round_id}")

    def _drain(self, paths: set[Path], what: str) -> None:
        """Wait for leases on ``paths``, delete the free ones, defer the rest; holds the lock."""
        if not paths.isdisjoint(self._leases):
            self.cleanup_waits += 1
            self._cond.wait_for(lambda: paths.isdisjoint(self._leases), self.cleanup_timeout_s)
        busy = paths.intersection(self._leases)
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


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


class SpoolWriter(AbstractContextManager["SpoolWriter"]):
    """Fills ``<name>.partial``, preallocated (a full disk fails before data arrives), and
    publishes it once every byte is in place (``commit``; ``finish`` also opens its reader), or
    removes it (``abort``, also on leaving a ``with`` block); holds its lease until then."""

    def __init__(
        self, spool: Spool, round_id: int, island: int, layout: PayloadMap, remap_bytes: int
    ) -> None:
        self.spool, self.layout, self.path = spool, layout, spool._acquire(round_id, island)
        self.round_id, self.island, self.remap_bytes = round_id, island, remap_bytes
        self.header = layout.safetensors_header({"round": str(round_id), "island": str(island)})
        self.total_bytes = len(self.header) + layout.data_bytes
        self.written = 0
        self._fd: int | None = None
        self._done = False  # committed or aborted: the lease is gone
        what = f"creating {self.path.name} ({self.total_bytes} bytes)"
        try:
            self._fd = os.open(
                _partial(self.path), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600
            )
            spool._note_allocated(self.path, self.total_bytes)
            _preallocate(self._fd, self.total_bytes)
            self._write_all(memoryview(self.header), 0)
        except BaseException as err:
            self.abort()  # what exists goes, and the lease
            if isinstance(err, OSError):
                raise SpoolError(_describe_os_error(err, what, spool.root)) from err
            raise

    def _write_all(self, data: memoryview, offset: int) -> None:
        assert self._fd is not None
        while len(data):
            n = self.spool.write_at(self._fd, data, offset)
            if n <= 0:
                raise OSError(errno.EIO, "positional write made no progress")
            data, offset = data[n:], offset + n

    def write(self, data_offset: int, chunk: Tensor) -> None:
        """Write ``chunk`` (contiguous uint8) at ``data_offset`` of the data section."""
        if self._done:
            raise SpoolError(f"{self.path.name} is already committed or aborted")
        if data_offset < 0 or data_offset + chunk.numel() > self.layout.data_bytes:
            self.abort()
            raise SpoolError(
                f"chunk [{data_offset}, {data_offset + chunk.numel()}) lies outside the "
                f"{self.layout.data_bytes}-byte payload of {self.path.name}"
            )
        try:
            self._write_all(chunk.cpu().numpy().data.cast("B"), len(self.header) + data_offset)
        except OSError as err:
            self.abort()
            what = f"writing {self.path.name} at byte {data_offset}"
            raise SpoolError(_describe_os_error(err, what, self.spool.root)) from err
        self.written += chunk.numel()

    def commit(self) -> Path:
        """Check that every byte arrived, close and publish the file under its final name."""
        if self._done:
            raise SpoolError(f"{self.path.name} is already committed or aborted")
        if self.written != self.layout.data_bytes:
            self.abort()
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
            self.abort()
            raise SpoolError(_describe_os_error(err, "publishing", self.spool.root)) from err
        self._done = True
        self.spool._release(self.path)
        return self.path

    def finish(self) -> SpoolReader:
        """Commit, then lease the file for reading."""
        self.commit()
        return self.spool.reader(
            self.round_id, self.island, self.layout, remap_bytes=self.remap_bytes
        )

    def abort(self) -> None:
        """Drop the partial file; a committed file is the spool's to delete. Idempotent."""
        if self._done:
            return
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with self.spool._cond:
            self.spool._unlink(self.path)
        self._done = True
        self.spool._release(self.path)

    def __exit__(self, *exc: object) -> None:
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


class SpoolReader(AbstractContextManager["SpoolReader"]):
    """Checks one committed file against ``layout``, then copies element ranges out of a
    ``safe_open`` mapping into caller-owned tensors, remapping every ``remap_bytes`` (which
    returns the pages read from this process's RSS). Holds its lease until ``close``."""

    def __init__(
        self, spool: Spool, round_id: int, island: int, layout: PayloadMap, remap_bytes: int
    ) -> None:
        self.spool, self.layout, self.path = spool, layout, spool._acquire(round_id, island)
        self.remap_bytes = remap_bytes
        self._handle: Any = None
        self._touched = 0
        self._closed = False
        try:
            self._check()
        except BaseException:
            self.close()
            raise

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
        expected = len(header) + self.layout.data_bytes
        if header_len < 0 or len(header) < 8 + header_len:
            raise SpoolError(f"spool file {self.path.name} is truncated inside its header")
        if not _same_tensors(header, self.layout.safetensors_header()):
            raise SpoolError(
                f"spool file {self.path.name} is corrupt: its header does not describe the "
                "expected tensors"
            )
        if size != expected:
            state = "truncated" if size < expected else "corrupt (longer than its layout)"
            raise SpoolError(f"spool file {self.path.name} is {state}: {size} of {expected} bytes")

    def read_into(self, spec: TensorSpec, start: int, out: Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` of tensor ``spec`` into ``out``."""
        if self._closed:
            raise SpoolError(f"reader of {self.path.name} is closed")
        try:
            if self._handle is None:
                self._handle = safe_open(str(self.path), framework="pt")
            view = self._handle.get_slice(spec.name)[start : start + out.numel()]
            out.copy_(view)
            del view
        except SafetensorError as err:
            raise SpoolError(f"spool file {self.path.name} is corrupt: {err}") from err
        self._touched += out.numel() * out.element_size()
        if self._touched >= self.remap_bytes:
            self._handle, self._touched = None, 0

    def close(self) -> None:
        """Drop the mapping and the lease. Idempotent."""
        if not self._closed:
            self._closed = True
            self._handle = None
            self.spool._release(self.path)

    def __exit__(self, *exc: object) -> None:
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
