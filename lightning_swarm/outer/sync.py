"""``OuterSync``: the outer state of one inner optimizer's parameters and the schedule of its
rounds, without Lightning: ``on_inner_step`` after every real inner step, a ``SyncReport`` back
when a round applied. Which fragments run depends only on counters equal on every rank, so every
rank runs the same collectives; ``finish`` leaves every island on the anchors, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.budget import RoundBudget
from lightning_swarm.algorithm.fragments import FragmentSchedule, check_fragments
from lightning_swarm.errors import SwarmConfigTypeError
from lightning_swarm.outer.round import OuterRound
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.sync_state import (
    OuterOptimizerFactory,
    StreamingOptions,
    SyncReport,
    SyncState,
)
from lightning_swarm.resume.outer_record import OuterRecord
from lightning_swarm.transport.base import Transport

__all__ = ["OuterOptimizerFactory", "OuterSync", "StreamingOptions", "SyncReport"]


class OuterSync:
    """DiLoCo outer state and per-fragment rounds for one set of parameters.

    Args:
        params: the trained parameters by name, in a fixed order identical on every rank.
        defer_anchors: build memory-less placeholders that ``load_state_dict`` must replace.
        shard: this rank's share of a sharded island: only the names it owns get anchors,
            outer state and rounds here; ``None`` owns all.
        budget: rounds on a time budget (``sync_every_s``) instead of every ``sync_every``
            steps (``algorithm.budget``); one fragment and no delay.

    Raises:
        ValueError: the fragments do not cover the parameters exactly once, the schedule is
            invalid, or ``sync_delay > 0`` without a worker.
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        *,
        outer_optimizer: OuterOptimizerFactory,
        transport: Transport,
        sync_every: int,
        anchor_device: torch.device | str = "cpu",
        anchor_dtype: torch.dtype = torch.float32,
        defer_anchors: bool = False,
        streaming: StreamingOptions | None = None,
        shard: IslandShard | None = None,
        budget: RoundBudget | None = None,
    ) -> None:
        params = dict(params)
        streaming = streaming or StreamingOptions()
        fragments = check_fragments(streaming.fragments, list(params))
        schedule = FragmentSchedule(
            sync_every=sync_every,
            num_fragments=len(fragments),
            sync_delay=streaming.sync_delay,
            merge_alpha=streaming.merge_alpha,
        )
        if schedule.sync_delay > 0 and streaming.worker is None:
            raise ValueError("sync_delay > 0 needs a SyncWorker to run the delayed exchanges")
        if budget is not None and (len(fragments) > 1 or schedule.sync_delay > 0):
            raise ValueError(
                "a time budget (sync_every_s) runs whole-model rounds without delay; use one "
                "fragment and sync_delay=0 with it."
            )
        owned = [n for n in params if shard is None or shard.owns(n)]
        owned_set = set(owned)
        device = torch.device(anchor_device)
        anchors = _build_anchors(params, owned, "meta" if defer_anchors else device, anchor_dtype)
        self.sync_every = sync_every
        self.state = SyncState(
            params=params,
            shard=shard,
            owned=owned,
            # Each fragment's names this rank computes, exchanges and steps (all, unsharded).
            owned_fragments=[[n for n in names if n in owned_set] for names in fragments],
            fragments=fragments,
            transport=transport,
            schedule=schedule,
            streaming=streaming,
            anchor_device=device,
            anchor_dtype=anchor_dtype,
            outer_optimizer_factory=outer_optimizer,
            anchors=anchors,
            outer_optimizer=_build_outer_optimizer(outer_optimizer, anchors),
            placeholders=defer_anchors,
            fragment_rounds=[0] * len(fragments),
            synced_at=[None if defer_anchors else 0] * len(fragments),
            budget=budget,
        )
        self.engine = OuterRound(self.state)

    @property
    def streams(self) -> bool:
        return self.engine.streams

    # -- the state, read-only views for the loop, the resume layer and tests ---------------
    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        return self.state.params

    @property
    def anchors(self) -> dict[str, Tensor]:
        return self.state.anchors

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.state.outer_optimizer

    @property
    def anchor_dtype(self) -> torch.dtype:
        return self.state.anchor_dtype

    @property
    def fragments(self) -> list[list[str]]:
        return self.state.fragments

    @property
    def schedule(self) -> FragmentSchedule:
        return self.state.schedule

    @property
    def shard(self) -> IslandShard | None:
        return self.state.shard

    @property
    def owned(self) -> list[str]:
        return self.state.owned

    @property
    def residuals(self) -> dict[str, Tensor]:
        return self.state.residuals

    @property
    def inner_steps(self) -> int:
        return self.state.inner_steps

    @property
    def outer_steps(self) -> int:
        return self.state.outer_steps

    @property
    def fragment_rounds(self) -> list[int]:
        return self.state.fragment_rounds

    @property
    def anchor_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.state.anchors.values())

    def outer_state_bytes(self) -> int:
        """Bytes held by the outer optimizer's state tensors (e.g. momentum)."""
        states = self.state.outer_optimizer.state.values()
        tensors = [v for state in states for v in state.values() if isinstance(v, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def in_flight(self) -> int | None:
        """The fragment sent and not applied yet, or None."""
        rnd = self.state.in_flight
        return rnd.fragment if rnd is not None else None

    # -- the schedule ----------------------------------------------------------------------
    def on_inner_step(self) -> SyncReport | None:
        """Count one inner step; send (or run) the round the schedule names, apply the one due."""
        s, engine = self.state, self.engine
        s.inner_steps += 1
        step = s.inner_steps
        if s.budget is not None:  # one fragment, no delay (``config.check_budget_options``)
            if not s.budget.spent():
                return None
            try:  # the next budget starts when the island leaves this round, however it ends
                return engine.round(0)
            finally:
                s.budget.restart(s.inner_steps)
        sending = s.schedule.sends_at(step)
        if sending is not None and engine.streams:
            return engine.round(sending)
        if sending is not None:
            engine.send(sending, inline=s.schedule.sync_delay == 0)
        applying = s.schedule.applies_at(step)
        # A round sent by the end-of-fit round's step was applied by it.
        if applying is None or (
            s.ended_at is not None and step - s.schedule.sync_delay <= s.ended_at
        ):
            return None
        return engine.apply(applying)

    def finish(self) -> list[SyncReport]:
        """The end-of-fit round: the round in flight, then every fragment out of sync merged
        with alpha 0; returns their reports. ``ended_at`` keeps a round from applying twice."""
        s = self.state
        reports = []
        pending = self._apply_in_flight()
        if pending is not None:
            reports.append(pending)
        for fragment in range(len(s.fragments)):
            # Under a time budget islands count different steps: a budgeted fit ends right
            # after a round, where islands differ from the anchors only if it merged with alpha.
            if s.budget is not None:
                out_of_sync = s.schedule.merge_alpha != 0
            else:
                out_of_sync = s.synced_at[fragment] != s.inner_steps
            if out_of_sync:
                reports.append(self.engine.round(fragment, merge_alpha=0.0))
        s.ended_at = s.inner_steps
        return reports

    def _apply_in_flight(self) -> SyncReport | None:
        rnd = self.state.in_flight
        return None if rnd is None else self.engine.apply(rnd.fragment)

    def round_now(self, fragment: int = 0) -> SyncReport:
        """One round of ``fragment`` now, outside the inner-step schedule.

        Raises:
            ValueError: with a round in flight.
        """
        if self.state.in_flight is not None:
            raise ValueError("a round outside the schedule needs none in flight")
        return self.engine.round(fragment)

    @torch.no_grad()
    def join(self) -> SyncReport:
        """An elastic island's first round, now, after applying a round in flight restored from
        a checkpoint. A healed joiner keeps its progress since its old anchors on the new ones.
        """
        self._apply_in_flight()
        s = self.state
        own = {n: s.params[n].float() - s.anchors[n].float() for n in s.owned}
        report = self.round_now()
        if report.healed:
            for name in s.owned:
                s.params[name].copy_(s.anchors[name].float() + own[name])
            if s.shard is not None:
                s.shard.gather(list(s.params), s.params)
                s.agree_counters()
        return report

    @torch.no_grad()
    def land_on_anchors(self) -> None:
        """Every parameter <- its anchor (sharded: collective over the island): how an elastic
        fit ends, on every island alike, as ``finish`` merges with alpha 0."""
        s = self.state
        for name in s.owned:
            s.params[name].copy_(s.anchors[name])
        if s.shard is not None:
            s.shard.gather(list(s.params), s.params)

    def drain(self) -> None:
        """Wait for a round in flight without applying it (before a save or at teardown)."""
        if self.state.in_flight is not None:
            self.state.in_flight.wait()

    # -- the outer state record (``SyncState`` builds, checks and installs it) ---------------
    def record(self) -> OuterRecord:
        """The global state for a save, holding the round in flight (``SyncState.record``)."""
        return self.state.record()

    def state_dict(self) -> dict[str, Any]:
        """Anchors, outer optimizer state, counters and a round in flight (global state)."""
        return self.record().to_dict()

    @property
    def budget(self) -> RoundBudget | None:
        return self.state.budget

    def island_state_dict(self) -> dict[str, Any]:
        """This island's own state: residuals and, under a time budget, the budget and its own
        inner-step count; after any round in flight; collective when sharded with feedback."""
        self.drain()
        state: dict[str, Any] = {"residuals": self.state.island_residuals()}
        budget = self.state.budget
        if budget is not None:
            state["budget"] = {**budget.state_dict(), "inner_steps": self.state.inner_steps}
        return state

    def load_island_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install an ``island_state_dict`` (after ``load_state_dict``)."""
        self.state.install_residuals(state)
        budget, saved = self.state.budget, state.get("budget")
        if budget is not None and saved is not None:
            budget.load_state_dict(saved)
            self.state.inner_steps = int(saved["inner_steps"])

    def check_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Refuse a saved state this sync cannot install (``SyncState.check_state_dict``)."""
        self.state.check_state_dict(state)

    def check_anchors(self, anchors: Mapping[str, Tensor]) -> None:
        """Refuse saved anchors unless every parameter has one of its shape."""
        self.state.check_anchors(anchors, names=self.params)

    def load_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Check a saved state, then install it."""
        record = OuterRecord.of(state)
        self.state.check_state_dict(record)
        self.state.install(record)

    def load_checked_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Install a state that passed ``check_state_dict``."""
        self.state.install(state)


@torch.no_grad()
def _build_anchors(
    params: Mapping[str, torch.nn.Parameter],
    owned: list[str],
    placement: torch.device | str,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """A copy of each owned parameter, or memory-less placeholders (``placement="meta"``):
    copying the weights a resume replaces would add the anchor bytes to RAM at a restart's
    tightest moment; a round on placeholders raises instead of training on them."""
    return {
        name: params[name].detach().to(device=placement, dtype=dtype, copy=True) for name in owned
    }


def _build_outer_optimizer(
    factory: OuterOptimizerFactory, anchors: dict[str, Tensor]
) -> torch.optim.Optimizer:
    optimizer = factory(list(anchors.values()))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SwarmConfigTypeError(
            "outer_optimizer must return a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass e.g. "
            "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)."
        )
    return optimizer
