"""``HostMemoryCensus``: a per-step snapshot of host memory, logged under ``census/``.

It tells a leak from a sawtooth (keys and cadences: ``docs/census.md``), holds no tensors, and
reads the swarm's figures through the ``SwarmMemoryReport`` protocol, never the strategy."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_swarm.errors import SwarmConfigError, SwarmConfigTypeError
from lightning_swarm.memory.procfs import ProcReader, file_backed_overlap
from lightning_swarm.memory.sampler import (
    CounterClassifier,
    HostSampler,
    RunSummary,
    byte_counters,
    counter_metrics,
)

AllocatorStats = Callable[[], Mapping[str, Mapping[str, Any]]]


@runtime_checkable
class SwarmMemoryReport(Protocol):
    """What a swarm run tells the census about its resident state on this rank (a strategy's
    ``memory_report``; ``OuterLoop`` implements it). No method keeps a reference to a tensor.
    ``memory_key`` changes whenever the two byte counts may (both walk every anchor, so they are
    recomputed only then); ``spool_bytes`` is ``None`` when the transport does not spool;
    ``anchor_spans`` gives ``(address, bytes)`` of each host-memory anchor storage."""

    def memory_key(self) -> Hashable: ...
    def anchor_bytes(self) -> int: ...
    def outer_state_bytes(self) -> int: ...
    def spool_bytes(self) -> int | None: ...
    def anchor_spans(self) -> Sequence[tuple[int, int]]: ...


def cuda_allocator_stats() -> dict[str, Mapping[str, Any]]:
    """Flat snapshots of CUDA's device and pinned-host allocators; {} unless CUDA is already
    initialised (never initialises it)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    out: dict[str, Mapping[str, Any]] = {"cuda_device": torch.cuda.memory_stats()}
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        out["cuda_host"] = host_stats()
    return out


def _check_count(name: str, value: object, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SwarmConfigTypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}; {fix}"
        )
    if value < minimum:
        raise SwarmConfigError(f"{name}={value} must be >= {minimum}; {fix}")
    return value


