"""Which round a member of a quorum averages: its own, or the swarm's (Streaming DiLoCo).

Collectives line up only when every member averages the same fragment, and a healed island may be
elsewhere in its schedule. Every member decides from the round header alone (``plan_round``):
an island being healed averages zeros and adopts the swarm's round (its own dropped, residuals
restored); a live member out of step makes everyone abandon the round and takes the swarm's
clock. The outer loop finishes an ``AdoptedRound`` on its training thread; only
``share_adopted`` talks to the network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.membership.errors import MembershipError
from lightning_swarm.membership.fanout import IslandFanout
from lightning_swarm.membership.round_header import HeaderRow, reference_index


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


class RoundAdoption:
    """One island's side of the module's rule, round after round (``TorchftMembership`` holds
    one). The outer loop sets ``fragments`` and ``place_fn`` and reads ``take``
    (``outer.join.ElasticOuter.connect``).

    Lifetime: ``adopted`` is written on the thread that runs the round (the sync worker when
    ``sync_delay > 0``) and read by ``take`` on the thread that waited for that round.
    """

    def __init__(self) -> None:
        self.fragments: list[dict[str, tuple[int, ...]]] = []
        self.place_fn: Callable[[], RoundPlace] | None = None
        self.adopted: AdoptedRound | None = None
        self._plan: RoundPlan | None = None

    def mark(self, row: HeaderRow) -> None:
        """A new round: write this island's place into its header row."""
        self.adopted, self._plan = None, None
        place = self.place_fn() if self.place_fn is not None else RoundPlace(0, 0, 0)
        row.fragment, row.send_step, row.apply_step = astuple(place)

    def contribution(
        self, rows: list[HeaderRow], mine: HeaderRow, tensors: list[Tensor]
    ) -> list[Tensor] | None:
        """What this island averages in the round: its own tensors, zeros of the swarm's
        fragment (adopting), or ``None`` when every member abandons the round."""
        places = [RoundPlace(r.fragment, r.send_step, r.apply_step) for r in rows]
        me = next(i for i, r in enumerate(rows) if r.nonce == mine.nonce)
        plan = plan_round(places, [bool(r.healing) for r in rows], reference_index(rows), me)
        self._plan = plan
        if plan.abandon:
            return None
        if plan.adopt and not self.fragments:  # one fragment (nobody said otherwise)
            return [torch.zeros_like(t) for t in tensors]
        if plan.adopt:
            return list(zeros_for(self._shapes(plan.swarm.fragment)).values())
        return tensors

    def conclude(self, averaged: list[Tensor], applied: bool) -> None:
        """After the commit gate: keep the swarm's round if this island adopted it."""
        plan = self._plan
        if plan is None or not plan.adopt:
            return
        names = list(self._shapes(plan.swarm.fragment)) if self.fragments else []
        if applied and not names:
            raise MembershipError(
                "this island adopted the swarm's round but does not know the outer loop's "
                "parameter names; connect them first (ElasticOuter.connect(adoption))."
            )
        deltas = dict(zip(names, averaged, strict=True)) if applied else {}
        self.adopted = AdoptedRound(plan.swarm, deltas, applied)

    def share(self, fanout: IslandFanout) -> None:
        """The island's rank 0's adopted round on every rank of the island (collective)."""
        if fanout.size > 1:
            group = fanout.group
            src = dist.get_global_rank(group, 0) if group is not None else 0
            adopted = self.adopted if fanout.is_leader else None
            self.adopted = share_adopted(group, src, fanout.is_leader, adopted, self.fragments)

    def take(self) -> AdoptedRound | None:
        """The swarm's round this island adopted in its last round, once."""
        adopted, self.adopted = self.adopted, None
        return adopted

    def _shapes(self, fragment: int) -> dict[str, tuple[int, ...]]:
        if not 0 <= fragment < len(self.fragments):
            raise MembershipError(
                f"the swarm's round syncs fragment {fragment}, but this island knows "
                f"{len(self.fragments)} fragment(s); connect the outer loop to the membership "
                "(ElasticOuter.connect(adoption))."
            )
        return self.fragments[fragment]


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
