"""Gauge / running-total classification of allocator byte counters.

The snapshots below are written in the flat key format that ``torch.cuda.memory_stats`` and
``torch.cuda.host_memory_stats`` document (``stem[.pool].current|peak|allocated|freed``); they
were not captured from a GPU (this machine has none). The host sequence reproduces the reported
trap: ``allocated_bytes`` rises and falls with ``freed`` moving (a gauge) while
``active_bytes.current`` only climbs with ``freed`` stuck at 0 (a running total).
"""

from __future__ import annotations

from typing import Any

from lightning_swarm.memory.sampler import (
    Counter,
    CounterClassifier,
    CounterKind,
    byte_counters,
    counter_metrics,
)

MIB = 2**20


def host_snapshot(held: int, freed: int, active: int) -> dict[str, Any]:
    """Pinned-host allocator stats after ``held`` bytes are owned and ``active`` handed out."""
    return {
        "allocated_bytes.current": held,
        "allocated_bytes.peak": max(held, 8 * MIB),
        "allocated_bytes.allocated": held + freed,
        "allocated_bytes.freed": freed,
        "active_bytes.current": active,
        "active_bytes.peak": active,
        "active_bytes.allocated": active,
        "active_bytes.freed": 0,
        "allocations.current": 2,
        "allocations.peak": 3,
        "allocations.allocated": 5,
        "allocations.freed": 3,
        "num_host_alloc": 5,
        "num_host_free": 3,
        "host_alloc_time.total": 120,
        "host_alloc_time.max": 40,
    }


HOST_SNAPSHOTS = [
    host_snapshot(held=0, freed=0, active=0),
    host_snapshot(held=8 * MIB, freed=0, active=4 * MIB),
    host_snapshot(held=4 * MIB, freed=4 * MIB, active=8 * MIB),
    host_snapshot(held=8 * MIB, freed=4 * MIB, active=12 * MIB),
]


def device_snapshot() -> dict[str, Any]:
    stats: dict[str, Any] = {"num_alloc_retries": 0, "num_ooms": 0}
    for stem, (current, freed) in {
        "allocated_bytes": (10 * MIB, 30 * MIB),
        "reserved_bytes": (20 * MIB, 0),
        "active_bytes": (12 * MIB, 28 * MIB),
        "allocation": (3, 9),
    }.items():
        for pool in ("all", "small_pool", "large_pool"):
            stats[f"{stem}.{pool}.current"] = current
            stats[f"{stem}.{pool}.peak"] = current + freed
            stats[f"{stem}.{pool}.allocated"] = current + freed
            stats[f"{stem}.{pool}.freed"] = freed
    return stats


def test_byte_counters_keep_bytes_and_all_pool_only() -> None:
    device = byte_counters(device_snapshot())
    assert set(device) == {"allocated_bytes", "reserved_bytes", "active_bytes"}
    assert device["allocated_bytes"] == Counter(current=10 * MIB, freed=30 * MIB, peak=40 * MIB)
    host = byte_counters(HOST_SNAPSHOTS[2])
    assert set(host) == {"allocated_bytes", "active_bytes"}
    assert host["active_bytes"].current == 8 * MIB


def test_byte_counters_need_current_freed_peak() -> None:
    assert byte_counters({"allocated_bytes.current": 5, "allocated_bytes.peak": 5}) == {}


def test_host_sequence_gauge_vs_running_total() -> None:
    classifier = CounterClassifier()
    kinds = {}
    history = []
    for snapshot in HOST_SNAPSHOTS:
        kinds = classifier.update(byte_counters(snapshot))
        history.append(dict(kinds))
    # Nothing has happened yet: no claim either way.
    assert history[0] == {
        "allocated_bytes": CounterKind.UNKNOWN,
        "active_bytes": CounterKind.UNKNOWN,
    }
    # After one growth both look like totals; the first decrease reveals the gauge.
    assert history[1]["allocated_bytes"] is CounterKind.RUNNING_TOTAL
    assert kinds == {
        "allocated_bytes": CounterKind.GAUGE,
        "active_bytes": CounterKind.RUNNING_TOTAL,
    }
    # The trap the classification prevents: gauge minus running total goes negative.
    last = byte_counters(HOST_SNAPSHOTS[-1])
    assert last["allocated_bytes"].current - last["active_bytes"].current < 0


def test_gauge_stays_gauge_once_freed_moved() -> None:
    classifier = CounterClassifier()
    classifier.update({"x_bytes": Counter(current=5, freed=0, peak=5)})
    classifier.update({"x_bytes": Counter(current=1, freed=4, peak=5)})
    kinds = classifier.update({"x_bytes": Counter(current=9, freed=4, peak=9)})
    assert kinds["x_bytes"] is CounterKind.GAUGE


def test_freed_before_first_look_is_gauge() -> None:
    kinds = CounterClassifier().update(byte_counters(device_snapshot()))
    assert kinds["allocated_bytes"] is CounterKind.GAUGE
    assert kinds["reserved_bytes"] is CounterKind.RUNNING_TOTAL


def test_counter_metrics_keys() -> None:
    counters = byte_counters(HOST_SNAPSHOTS[2])
    classifier = CounterClassifier()
    classifier.update(byte_counters(HOST_SNAPSHOTS[0]))
    metrics = counter_metrics("cuda_host", counters, classifier.update(counters))
    assert metrics == {
        "cuda_host/active_bytes/current": 8.0 * MIB,
        "cuda_host/active_bytes/freed": 0.0,
        "cuda_host/active_bytes/peak": 8.0 * MIB,
        "cuda_host/active_bytes/gauge": 0.0,
        "cuda_host/allocated_bytes/current": 4.0 * MIB,
        "cuda_host/allocated_bytes/freed": 4.0 * MIB,
        "cuda_host/allocated_bytes/peak": 8.0 * MIB,
        "cuda_host/allocated_bytes/gauge": 1.0,
    }
    unknown = counter_metrics("cuda_host", byte_counters(HOST_SNAPSHOTS[0]), {})
    assert not any(k.endswith("/gauge") for k in unknown)
