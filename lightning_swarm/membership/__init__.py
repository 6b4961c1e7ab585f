"""Membership: which islands take part in an outer round (``static`` or ``torchft``).

Below the outer loop, above the transports; never imports Lightning; imports torchft only when used.
"""

from __future__ import annotations

from lightning_swarm.membership.config import MEMBERSHIPS, check_membership, elastic_options
from lightning_swarm.membership.errors import (
    DivergedIslandError,
    DuplicateIslandError,
    LighthouseLostError,
    LighthouseUnreachableError,
    MembershipError,
    ModelMismatchError,
    QuorumTimeoutError,
    SettingsMismatchError,
    SwarmGoneError,
    TorchftVersionError,
)

__all__ = [
    "MEMBERSHIPS",
    "DivergedIslandError",
    "DuplicateIslandError",
    "LighthouseLostError",
    "LighthouseUnreachableError",
    "MembershipError",
    "ModelMismatchError",
    "QuorumTimeoutError",
    "SettingsMismatchError",
    "SwarmGoneError",
    "TorchftVersionError",
    "check_membership",
    "elastic_options",
]
