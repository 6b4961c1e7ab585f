"""The outer loop's side of elastic membership: what a joiner receives and how it installs it.

A live island hands a joiner its global state: per optimizer, the anchors, the outer optimizer
state and the counters (``state``). With ``sync_delay > 0`` the live island has a round in
flight while it heals a joiner: that round is the very round of the quorum, so the joiner
takes the anchors as they were before it and applies the same averaged pseudo-gradient as the
live island (the membership's adopted round, ``membership/adopt.py``); the live island's
round in flight is not handed over. Error-feedback residuals are not handed over either: they
are an island's own quantization error; a healed island keeps its own, a new one starts at
zero (a peer's residuals would re-send that peer's error).

A heal arrives on the thread that runs the exchange, the background worker when
``sync_delay > 0``, while the training thread steps the inner optimizer. So ``install`` only
keeps the state; ``settle`` installs it on the training thread, after the island's own round
was resolved: ``local <- anchor_new + (local - anchor_old)`` (the island keeps its progress,
also when healed in the middle of a run), takes the swarm's clock and applies the swarm's
round (``AdoptedRound``).

A joiner's first round runs at once, outside the inner-step schedule (``join_round``): the live
islands are at their own round; the joiner is healed inside it, contributes nothing, and applies
the same averaged pseudo-gradient, so its anchors equal theirs after that round. Its parameters
then get the catch-up ``local <- global_new + (local - anchor_old)``: a new island, whose
parameters equal its own anchors, lands exactly on the global model; an island resumed from its
own older checkpoint keeps the progress it made since its anchors.

An elastic fit ends on a committed round, the same on every island, with every parameter set to
its anchor (``land_on_anchors``), so that islands end equal whatever ``merge_alpha`` is.

Ownership: ``ElasticOuter`` borrows the outer loop's ``OuterSync`` objects; installed tensors are
adopted by them. A kept heal lives until ``settle``; the progress kept for the catch-up lives
only during ``join_round``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_swarm.algorithm import global_norm
from lightning_swarm.membership.adopt import AdoptedRound, RoundAdoption, RoundPlace
from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.sync import OuterSync
from lightning_swarm.outer.sync_state import Exchanged, RoundInFlight
from lightning_swarm.outer.two_phase import TwoPhaseRound
from lightning_swarm.transport.base import RoundStats

TakeAdopted = Callable[[], AdoptedRound | None]


class ElasticOuter:
    """Heal hooks, the first round and the adopted rounds of an elastic island's outer syncs.

    Args:
        outer_syncs: the outer loop's syncs (one: elastic islands train one optimizer).
        take_adopted: the membership's ``take_adopted`` (``None``: rounds are never adopted).
    """

    def __init__(
        self, outer_syncs: Sequence[OuterSync], take_adopted: TakeAdopted | None = None
    ) -> None:
        self.outer_syncs = list(outer_syncs)
        self.take_adopted = take_adopted
        self.healed = False
        self._kept: dict[str, Any] | None = None
        self._joining = False

    def connect(self, adoption: RoundAdoption) -> None:
        """Wire this island's membership (``TorchftMembership.adoption``) to these syncs: it
        learns each fragment's shapes and where a round sits, and hands adopted rounds here.
        ``settle`` must then run on the training thread after every round's report."""
        adoption.fragments = fragment_shapes(self.outer_syncs[0])
        adoption.place_fn = self.place
        self.take_adopted = adoption.take

    def place(self) -> RoundPlace:
        """Where the round being exchanged sits in this island's schedule (for the header).

        Read on the exchange's thread: the round in flight's fragment and send step were set
        before its exchange started and do not change until its apply.
        """
        s = self.outer_syncs[0].state
        rnd = s.in_flight
        if rnd is None:  # not inside a round of the schedule (a test calling average itself)
            return RoundPlace(0, s.inner_steps, s.inner_steps)
        delay = 0 if self._joining else s.schedule.sync_delay
        return RoundPlace(rnd.fragment, rnd.send_step, rnd.send_step + delay)

    def state(self) -> dict[str, Any]:
        """The global state a joiner needs, one entry per optimizer (tensors are not copied).

        Called by torchft on the quorum's thread while this island's round is being exchanged:
        anchors and outer state do not move until that round's apply, which waits for it.
        The counters are those of the round's send (the training thread may be past it).
        """
        states = []
        for outer in self.outer_syncs:
            s = outer.state
            rnd = s.in_flight
            states.append(
                {
                    "anchors": dict(s.anchors),
                    "outer_optimizer": s.outer_optimizer.state_dict(),
                    "inner_steps": s.inner_steps if rnd is None else rnd.send_step,
                    "outer_steps": s.outer_steps,
                    "fragment_rounds": list(s.fragment_rounds),
                    "synced_at": list(s.synced_at),
                    "ended_at": s.ended_at,
                }
            )
        return {"outer": states}

    def install(self, state: dict[str, Any]) -> None:
        """Keep a live island's global state for ``settle`` (see the module docstring).

        Raises:
            ValueError: the swarm trains another number of optimizers.
        """
        states = state["outer"]
        if len(states) != len(self.outer_syncs):
            raise ValueError(
                f"the swarm trains {len(states)} optimizer(s), this island "
                f"{len(self.outer_syncs)}; start it with the swarm's model and optimizers"
            )
        self._kept = state

    @torch.no_grad()
    def settle(self) -> SyncReport | None:
        """On the training thread, after the island's own round was resolved: install a kept
        heal and apply the swarm's round this island adopted (if any); returns the adopted
        round's report when one was applied."""
        adopted = self.take_adopted() if self.take_adopted is not None else None
        if self._kept is not None:
            self._install_kept()
        if adopted is None:
            return None
        outer = self.outer_syncs[0]
        s = outer.state
        assert s.in_flight is None, "the island's own round was resolved before"
        s.inner_steps = adopted.place.apply_step  # the swarm's clock
        if not adopted.applied:
            return None
        engine = outer.engine
        assert isinstance(engine, TwoPhaseRound), "elastic rounds are two-phase"
        s.in_flight = RoundInFlight(
            adopted.place.fragment,
            adopted.place.send_step,
            adopted.deltas,
            result=Exchanged(RoundStats(applied=True), global_norm(list(adopted.deltas.values()))),
        )
        return engine.apply(adopted.place.fragment)

    def _install_kept(self) -> None:
        """Adopt the kept state, keeping this island's own progress since its anchors:
        ``local <- anchor_new + (local - anchor_old)``.

        A heal in the middle of a run (the island missed a commit) whose round is then abandoned
        would otherwise leave stale weights under the new anchors, and the island's next
        pseudo-gradient would carry the swarm's whole advance since.
        """
        assert self._kept is not None
        states, self._kept = self._kept["outer"], None
        for outer, saved in zip(self.outer_syncs, states, strict=True):
            own = {n: p.float() - outer.anchors[n].float() for n, p in outer.params.items()}
            # The clock is set by the adopted round; none is in flight at a settle.
            outer.load_state_dict({**saved, "inner_steps": 0, "pending": None})
            outer.state.inner_steps = int(saved["inner_steps"])
            for name, param in outer.params.items():
                param.copy_(outer.anchors[name].float() + own[name])
        self.healed = True

    @torch.no_grad()
    def join_round(self) -> list[SyncReport]:
        """Each optimizer's first elastic round, now (see the module docstring).

        A round in flight restored from a checkpoint (saved with ``sync_delay > 0``) is applied
        first, as the swarm applied it when the checkpoint was written.
        """
        for outer in self.outer_syncs:
            outer.engine.apply_in_flight()
        progress = [
            {name: p.float() - outer.anchors[name].float() for name, p in outer.params.items()}
            for outer in self.outer_syncs
        ]
        self.healed = False
        self._joining = True
        try:
            reports = [outer.round_now() for outer in self.outer_syncs]
        finally:
            self._joining = False
        adopted = self.settle()
        if adopted is not None:
            reports = [adopted]
        if self.healed:
            for outer, own in zip(self.outer_syncs, progress, strict=True):
                for name, param in outer.params.items():
                    param.copy_(outer.anchors[name].float() + own[name])
        return reports

    @torch.no_grad()
    def land_on_anchors(self) -> None:
        """Every parameter <- its anchor: how an elastic fit ends, on every island alike.

        The last committed round merged with ``merge_alpha``; its anchors are the same on every
        island, its mixed parameters are not. Copying the anchors is what merging that round
        with alpha 0 gives (the outer step does not depend on alpha), as the static ``finish``
        does.
        """
        for outer in self.outer_syncs:
            for name, param in outer.params.items():
                param.copy_(outer.anchors[name])


def fragment_shapes(outer: OuterSync) -> list[dict[str, tuple[int, ...]]]:
    """Each fragment's parameter shapes, in fragment order (what a healed island averages)."""
    return [{name: tuple(outer.params[name].shape) for name in names} for names in outer.fragments]
