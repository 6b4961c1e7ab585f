"""Errors of the outer loop: a round that failed on another thread or on another rank.

Each is a ``SwarmError`` and a ``RuntimeError``; the message names the round and the cause.
"""

from __future__ import annotations

from lightning_swarm.errors import SwarmError


class SyncWorkerError(SwarmError, RuntimeError):
    """An exchange failed in the background worker with an error that is not a ``SwarmError``
    (those reach the training thread as themselves); raised in the training thread.

    The failure itself (torch's, or a bug's) is its ``__cause__``.
    """


class ShareFailedError(SwarmError, RuntimeError):
    """Raised on the ranks of an island whose other share of a round failed."""
