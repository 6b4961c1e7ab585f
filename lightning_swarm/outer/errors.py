"""Errors of the outer loop: a round that failed on another thread or on another rank."""

from __future__ import annotations

from lightning_swarm.errors import SwarmError


class SyncWorkerError(SwarmError, RuntimeError):
    """An exchange failed in the background worker with an error that is not a ``SwarmError``;
    raised in the training thread, with the failure as its ``__cause__``."""


class ShareFailedError(SwarmError, RuntimeError):
    """Raised on the ranks of an island whose other share of a round failed."""
