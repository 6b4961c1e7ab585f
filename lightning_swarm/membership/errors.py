"""Errors of elastic membership; each is raised on every rank of the island it concerns."""

from __future__ import annotations

from lightning_swarm.errors import SwarmError


class MembershipError(SwarmError, RuntimeError):
    """An island cannot take part in the swarm; the message names the cause and the fix."""


class LighthouseUnreachableError(MembershipError):
    """The lighthouse did not answer within the connect timeout."""


class QuorumTimeoutError(MembershipError):
    """Fewer than ``min_islands`` islands met for longer than the quorum timeout."""


class LighthouseLostError(MembershipError):
    """The lighthouse stopped answering mid-run and did not come back within the quorum timeout."""


class SwarmGoneError(QuorumTimeoutError):
    """This island was suspended (or starved) past its timeouts and found no swarm after it."""


class SettingsMismatchError(MembershipError):
    """This island's DiLoCo settings (sync_every, outer optimizer, ...) differ from the swarm's."""


class DuplicateIslandError(MembershipError):
    """Another live island already claims this island's ``island_id``."""


class ModelMismatchError(MembershipError):
    """This island's model (parameter names, shapes, dtypes) differs from the swarm's."""


class DivergedIslandError(MembershipError):
    """This island's pseudo-gradient holds NaN or inf; it leaves the swarm, the others go on."""


class TorchftVersionError(MembershipError):
    """The installed torchft lacks a private name of ``membership/torchft_private.py``."""
