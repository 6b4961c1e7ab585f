"""A Lightning callback that records one rank's step times for ``benchmarks/wan.py``.

Added to a run of the Hydra app from the command line (``+callbacks.wan_steps._target_=
wan_steps.StepTimes +callbacks.wan_steps.path=FILE``, with ``benchmarks/`` on PYTHONPATH), so
the library is measured as a user runs it and nothing in the package changes.

Per inner step it records when the batch ended (seconds since the fit started), and, for the
thread that trains, the CPU time it got, the time it waited runnable on a run queue (from
``/proc/thread-self/schedstat``; 0 where the kernel has no schedstat), the CPU time of the
whole process (every thread: the sync worker's and gloo's too), and the strategy's
running ``sync_wall_s`` (the time the training thread spent blocked in outer rounds). What is
left of a step's wall time after CPU and run-queue time is time the training thread slept:
waiting on a lock (the GIL included), a future or a socket. Validation passes are recorded as
spans so that step times can leave them out. At the end of the fit it writes one JSON file with
these series, the validation losses with their times, the rank's outer totals, each Python
thread's CPU time and a digest of the final parameters. Per step it also keeps the rank's
committed outer rounds, so a round's commit can be placed in wall-clock time (``t0_unix``).
The file belongs to the rank that writes it; ``wan.py`` only reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor


def schedstat(path: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting) of one thread; zeros if unreadable."""
    try:
        with open(path) as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live Python thread of this process, by name."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields[11], fields[12]: utime, stime (the 14th and 15th fields of stat)
        out[thread.name] = out.get(thread.name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def params_digest(module: pl.LightningModule) -> str:
    """SHA-256 of the module's full parameters (sorted by name, raw bytes): equal digests are
    bitwise equal models. A sharded parameter is gathered over its mesh first (collective:
    every rank of the island calls this)."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepTimes(pl.Callback):
    """Records this rank's step and validation timeline and writes it to ``path`` at the end.

    Args:
        path: the JSON file to write; ``{rank}`` in it is replaced by the global rank.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.t0 = 0.0
        self.t0_unix = 0.0
        self.outer_steps_at: list[int] = []
        self.step_end_s: list[float] = []
        self.global_step: list[int] = []
        self.thread_cpu_s: list[float] = []
        self.thread_wait_s: list[float] = []
        self.process_cpu_s: list[float] = []
        self.sync_wall_s: list[float] = []
        self.val_spans: list[tuple[float, float]] = []
        self.val_points: list[tuple[float, int, float]] = []
        self._val_start = 0.0

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        on_cpu, waiting = schedstat("/proc/thread-self/schedstat")
        self.step_end_s.append(self._now())
        self.global_step.append(trainer.global_step)
        self.thread_cpu_s.append(on_cpu)
        self.thread_wait_s.append(waiting)
        self.process_cpu_s.append(time.process_time())
        totals = getattr(trainer.strategy, "totals", None)
        self.sync_wall_s.append(float(getattr(totals, "sync_wall_s", 0.0)))
        self.outer_steps_at.append(int(getattr(totals, "outer_steps", 0)))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = self._now()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        end = self._now()
        self.val_spans.append((self._val_start, end))
        loss = trainer.callback_metrics.get("val_loss")
        if loss is not None and not trainer.sanity_checking:
            self.val_points.append((end, trainer.global_step, float(loss)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here, not at the fit's end: a sharded island's mesh is gone by then.
        self.digest = params_digest(pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        totals = getattr(trainer.strategy, "totals", None)
        record = {
            "global_rank": trainer.global_rank,
            "fit_s": self._now(),
            "t0_unix": self.t0_unix,
            "outer_steps_at": self.outer_steps_at,
            "params_sha256": getattr(self, "digest", None) or params_digest(pl_module),
            "step_end_s": self.step_end_s,
            "global_step": self.global_step,
            "thread_cpu_s": self.thread_cpu_s,
            "thread_wait_s": self.thread_wait_s,
            "process_cpu_s": self.process_cpu_s,
            "sync_wall_s": self.sync_wall_s,
            "val_spans": self.val_spans,
            "val_points": self.val_points,
            "outer_steps": int(getattr(totals, "outer_steps", 0)),
            "bytes_sent": int(getattr(totals, "bytes_sent", 0)),
            "threads_cpu_s": thread_cpu(),
        }
        path = Path(self.path.replace("{rank}", str(trainer.global_rank)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
