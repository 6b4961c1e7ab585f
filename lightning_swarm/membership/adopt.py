"""Which round a member of a quorum averages: its own, or the swarm's (Streaming DiLoCo).

Collectives line up only when every member averages the same fragment, and a healed island may be
elsewhere in its schedule. Every member decides from the round header alone (``plan_round``):
an island being healed averages zeros and adopts the swarm's round (its own dropped, residuals
restored); a live member out of step makes everyone abandon the round and takes the swarm's
clock. The decision reaches the round engine as an ``Opening``; the engine forms the zeros and
applies the adopted round on its training thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_swarm.membership.round_header import HeaderRow, reference_index
from lightning_swarm.transport.base import Opening, RoundPlace

__all__ = ["RoundPlace", "RoundPlan", "opening_of", "plan_round"]


@dataclass(frozen=True)
class RoundPlan:
    """A member's decision for one round, from the header alone."""

    swarm: RoundPlace
    adopt: bool  # average zeros for the swarm's fragment and take the swarm's round
    abandon: bool  # members disagree on the fragment: every member abandons the round


def plan_round(
    places: Sequence[RoundPlace], healing: Sequence[bool], reference: int, me: int
) -> RoundPlan:
    """The plan of member ``me`` (rows in the quorum's order; see the module docstring)."""
    swarm = places[reference]
    abandon = any(
        not heal and place.fragment != swarm.fragment
        for place, heal in zip(places, healing, strict=True)
    )
    adopt = healing[me] or places[me].fragment != swarm.fragment
    return RoundPlan(swarm, adopt, abandon)


def opening_of(rows: list[HeaderRow], mine: HeaderRow) -> Opening:
    """This member's ``Opening`` from the round header's ``rows`` (``mine`` is among them)."""
    places = [RoundPlace(r.fragment, r.send_step, r.apply_step) for r in rows]
    me = next(i for i, r in enumerate(rows) if r.nonce == mine.nonce)
    plan = plan_round(places, [bool(r.healing) for r in rows], reference_index(rows), me)
    return Opening(adopt=plan.swarm if plan.adopt else None, abandon=plan.abandon)
