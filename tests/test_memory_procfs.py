"""procfs parsing on recorded texts, the psutil stand-in, and the run summary's arithmetic.

``tests/data/proc_recorded`` holds /proc files recorded on Linux from a small Python process that
had made 20,000 small allocations (served by brk: the ``[heap]`` region), a shared anonymous
8 MiB map (``/dev/zero (deleted)``) and a read-only map of a 4 MiB temporary file. maps is
trimmed to 22 of the 112 regions; status, meminfo and smaps_rollup are whole.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lightning_swarm.memory.procfs import (
    ProcReader,
    file_backed_overlap,
    parse_maps,
    parse_meminfo,
    parse_smaps_rollup,
    parse_status,
)
from lightning_swarm.memory.sampler import HostSampler, RunSummary

RECORDED = Path(__file__).parent / "data" / "proc_recorded"
KIB = 1024


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


def test_status_fields_in_bytes() -> None:
    status = parse_status(recorded("self/status"))
    assert status == {
        "VmHWM": 35484 * KIB,
        "VmRSS": 35484 * KIB,
        "RssAnon": 16512 * KIB,
        "RssFile": 10780 * KIB,
        "RssShmem": 8192 * KIB,
    }
    # The kernel's own invariant, checked on the parsed numbers.
    assert status["VmRSS"] == status["RssAnon"] + status["RssFile"] + status["RssShmem"]


def test_meminfo_and_rollup() -> None:
    assert parse_meminfo(recorded("meminfo")) == {
        "MemAvailable": 23798888 * KIB,
        "AnonPages": 308580 * KIB,
    }
    rollup = parse_smaps_rollup(recorded("self/smaps_rollup"))
    assert rollup == {"Anonymous": 16512 * KIB, "Private_Dirty": 28800 * KIB}
    # Anonymous from the page walk agrees with the status counter of the same moment.
    assert rollup["Anonymous"] == parse_status(recorded("self/status"))["RssAnon"]


def test_missing_field_is_absent_not_zero() -> None:
    old_kernel = "VmHWM:\t  100 kB\nVmRSS:\t   90 kB\nThreads:\t1\n"
    assert parse_status(old_kernel) == {"VmHWM": 100 * KIB, "VmRSS": 90 * KIB}


def test_heap_region_is_anonymous() -> None:
    regions = parse_maps(recorded("self/maps"))
    assert len(regions) == 22
    (heap,) = [r for r in regions if r.pathname == "[heap]"]
    assert not heap.file_backed
    assert heap.inode == 0
    assert heap.perms == "rw-p"
    assert heap.size == 0x5565A6C93000 - 0x5565A66C9000


def test_file_backed_classification() -> None:
    regions = {r.pathname: r for r in parse_maps(recorded("self/maps"))}
    assert regions["/tmp/tmpuj_myb35"].file_backed
    # A shared anonymous map has an inode but is shared memory, not a file.
    assert not regions["/dev/zero (deleted)"].file_backed
    assert not regions["[stack]"].file_backed
    assert not regions[""].file_backed


def test_file_backed_overlap_spans() -> None:
    regions = parse_maps(recorded("self/maps"))
    file_start, file_end = 0x7F90F8600000, 0x7F90F8A00000
    heap_start = 0x5565A66C9000
    assert file_backed_overlap([(file_start + 4096, 8192)], regions) == 8192
    # A span straddling the end of the mapped file counts only the part inside it.
    assert file_backed_overlap([(file_end - 100, 1000)], regions) == 100
    assert file_backed_overlap([(heap_start, 4096)], regions) == 0
    assert file_backed_overlap([(file_start, 10), (heap_start, 10)], regions) == 10
    assert file_backed_overlap([], regions) == 0


def test_reader_on_recorded_root_and_missing_root(tmp_path: Path) -> None:
    reader = ProcReader(RECORDED)
    assert reader.status() == parse_status(recorded("self/status"))
    assert reader.meminfo() == parse_meminfo(recorded("meminfo"))
    assert reader.smaps_rollup() == parse_smaps_rollup(recorded("self/smaps_rollup"))
    missing = ProcReader(tmp_path / "no_proc_here")
    assert missing.status() is None
    assert missing.meminfo() is None
    assert missing.smaps_rollup() is None
    assert missing.maps() is None


def test_mapped_tensor_is_file_backed(tmp_path: Path) -> None:
    path = tmp_path / "anchor.pt"
    torch.save(torch.arange(1 << 18, dtype=torch.float32), path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    eager = torch.load(path, weights_only=True)
    regions = ProcReader().maps()
    assert regions is not None

    def span(t: torch.Tensor) -> tuple[int, int]:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    assert file_backed_overlap([span(mapped)], regions) == mapped.nbytes
    assert file_backed_overlap([span(eager)], regions) == 0


# -- sampler and stand-in ----------------------------------------------------------------


class FakePsutil:
    """psutil's surface the stand-in uses, with fixed numbers (or a failure)."""

    def __init__(self, rss: int = 123 * 2**20, available: int = 7 * 2**30, fail: bool = False):
        self.rss, self.available, self.fail = rss, available, fail

    def Process(self) -> Any:
        if self.fail:
            raise PermissionError("/proc is not readable")
        return SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=self.rss))

    def virtual_memory(self) -> Any:
        if self.fail:
            raise PermissionError("/proc is not readable")
        return SimpleNamespace(available=self.available)


