"""Which round a member of a quorum averages: its own, or the swarm's (Streaming DiLoCo).

Collectives line up only when every member averages the same fragment, and a healed island may be
elsewhere in its schedule. Every member decides from the round header alone (``plan_round``):
an island being healed averages zeros and adopts the swarm's round (its own dropped, residuals
restored); a live member out of step makes everyone abandon the round and takes the swarm's
clock. The decision reaches the round engine as an ``Opening``; the engine forms the zeros and
applies the adopted round on its training thread.

Under a time budget the header also weighs the round (``weighed``): torchft divides the quorum's
sum by its participants, the members not being healed, so each participant scales its
pseudo-gradient by ``n w_i / W`` over the participants' weights (``budget.scale_of``: exactly 1
when they are equal); a member being healed sends zeros and brings no weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_swarm.algorithm.budget import scale_of
from lightning_swarm.membership.round_header import HeaderRow, reference_index
from lightning_swarm.transport.base import Opening, RoundPlace, checked_work

__all__ = ["RoundPlace", "RoundPlan", "opening_of", "plan_round", "weighed"]


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


def weighed(rows: list[HeaderRow], mine: HeaderRow, opening: Opening) -> Opening:
    """``opening`` with this member's scale and the swarm's most inner steps, from the work
    in the header's ``rows`` (a time-budgeted round; see the module docstring).

    Raises:
        BadWorkError: a participant's work is not a whole number >= 1 (``base.checked_work``,
            naming it by its place in the quorum); every member reads the same rows.
    """
    participants = [(k, r) for k, r in enumerate(rows) if not r.healing]
    if not participants:
        return opening
    weights, swarm_steps = checked_work(
        [(float(r.work), float(r.inner_steps)) for _, r in participants],
        [f"the island at place {k} of the quorum (island_id hash {r.island:x})"
         for k, r in participants],
    )  # fmt: skip
    mine_at = [i for i, (_, r) in enumerate(participants) if r.nonce == mine.nonce]
    scale = scale_of(weights, mine_at[0]) if mine_at else 1.0
    return replace(opening, scale=scale, swarm_steps=swarm_steps)
