"""Errors of the resume layer, both ``SwarmCheckpointError``s: a resume that fails on any rank
raises a plain ``SwarmCheckpointError`` on every rank naming the cause."""

from __future__ import annotations

from lightning_swarm.errors import SwarmCheckpointError


class RecordError(SwarmCheckpointError):
    """A payload is not a swarm record of a readable format (the caller names the file)."""


class IntegrityError(SwarmCheckpointError):
    """A swarm file is not what its checkpoint recorded (the message names the file)."""
