"""One background thread that runs outer-sync exchanges while training continues.

Invariants: one thread per strategy, jobs in submission order; every rank submits the same jobs
in the same order, so collectives match. While a job runs only this thread touches the transport
and its group, which must not be one the training thread uses (``dedicated_peers=True``). A job's
tensors belong to it until its future resolves. ``close`` joins the thread; call it before the
process groups are destroyed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from lightning_swarm.errors import SwarmError
from lightning_swarm.outer.errors import SyncWorkerError

_T = TypeVar("_T")


class SyncWorker:
    """A single-thread executor (thread ``swarm-sync``) with a clear error when a job fails.

    Args:
        device: the rank's accelerator; a CUDA device makes jobs run on their own stream
            (not exercised on a GPU yet: the CPU suite covers the thread, not the streams).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="swarm-sync"
        )
        # On CUDA the worker binds to the rank's device and issues its copies and collectives
        # on a stream of its own, so they neither land on another GPU nor queue behind (or in
        # front of) the training thread's kernels on the default stream.
        self._device = device if device is not None and device.type == "cuda" else None
        self._stream: torch.cuda.Stream | None = None

    def submit(self, job: Callable[[], _T]) -> Future[_T]:
        """Queue ``job``; it runs after every job submitted before it."""
        if self._executor is None:
            raise RuntimeError("the sync worker is closed; no exchange can be started")
        if self._device is None:
            return self._executor.submit(job)
        return self._executor.submit(self._on_own_stream, job)

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
            SwarmError: the job raised one (``RoundTimeoutError``, ``PeerLostError``,
                ``MembershipError``, ...): that same error, its traceback and cause kept, so
                ``except`` clauses for it catch it as they would without ``sync_delay``.
            SyncWorkerError: the job raised anything else; the message names ``what`` and the
                cause, which is its ``__cause__``.
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
