"""Errors of the resume layer: a swarm file that is not what its checkpoint recorded.

Both are ``SwarmCheckpointError`` (a ``ValueError``): catching that catches them, and a resume
that fails on any rank raises a ``SwarmCheckpointError`` on every rank naming the cause.
"""

from __future__ import annotations

from lightning_swarm.errors import SwarmCheckpointError


class RecordError(SwarmCheckpointError):
    """A payload is not a swarm record of a readable format (the caller names the file)."""


class IntegrityError(SwarmCheckpointError):
    """A swarm file is not what its checkpoint recorded (the message names the file)."""
