"""The root of every error lightning_swarm raises on purpose, and the errors several layers raise.

Catch ``SwarmError`` to catch any of them; each also keeps its builtin base (``ValueError``,
``RuntimeError``, ``OSError``). An error one layer raises is declared in that layer's ``errors.py``.
"""

from __future__ import annotations

import errno
from typing import Any


class SwarmError(Exception):
    """Base of every error lightning_swarm raises on purpose; the message says what to do."""


class SwarmConfigError(SwarmError, ValueError):
    """An option has a value lightning_swarm refuses; the message names the option and the fix."""


class SwarmConfigTypeError(SwarmError, TypeError):
    """An option has a type lightning_swarm refuses (e.g. ``swarm`` given as a list)."""


class SwarmCheckpointError(SwarmError, ValueError):
    """A swarm checkpoint cannot be resumed from; the message says why and what to do."""


class DiskFullError(SwarmError, OSError):
    """No space left for a checkpoint file: the message names the file, the bytes it needs and
    the bytes free; ``errno`` is ENOSPC and ``filename`` the file, as for the OS's error."""

    def __init__(self, message: str, filename: str | None = None) -> None:
        super().__init__(errno.ENOSPC, message, filename)

    def __str__(self) -> str:
        # OSError's own form would add "[Errno 28]" and repeat the file the message names.
        return str(self.strerror)

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries (spawned ranks) with its message intact.
        return (type(self), (self.strerror, self.filename))


class CollectiveTimeoutError(SwarmError, RuntimeError):
    """A collective waited ``timeout_s`` for a rank that never came (stopped, hung or dead)."""


class RoundTimeoutError(CollectiveTimeoutError):
    """An outer round's collective gave up; the message names the measured link rate, the
    payload, the timeout and the option that raises it."""


class PeerLostError(SwarmError, RuntimeError):
    """A peer's connection closed mid-collective; the message names who went away, the round,
    and what to do."""