class HostMemoryCensus(Callback):
    """Log a host-memory census under ``census/`` while fitting, straight to the loggers (so
    ``log_every_n_steps`` cannot drop it).

    Args:
        every_n_steps: optimizer steps between constant-cost samples (>= 1).
        smaps_every_n_steps: steps between page-walking smaps_rollup reads (0: first and last).
        all_ranks: sample every rank, gathered to rank 0 as ``census/rank<r>/...`` (a
            synchronisation point per census step); False samples global rank 0 only.
        proc_root: the procfs mount point.
        allocator_stats: flat allocator snapshots by source name; default reads CUDA's.

    Raises:
        TypeError, ValueError: an argument has the wrong type or range (the message names it).
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        smaps_every_n_steps: int = 500,
        all_ranks: bool = False,
        *,
        proc_root: str = "/proc",
        allocator_stats: AllocatorStats | None = None,
    ) -> None:
        self.every_n_steps = _check_count(
            "every_n_steps", every_n_steps, 1, "use 1 to sample every optimizer step."
        )
        self.smaps_every_n_steps = _check_count(
            "smaps_every_n_steps",
            smaps_every_n_steps,
            0,
            "use e.g. 500, or 0 to read smaps_rollup only at the start and end of fit.",
        )
        if not isinstance(all_ranks, bool):
            raise SwarmConfigTypeError(
                f"all_ranks must be True or False, got {all_ranks!r}; use False to sample on "
                "global rank 0 only."
            )
        self.all_ranks = all_ranks
        self.reader = ProcReader(proc_root)
        self.sampler = HostSampler(self.reader)
        self.allocator_stats = allocator_stats or cuda_allocator_stats
        self._reset()

    def _reset(self) -> None:
        self.summary: dict[str, float] = {}
        self._run = RunSummary()
        self._classifiers: dict[str, CounterClassifier] = {}
        self._last_step: int | None = None
        self._swarm_cache: dict[str, float] = {}
        self._swarm_key: Hashable | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        if self._samples_here(trainer):
            self._census(trainer, slow=True)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        # Micro-batches of gradient accumulation end without a new optimizer step.
        if step == self._last_step or not self._samples_here(trainer):
            return
        slow = self.smaps_every_n_steps > 0 and step % self.smaps_every_n_steps == 0
        if slow or step % self.every_n_steps == 0:
            self._census(trainer, slow=slow)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._samples_here(trainer):
            self._census(trainer, slow=True, final=True)

    def _samples_here(self, trainer: pl.Trainer) -> bool:
        return self.all_ranks or trainer.global_rank == 0

    def collect(self, trainer: pl.Trainer, *, slow: bool) -> dict[str, float]:
        """One census of this rank, keys without the ``census/`` prefix; updates the summary."""
        step = trainer.global_step
        self._last_step = step
        fast = self.sampler.sample_fast()
        self._run.update(step, fast)
        metrics: dict[str, float] = {k: float(v) for k, v in fast.items()}
        if slow:
            metrics.update(self.sampler.sample_slow())
        metrics.update(self._swarm_metrics(trainer, slow=slow))
        for source, snapshot in self.allocator_stats().items():
            counters = byte_counters(snapshot)
            kinds = self._classifiers.setdefault(source, CounterClassifier()).update(counters)
            metrics.update(counter_metrics(source, counters, kinds))
        return metrics

    def _census(self, trainer: pl.Trainer, *, slow: bool, final: bool = False) -> None:
        metrics = self.collect(trainer, slow=slow)
        if final:
            metrics.update(self._run.metrics())
        per_rank = self._gather(trainer, metrics)
        if per_rank is None:
            return  # a non-zero rank under all_ranks: rank 0 logs for it
        logged: dict[str, float] = {}
        for rank, rank_metrics in per_rank.items():
            prefix = "census/" if rank is None else f"census/rank{rank}/"
            logged.update({prefix + k: v for k, v in rank_metrics.items()})
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=trainer.global_step)
        if final:
            self.summary = {k: v for k, v in logged.items() if "/summary/" in k}
            for rank, rank_metrics in per_rank.items():
                rank_zero_info(_summary_line(rank, rank_metrics))

    def _gather(
        self, trainer: pl.Trainer, metrics: dict[str, float]
    ) -> dict[int | None, dict[str, float]] | None:
        if not self.all_ranks:
            return {None: metrics}
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            return {trainer.global_rank: metrics}
        gathered: list[Any] | None = (
            [None] * trainer.world_size if trainer.global_rank == 0 else None
        )
        torch.distributed.gather_object(metrics, gathered, dst=0)
        return None if gathered is None else dict(enumerate(gathered))

    def _swarm_metrics(self, trainer: pl.Trainer, *, slow: bool) -> dict[str, float]:
        report = getattr(trainer.strategy, "memory_report", None)
        if not isinstance(report, SwarmMemoryReport):
            return {}
        stage = getattr(trainer.strategy, "pipeline_stage", None)
        staged = {} if stage is None else {"swarm/pipeline_stage": float(stage)}
        key = report.memory_key()
        if slow or key != self._swarm_key:
            self._swarm_key = key
            self._swarm_cache = {
                "swarm/anchor_bytes": float(report.anchor_bytes()),
                "swarm/outer_state_bytes": float(report.outer_state_bytes()),
            }
        out = {**staged, **self._swarm_cache}
        # The spool fills and drains inside a sync; the transport keeps a running byte count,
        # so it is read afresh at every census step.
        spool_bytes = report.spool_bytes()
        if spool_bytes is not None:
            out["swarm/spool_bytes"] = float(spool_bytes)
        spans = report.anchor_spans() if slow else None
        regions = self.reader.maps() if spans else None  # unmeasurable: no maps or CPU anchors
        if spans and regions is not None:
            out["swarm/anchor_file_backed_bytes"] = float(file_backed_overlap(spans, regions))
        return out


def _summary_line(rank: int | None, metrics: Mapping[str, float]) -> str:
    def gib(key: str) -> str:
        value = metrics.get(key)
        return "n/a" if value is None else f"{value / 2**30:.3f} GiB"

    slope = metrics.get("summary/anon_slope_bytes_per_step")
    slope_text = "n/a" if slope is None else f"{slope / 1024:+.1f} KiB/step"
    who = "" if rank is None else f" rank {rank}"
    stage = metrics.get("swarm/pipeline_stage")
    if stage is not None:  # a rank holds one pipeline stage's part of the model
        who += f" (stage {int(stage)})"
    return (
        f"census{who}: peak RSS {gib('summary/peak_rss_bytes')}, "
        f"peak anon {gib('summary/peak_anon_bytes')}, anon slope {slope_text} "
        f"over {int(metrics.get('summary/num_samples', 0))} samples"
    )
