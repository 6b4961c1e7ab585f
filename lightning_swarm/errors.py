"""The root of every error lightning_swarm raises on purpose, and the errors several layers raise.

Catch ``SwarmError`` to catch any of them. Each concrete class keeps the builtin base callers
already catch (``ValueError`` for a bad option or input, ``RuntimeError`` for a failed round,
``OSError`` for a full disk), so existing ``except ValueError`` code keeps working.

Where an error is declared: here when more than one layer raises it (a bad option is refused by
every layer that owns one; a checkpoint is refused by the resume layer and the strategy's
checkpoint IO) or when the glue layer (the strategy and its helpers) raises it; otherwise in the
``errors.py`` of the one layer that raises it (``transport``, ``membership``, ``resume``,
``outer``). The package root exports every error a user can act on. This module imports only the
standard library, so every layer may import it.
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
