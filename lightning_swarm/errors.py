"""The root of every error lightning_swarm raises on purpose, and the checkpoint error.

Catch ``SwarmError`` to catch any of them. Each concrete class keeps the builtin base callers
already catch (``ValueError`` for bad input, ``RuntimeError`` for a failed round), so existing
``except ValueError`` code keeps working. The concrete classes live beside the code that raises
them; this module imports nothing from the package, so every layer may import it.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error lightning_swarm raises on purpose; the message says what to do."""


class SwarmCheckpointError(SwarmError, ValueError):
    """A swarm checkpoint cannot be resumed from; the message says why and what to do."""
