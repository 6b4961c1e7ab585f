"""The root of every error lightning_swarm raises on purpose, and the errors several layers raise.

Catch ``SwarmError`` to catch any of them; each class also keeps the builtin base callers already
catch (``ValueError``, ``RuntimeError``, ``OSError``). An error raised by one layer only is
declared in that layer's ``errors.py``. Imports only the standard library.
"""

from __future__ import annotations

import errno
from typing import Any


class SwarmError(Exception):
    """Base of every error lightning_swarm raises on purpose; the message says what to do."""


class SwarmConfigError(SwarmError, ValueError):
    """An option has a value lightning_swarm refuses; the message names the option and the fix.

    Raised before anything is built where the value alone decides (``SwarmConfig``), at setup
    where the launch decides (``island_size`` must divide the world size).
    """


class SwarmConfigTypeError(SwarmError, TypeError):
    """An option has a type lightning_swarm refuses (e.g. ``swarm`` given as a list)."""


class SwarmCheckpointError(SwarmError, ValueError):
    """A swarm checkpoint cannot be resumed from; the message says why and what to do."""


class DiskFullError(SwarmError, OSError):
    """No space left on the device a checkpoint file was being written to.

    The message names the file, the bytes it needs and the bytes free; ``errno`` is ENOSPC and
    ``filename`` the file, as for the ``OSError`` the operating system raised.
    """

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
    """An outer round's collective gave up: the message names the link rate the last round
    measured, the round's payload bytes, the timeout it had and the option that raises it."""


class PeerLostError(SwarmError, RuntimeError):
    """A peer's connection closed mid-collective (its process died or its link went away):
    the message names the island (and rank, where known) that went away, the round, and what
    to do."""
