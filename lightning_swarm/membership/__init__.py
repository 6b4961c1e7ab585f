"""Membership: which islands take part in an outer round.

- ``static``: every island of the one torch.distributed world, every round (the default).
- ``torchft``: islands are separate launches that meet through torchft's Lighthouse; each round
  takes a quorum of the live islands, averages over it, and commits or abandons the round on
  every survivor alike; joiners are healed from a live island (``TorchftMembership``).

This layer sits below the outer loop and above the transports; it never imports Lightning.
torchft is imported only when ``membership="torchft"`` is used (the ``elastic`` extra).
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
