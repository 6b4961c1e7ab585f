"""The aggregator's spool: one run-scoped directory of per-peer, per-round safetensors files.

- ``Spool`` alone creates and deletes its root (mode 0700) and every file in it (mode 0600);
  writers and readers (``spool_files``) reach it only through the ``Lease`` it hands them.
- ``release_round`` refuses new leases for the round, waits up to ``cleanup_timeout_s`` for those
  in flight, deletes the round's files and defers any still leased to its last release: a reader
  never meets a vanished file and no file outlives the spool. ``close`` does this for every round
  and removes the root (a finalizer does, if ``close`` is never called).
- Roots are named ``lightning_swarm-<pid>@<host>-<random>``; a new ``Spool`` removes this user's
  roots of this host whose process is gone (a SIGKILL leaves them), never others.
- Errors (disk full, unwritable root, a corrupt file) raise ``SpoolError`` saying what to do; a
  failed write leaves no file behind.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lightning_swarm.memory.procfs import pid_alive
from lightning_swarm.transport.aggregator.spool_files import (
    Lease,
    SpoolReader,
    SpoolWriter,
    WriteAt,
    partial_path,
)
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadLayout

_T = TypeVar("_T")
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_ROOT_PREFIX = "lightning_swarm-"
# <pid>, then (since the host was added) @<host>, then mkdtemp's 8 random characters.
_ROOT_NAME = re.compile(r"lightning_swarm-(\d+)(?:@(.+))?-[a-z0-9_]{8}")


def sweep_dead_roots(base: Path) -> list[Path]:
    """Remove spool roots in ``base`` left by dead processes of this user on this host.

    Returns the roots removed. See the module docstring for what is never touched.
    """
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


class _FileLease:
    """A ``Lease`` on one file of ``spool`` (see ``spool_files.Lease``)."""

    def __init__(self, spool: Spool, path: Path) -> None:
        self.spool, self.path, self.root, self.write_at = spool, path, spool.root, spool.write_at

    def allocated(self, nbytes: int) -> None:
        self.spool._note_allocated(self.path, nbytes)

    def remove(self) -> None:
        with self.spool._cond:
            self.spool._unlink(self.path)

    def release(self) -> None:
        self.spool._release(self.path)


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

    def _acquire(self, round_id: int, path: Path) -> _FileLease:
        with self._cond:
            if self._closed or round_id in self._released:
                raise SpoolError(
                    f"the spool of round {round_id} is already cleaned up; a file of that round "
                    "can no longer be written or read"
                )
            self._leases[path] = self._leases.get(path, 0) + 1
            self._files.setdefault(round_id, set()).add(path)
        return _FileLease(self, path)

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
        for candidate in (path, partial_path(path)):
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
        metadata = {"round": str(round_id), "island": str(island)}
        return self._leased(round_id, island, lambda lease: SpoolWriter(lease, layout, metadata))

    def reader(
        self, round_id: int, island: int, layout: PayloadLayout, *, remap_bytes: int = 64 * 2**20
    ) -> SpoolReader:
        """Lease and check the committed file of ``island`` in ``round_id`` for reading."""
        return self._leased(
            round_id, island, lambda lease: SpoolReader(lease, layout, remap_bytes=remap_bytes)
        )

    def _leased(self, round_id: int, island: int, make: Callable[[Lease], _T]) -> _T:
        """``make`` over a new lease on ``island``'s file of ``round_id``; the lease goes if
        ``make`` raises."""
        lease = self._acquire(round_id, self.path(round_id, island))
        try:
            return make(lease)
        except BaseException:
            lease.release()
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
