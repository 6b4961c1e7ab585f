"""Membership: which islands take part in an outer round.

``static``: every island of the one world, every round. ``torchft``: separate launches meet at a
Lighthouse; each round takes a quorum, averages over it and commits or abandons alike on every
survivor (``TorchftMembership``). Below the outer loop, above the transports; never imports
Lightning. torchft is imported only when used.
"""

from __future__ import annotations

from lightning_swarm.membership.config import elastic_options
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
from lightning_swarm.membership.static import MEMBERSHIPS, check_membership

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
