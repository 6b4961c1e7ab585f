"""Which round a member of a quorum averages: its own, or the swarm's (Streaming DiLoCo).

With fragments, each elastic round syncs one fragment, and the round's collectives only line
up when every member averages the same fragment's tensors. Members that trained together are
in step (their schedules count the same inner steps), but an island being healed is not: a
joiner at its first round, or an island back from a stop that missed rounds, may be at another
fragment or another step. So the round header carries each member's place (``RoundPlace``:
fragment, the inner step it was sent after and the one it applies at), and every member decides
from the header alone (``plan_round``), the same way everywhere:

- the swarm's place is the reference's (``round_header.reference_index``: the first member not
  being healed);
- an island being healed averages zeros for the swarm's fragment (it is not counted) and
  *adopts* the swarm's round: after the round its own round is dropped (not applied, its
  error-feedback residuals restored), it takes the healed state and the swarm's clock, and
  applies the swarm's averaged fragment as the others do, so its anchors end bitwise equal;
- a member not being healed whose fragment differs from the swarm's (no heal will align it:
  it has the swarm's committed rounds) makes every member abandon the round, and it adopts the
  swarm's clock without applying anything, so the next round lines up.

``AdoptedRound`` is what the outer loop receives to finish that on its training thread.
Nothing in this module talks to the network except ``share_adopted`` (the island's fan-out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class RoundPlace:
    """Where a round sits in an island's schedule."""

    fragment: int
    send_step: int  # the inner step it was sent after
    apply_step: int  # the inner step it applies at (send_step + sync_delay; join: send_step)


@dataclass
class AdoptedRound:
    """The swarm's round an island took in place of its own (see the module docstring).

    ``deltas`` hold the averaged pseudo-gradients of the fragment's names (empty when nothing
    is to be applied); ``applied`` says whether the swarm applies this round.
    """

    place: RoundPlace
    deltas: dict[str, Tensor]
    applied: bool


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


def zeros_for(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """Float32 zeros in the fragment's shapes: a healed island's contribution."""
    return {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}


def share_adopted(
    group: dist.ProcessGroup | None,
    src: int,
    is_leader: bool,
    adopted: AdoptedRound | None,
    fragments: Sequence[Mapping[str, tuple[int, ...]]],
) -> AdoptedRound | None:
    """The island's rank 0's adopted round on every rank of the island (collective over
    ``group``, the island's gloo fan-out group)."""
    head = torch.zeros(5, dtype=torch.int64)
    if is_leader and adopted is not None:
        place = adopted.place
        head = torch.tensor(
            [1, place.fragment, place.send_step, place.apply_step, int(adopted.applied)]
        )
    dist.broadcast(head, src=src, group=group)
    present, fragment, send_step, apply_step, applied = (int(v) for v in head.tolist())
    if not present:
        return None
    if not is_leader:
        deltas = zeros_for(fragments[fragment]) if applied else {}
        adopted = AdoptedRound(RoundPlace(fragment, send_step, apply_step), deltas, bool(applied))
    assert adopted is not None
    for name in sorted(adopted.deltas):
        dist.broadcast(adopted.deltas[name], src=src, group=group)
    return adopted
