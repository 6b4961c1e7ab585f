"""The outer loop's side of elastic membership: what a joiner receives and how it installs it.

A live island hands a joiner its global state: per optimizer, the anchors, the outer optimizer
state and the counters (inner and outer steps), exactly what ``OuterSync.state_dict`` holds,
without a round in flight (elastic runs have none between rounds).

A heal keeps the island's own progress (``install``): ``local <- anchor_new + (local -
anchor_old)``, also for an island healed in the middle of a run.

A joiner's first round runs at once, outside the inner-step schedule (``join_round``): the live
islands are at their own round; the joiner is healed inside it, contributes nothing, and applies
the same averaged pseudo-gradient, so its anchors equal theirs after that round. Its parameters
then get the catch-up ``local <- global_new + (local - anchor_old)``: a new island, whose
parameters equal its own anchors, lands exactly on the global model; an island resumed from its
own older checkpoint keeps the progress it made since its anchors.

An elastic fit ends on a committed round, the same on every island, with every parameter set to
its anchor (``land_on_anchors``), so that islands end equal whatever ``merge_alpha`` is.

Ownership: ``ElasticOuter`` borrows the outer loop's ``OuterSync`` objects; installed tensors are
adopted by them. The progress kept for the catch-up lives only during ``join_round``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_swarm.outer.reports import SyncReport
from lightning_swarm.outer.sync import OuterSync


class ElasticOuter:
    """Heal hooks and the first round of an elastic island's outer syncs."""

    def __init__(self, outer_syncs: Sequence[OuterSync]) -> None:
        self.outer_syncs = list(outer_syncs)
        self.healed = False

    def state(self) -> dict[str, Any]:
        """The global state a joiner needs, one entry per optimizer (tensors are not copied)."""
        states = []
        for outer in self.outer_syncs:
            state = outer.state_dict()
            if state.pop("pending") is not None:
                raise ValueError("an elastic island cannot hand over a round in flight")
            states.append(state)
        return {"outer": states}

    @torch.no_grad()
    def install(self, state: dict[str, Any]) -> None:
        """Adopt a live island's global state (anchors, outer state, counters), keeping this
        island's own progress since its anchors: ``local <- anchor_new + (local - anchor_old)``.

        A heal in the middle of a run (the island missed a commit) whose round is then abandoned
        would otherwise leave stale weights under the new anchors, and the island's next
        pseudo-gradient would carry the swarm's whole advance since.
        """
        states = state["outer"]
        if len(states) != len(self.outer_syncs):
            raise ValueError(
                f"the swarm trains {len(states)} optimizer(s), this island "
                f"{len(self.outer_syncs)}; start it with the swarm's model and optimizers"
            )
        for outer, saved in zip(self.outer_syncs, states, strict=True):
            own = {n: p.float() - outer.anchors[n].float() for n, p in outer.params.items()}
            outer.load_state_dict({**saved, "pending": None})
            for name, param in outer.params.items():
                param.copy_(outer.anchors[name].float() + own[name])
        self.healed = True

    @torch.no_grad()
    def join_round(self) -> list[SyncReport]:
        """Each optimizer's first elastic round, now (see the module docstring)."""
        progress = [
            {name: p.float() - outer.anchors[name].float() for name, p in outer.params.items()}
            for outer in self.outer_syncs
        ]
        self.healed = False
        reports = [outer.round_now() for outer in self.outer_syncs]
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
