"""One background thread that runs outer-sync exchanges while training continues.

Jobs run in submission order, the same on every rank, so collectives match; while one runs only
this thread touches the transport and its group (``dedicated_peers=True``), and the job's tensors
are its own until its future resolves. ``close`` before the process groups are destroyed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from lightning_swarm.errors import SwarmError
from lightning_swarm.outer.errors import SyncWorkerError

_T = TypeVar("_T")


class SyncWorker:
    """A single-thread executor (thread ``swarm-sync``); on a CUDA ``device`` jobs run on a
    stream of their own, bound to that device."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="swarm-sync"
        )
        self._device = device if device is not None and device.type == "cuda" else None
        self._stream: torch.cuda.Stream | None = None
        self._last: Future[object] | None = None  # jobs run in order: the last one ends last

    def submit(self, job: Callable[[], _T]) -> Future[_T]:
        if self._executor is None:
            raise RuntimeError("the sync worker is closed; no exchange can be started")
        if self._device is None:
            future = self._executor.submit(job)
        else:
            future = self._executor.submit(self._on_own_stream, job)
        self._last = future  # type: ignore[assignment]
        return future

    def wait_idle(self) -> None:
        """Block until every job submitted so far has ended (each keeps its outcome in its
        future). The training thread calls it before a collective of its own: with several
        optimizers another optimizer's exchange may still run here on the same groups."""
        last = self._last
        if last is not None:
            wait([last])

    def _on_own_stream(self, job: Callable[[], _T]) -> _T:
        assert self._device is not None
        torch.cuda.set_device(self._device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._device)
        with torch.cuda.stream(self._stream):
            result = job()
        self._stream.synchronize()
        return result

    @staticmethod
    def wait(future: Future[_T], what: str) -> _T:
        """Block until ``future`` is done and return its result.

        Raises:
            SwarmError: the job's own, unchanged, so ``except`` clauses catch it as they would
                without ``sync_delay``.
            SyncWorkerError: the job raised anything else (its ``__cause__``), naming ``what``.
        """
        try:
            return future.result()
        except SwarmError as err:
            note = f"(raised by {what} in the background sync worker)"
            # Python 3.11+ prints notes under the traceback; a second wait adds none.
            if hasattr(err, "add_note") and note not in getattr(err, "__notes__", ()):
                err.add_note(note)
            raise
        except Exception as err:
            raise SyncWorkerError(
                f"{what} failed in the background sync worker: {type(err).__name__}: {err}"
            ) from err

    def close(self) -> None:
        """Wait for queued jobs and join the thread. Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
