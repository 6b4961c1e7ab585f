"""Host-memory readers: procfs text parsers, a psutil stand-in, allocator counter classes.

Stdlib (+ psutil) only: nothing here imports torch or lightning.
"""

from lightning_swarm.memory.allocator import (
    Counter,
    CounterClassifier,
    CounterKind,
    byte_counters,
    counter_metrics,
)
from lightning_swarm.memory.procfs import (
    MapRegion,
    ProcReader,
    file_backed_overlap,
    parse_maps,
    parse_meminfo,
    parse_smaps,
    parse_smaps_rollup,
    parse_status,
)
from lightning_swarm.memory.sampler import HostSampler, RunSummary

__all__ = [
    "Counter",
    "CounterClassifier",
    "CounterKind",
    "HostSampler",
    "MapRegion",
    "ProcReader",
    "RunSummary",
    "byte_counters",
    "counter_metrics",
    "file_backed_overlap",
    "parse_maps",
    "parse_meminfo",
    "parse_smaps",
    "parse_smaps_rollup",
    "parse_status",
]
