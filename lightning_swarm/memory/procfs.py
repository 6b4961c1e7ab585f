"""Reading host memory from Linux procfs, as text in and integers (bytes) out.

Parsers take text, so recorded files test like live ones. ``ProcReader`` opens each file afresh
(a descriptor kept across ``fork`` would describe the parent); absent fields stay absent."""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
MEMINFO_FIELDS = ("MemAvailable", "AnonPages")
SMAPS_ROLLUP_FIELDS = ("Anonymous", "Private_Dirty")

# "Name:   123 kB" lines; compiled once because this runs on the per-step path.
_KB_LINE = re.compile(r"^([A-Za-z_()]+):\s+(\d+) kB$", re.MULTILINE)
# "start-end perms offset dev inode [pathname]" -- a line of maps.
_MAP_LINE = re.compile(
    r"^([0-9a-f]+)-([0-9a-f]+)\s+(\S{4})\s+([0-9a-f]+)\s+(\S+)\s+(\d+)[ \t]*(.*)$"
)
_NOT_FILES = ("/dev/", "/memfd:", "/SYSV", "/anon_hugepage")
T = TypeVar("T")


def _kb_fields(text: str, wanted: Iterable[str]) -> dict[str, int]:
    return {name: int(kib) * 1024 for name, kib in _KB_LINE.findall(text) if name in wanted}


def parse_status(text: str) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of ``/proc/<pid>/status``, in bytes."""
    return _kb_fields(text, STATUS_FIELDS)


def parse_meminfo(text: str) -> dict[str, int]:
    """MemAvailable and AnonPages of ``/proc/meminfo`` (the whole node), in bytes."""
    return _kb_fields(text, MEMINFO_FIELDS)


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """Anonymous and Private_Dirty of ``/proc/<pid>/smaps_rollup``, in bytes."""
    return _kb_fields(text, SMAPS_ROLLUP_FIELDS)


@dataclass(frozen=True)
class MapRegion:
    """One mapping, from a maps header line."""

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    pathname: str

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def file_backed(self) -> bool:
        """Backed by a file whose clean pages the kernel can drop and re-read. Shared memory
        (``/dev/zero (deleted)``, ``/memfd:``, ``/dev/shm/``, ``/SYSV``) and device mappings
        under ``/dev/`` have an inode but are not files."""
        return self.inode != 0 and not self.pathname.startswith(_NOT_FILES)


def _parse_header(line: str) -> MapRegion | None:
    match = _MAP_LINE.match(line)
    if match is None:
        return None
    start, end, perms, offset, _dev, inode, path = match.groups()
    return MapRegion(int(start, 16), int(end, 16), perms, int(offset, 16), int(inode), path.strip())


def parse_maps(text: str) -> list[MapRegion]:
    """The regions of ``/proc/<pid>/maps``, in address order."""
    return [r for r in map(_parse_header, text.splitlines()) if r is not None]


def file_backed_overlap(spans: Iterable[tuple[int, int]], regions: Sequence[MapRegion]) -> int:
    """Bytes of the address ``spans`` (start, nbytes) inside file-backed ``regions`` (in address
    order, as maps lists them). Overlapping spans count once each: pass distinct storages."""
    backed = [r for r in regions if r.file_backed]
    starts = [r.start for r in backed]
    total = 0
    for start, nbytes in spans:
        end = start + nbytes
        # The first candidate is the last region starting at or before ``start``.
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(backed) and backed[i].start < end:
            lo, hi = max(start, backed[i].start), min(end, backed[i].end)
            total += max(hi - lo, 0)
            i += 1
    return total


class ProcReader:
    """Reads procfs files of this process and node under ``root`` (tests pass recorded files,
    laid out as ``self/status``, ``meminfo``, ..., or a path that does not exist)."""

    def __init__(self, root: str | os.PathLike[str] = "/proc") -> None:
        self.root = Path(root)

    def read(self, name: str) -> str | None:
        """The text of ``root/name``, or None when it is missing or unreadable."""
        try:
            with open(self.root / name, "rb", buffering=0) as file:
                return file.read().decode("ascii", errors="replace")
        except OSError:
            return None

    def _parsed(self, name: str, parse: Callable[[str], T]) -> T | None:
        text = self.read(name)
        return None if text is None else parse(text)

    def status(self) -> dict[str, int] | None:
        return self._parsed("self/status", parse_status)

    def meminfo(self) -> dict[str, int] | None:
        return self._parsed("meminfo", parse_meminfo)

    def smaps_rollup(self) -> dict[str, int] | None:
        return self._parsed("self/smaps_rollup", parse_smaps_rollup)

    def maps(self) -> list[MapRegion] | None:
        return self._parsed("self/maps", parse_maps)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (another user's live process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