def test_sampler_reads_proc_sources() -> None:
    sampler = HostSampler(ProcReader(RECORDED), psutil_module=FakePsutil())
    fast = sampler.sample_fast()
    assert fast["status/RssAnon_bytes"] == 16512 * KIB
    assert fast["meminfo/AnonPages_bytes"] == 308580 * KIB
    assert not any(k.startswith(("psutil/", "rusage/")) for k in fast)
    slow = sampler.sample_slow()
    assert slow["smaps_rollup/Anonymous_bytes"] == 16512 * KIB
    assert "smaps_rollup/read_s" in slow  # the cost of the page walk is reported beside it


def test_standin_when_proc_unreadable(tmp_path: Path) -> None:
    sampler = HostSampler(ProcReader(tmp_path / "none"), psutil_module=FakePsutil())
    fast = sampler.sample_fast()
    assert fast["psutil/rss_bytes"] == 123 * 2**20
    assert fast["psutil/available_bytes"] == 7 * 2**30
    assert fast["rusage/ru_maxrss_bytes"] > 0
    assert not any(k.startswith(("status/", "meminfo/")) for k in fast)
    # Anonymous memory cannot be measured by the stand-in: absent, not zero.
    assert sampler.sample_slow() == {}


def test_standin_failure_leaves_keys_absent(tmp_path: Path) -> None:
    sampler = HostSampler(ProcReader(tmp_path / "none"), psutil_module=FakePsutil(fail=True))
    fast = sampler.sample_fast()
    assert "psutil/rss_bytes" not in fast
    assert "psutil/available_bytes" not in fast
    assert set(fast) <= {"rusage/ru_maxrss_bytes"}


def test_standin_with_installed_psutil(tmp_path: Path) -> None:
    fast = HostSampler(ProcReader(tmp_path / "none")).sample_fast()
    live = ProcReader().status()
    assert live is not None
    # The stand-in and the kernel agree on this process's RSS within a few MiB.
    assert abs(fast["psutil/rss_bytes"] - live["VmRSS"]) < 16 * 2**20


# -- run summary -------------------------------------------------------------------------


def _series(steps: np.ndarray, anon: np.ndarray) -> RunSummary:
    summary = RunSummary()
    for step, value in zip(steps, anon, strict=True):
        summary.update(int(step), {"status/RssAnon_bytes": int(value), "status/VmRSS_bytes": 0})
    return summary


def test_slope_matches_least_squares_on_leak_plus_sawtooth() -> None:
    steps = np.arange(0, 1000)
    sawtooth = (steps % 50) * 2**20  # a buffer refilled every 50 steps
    leak = 3000 * steps  # 3000 bytes per step
    anon = 4 * 2**30 + sawtooth + leak
    summary = _series(steps, anon)
    expected = np.polyfit(steps.astype(float), anon.astype(float), 1)[0]
    slope = summary.anon_slope()
    assert slope is not None
    assert slope == pytest.approx(expected, rel=1e-9)
    # Least squares is linear: the sawtooth's own tilt plus the leak, to rounding.
    sawtooth_slope = _series(steps, 4 * 2**30 + sawtooth).anon_slope()
    assert sawtooth_slope is not None
    assert slope - sawtooth_slope == pytest.approx(3000, rel=1e-9)
    assert summary.peak_anon == int(anon.max())


def test_sawtooth_alone_has_no_slope() -> None:
    amplitude = 49 * 2**20
    short, long = np.arange(0, 1000), np.arange(0, 10000)  # 20 and 200 whole periods
    slopes = [_series(s, 2**30 + (s % 50) * 2**20).anon_slope() for s in (short, long)]
    assert slopes[0] is not None and slopes[1] is not None
    # A whole number of sawtooth periods leaves a tilt of about amplitude / run length,
    # which shrinks as the run grows; a leak's slope does not.
    assert 0 < slopes[0] < amplitude / 1000
    assert 0 < slopes[1] < amplitude / 10000
    assert slopes[1] < slopes[0] / 9


def test_summary_peaks_and_absent_values() -> None:
    summary = RunSummary()
    summary.update(0, {"status/VmRSS_bytes": 100, "status/VmHWM_bytes": 150})
    summary.update(1, {"status/VmRSS_bytes": 120, "status/VmHWM_bytes": 150})
    metrics = summary.metrics()
    # VmHWM is the kernel's peak; it also sees spikes between samples.
    assert metrics["summary/peak_rss_bytes"] == 150
    assert metrics["summary/num_samples"] == 2
    assert "summary/peak_anon_bytes" not in metrics
    assert "summary/anon_slope_bytes_per_step" not in metrics


def test_slope_needs_two_distinct_steps() -> None:
    summary = RunSummary()
    summary.update(5, {"status/RssAnon_bytes": 10})
    summary.update(5, {"status/RssAnon_bytes": 20})
    assert summary.anon_slope() is None
    summary.update(6, {"status/RssAnon_bytes": 40})
    assert summary.anon_slope() == pytest.approx(np.polyfit([5, 5, 6], [10, 20, 40], 1)[0])
