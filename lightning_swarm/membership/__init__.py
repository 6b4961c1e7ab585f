"""Membership: which islands take part in an outer round (``static`` or ``torchft``).

Below the outer loop, above the transports; never imports Lightning; imports torchft only when
used. Its errors are exported by the package root (``membership/errors.py``).
"""

from __future__ import annotations

from lightning_swarm.membership.config import MEMBERSHIPS, check_membership, elastic_options

__all__ = ["MEMBERSHIPS", "check_membership", "elastic_options"]
