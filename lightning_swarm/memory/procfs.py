"""Reading host memory from Linux procfs, as text in and integers (bytes) out.

Parsers take a file's text, so recorded files test like live ones; ``ProcReader`` alone touches
the file system (``root`` may point at recorded files, or nowhere to play a machine without
/proc). ``status`` and ``meminfo`` cost the same at any size; ``smaps_rollup`` walks page tables
and grows with resident memory (``docs/census.md``), hence two cadences. Values are bytes (procfs
prints kB); an absent field is absent, never zero; each read opens the file afresh, since a
descriptor kept across ``fork`` would describe the parent. ``pid_alive`` asks the kernel.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
MEMINFO_FIELDS = ("MemAvailable", "AnonPages")
SMAPS_ROLLUP_FIELDS = ("Anonymous", "Private_Dirty")

# "Name:   123 kB" lines; compiled once because this runs on the per-step path.
_KB_LINE = re.compile(r"^([A-Za-z_()]+):\s+(\d+) kB$", re.MULTILINE)
# "start-end perms offset dev inode [pathname]" -- the header line of maps and smaps.
_MAP_LINE = re.compile(
    r"^([0-9a-f]+)-([0-9a-f]+)\s+(\S{4})\s+([0-9a-f]+)\s+(\S+)\s+(\d+)[ \t]*(.*)$"
)
_READ_CHUNK = 1 << 16
_NOT_FILES = ("/dev/", "/memfd:", "/SYSV", "/anon_hugepage")


def parse_kb_fields(text: str, wanted: Iterable[str] | None = None) -> dict[str, int]:
    """Return ``{name: bytes}`` for every ``Name: N kB`` line (restricted to ``wanted``)."""
    keep = None if wanted is None else frozenset(wanted)
    out: dict[str, int] = {}
    for name, kib in _KB_LINE.findall(text):
        if keep is None or name in keep:
            out[name] = int(kib) * 1024
    return out


def parse_status(text: str) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of ``/proc/<pid>/status``, in bytes."""
    return parse_kb_fields(text, STATUS_FIELDS)


def parse_meminfo(text: str) -> dict[str, int]:
    """MemAvailable and AnonPages of ``/proc/meminfo`` (the whole node), in bytes."""
    return parse_kb_fields(text, MEMINFO_FIELDS)


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """Anonymous and Private_Dirty of ``/proc/<pid>/smaps_rollup``, in bytes."""
    return parse_kb_fields(text, SMAPS_ROLLUP_FIELDS)


@dataclass(frozen=True)
class MapRegion:
    """One mapping of the address space, from a maps or smaps header line.

    ``fields`` holds the smaps ``kB`` lines of the region in bytes (empty when read from maps).
    """

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    pathname: str
    fields: Mapping[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def file_backed(self) -> bool:
        """Backed by a file whose clean pages the kernel can drop and re-read.

        ``[heap]``, ``[stack]`` and unnamed mappings have inode 0. Shared memory has an inode
        too (``/dev/zero (deleted)`` for a shared anonymous map, ``/memfd:...``, ``/dev/shm/...``,
        ``/SYSV...``) but lives in RAM or swap like anonymous memory, and device mappings under
        ``/dev/`` (e.g. a GPU driver's pinned host memory) are not files either.
        """
        return self.inode != 0 and not self.pathname.startswith(_NOT_FILES)

    @property
    def anonymous_bytes(self) -> int:
        """Anonymous bytes the kernel counted in this region (0 when unknown)."""
        return self.fields.get("Anonymous", 0)


def _parse_header(line: str) -> MapRegion | None:
    match = _MAP_LINE.match(line)
    if match is None:
        return None
    start, end, perms, offset, _dev, inode, path = match.groups()
    return MapRegion(
        start=int(start, 16),
        end=int(end, 16),
        perms=perms,
        offset=int(offset, 16),
        inode=int(inode),
        pathname=path.strip(),
    )


def parse_maps(text: str) -> list[MapRegion]:
    """The regions of ``/proc/<pid>/maps``, in address order."""
    regions = []
    for line in text.splitlines():
        region = _parse_header(line)
        if region is not None:
            regions.append(region)
    return regions


def parse_smaps(text: str) -> list[MapRegion]:
    """The regions of ``/proc/<pid>/smaps``, each with its ``kB`` fields in bytes."""
    regions: list[MapRegion] = []
    current: MapRegion | None = None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        header = _parse_header(line)
        if header is not None:
            if current is not None:
                regions.append(replace(current, fields=dict(fields)))
            current, fields = header, {}
            continue
        parts = line.split()
        if current is not None and len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    if current is not None:
        regions.append(replace(current, fields=dict(fields)))
    return regions


def file_backed_overlap(spans: Iterable[tuple[int, int]], regions: Sequence[MapRegion]) -> int:
    """Bytes of the address ``spans`` (start, nbytes) that lie inside file-backed regions.

    ``regions`` must be in address order and non-overlapping, as maps lists them. Spans that
    overlap each other are counted once per span: pass distinct storages.
    """
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
    """Reads procfs files of this process and this node under ``root``.

    Args:
        root: the procfs mount point; tests pass a directory of recorded files (laid out as
            ``self/status``, ``meminfo``, ...) or a path that does not exist.
    """

    def __init__(self, root: str | os.PathLike[str] = "/proc") -> None:
        self.root = Path(root)
        self._paths = {
            name: os.fspath(self.root / name)
            for name in ("self/status", "meminfo", "self/smaps_rollup", "self/smaps", "self/maps")
        }

    def read(self, name: str) -> str | None:
        """The text of ``root/name``, or None when it is missing or unreadable."""
        path = self._paths.get(name) or os.fspath(self.root / name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            chunks = []
            while True:
                chunk = os.read(fd, _READ_CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:
            return None
        finally:
            os.close(fd)
        return b"".join(chunks).decode("ascii", errors="replace")

    def status(self) -> dict[str, int] | None:
        text = self.read("self/status")
        return None if text is None else parse_status(text)

    def meminfo(self) -> dict[str, int] | None:
        text = self.read("meminfo")
        return None if text is None else parse_meminfo(text)

    def smaps_rollup(self) -> dict[str, int] | None:
        text = self.read("self/smaps_rollup")
        return None if text is None else parse_smaps_rollup(text)

    def maps(self) -> list[MapRegion] | None:
        text = self.read("self/maps")
        return None if text is None else parse_maps(text)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (another user's live process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
