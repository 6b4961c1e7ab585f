"""``OuterSync``: the outer state of one inner optimizer's parameters and the schedule of its
rounds, without Lightning: ``on_inner_step`` after every real inner step, a ``SyncReport`` back
when a round applied. Which fragments run depends only on counters equal on every rank, so every
rank runs the same collectives; ``finish`` leaves every island on the anchors, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_swarm.algorithm.budget import RoundBudget
from lightning_swarm.algorithm.fragments import FragmentSchedule, check_fragments
from lightning_swarm.algorithm.model_layout import Layout, model_layout
from lightning_swarm.algorithm.outer_schedule import (
    NO_MOMENTUM_SCHEDULE,
    MomentumSchedule,
    base_momentum,
    total_rounds,
)
from lightning_swarm.errors import SwarmConfigTypeError
from lightning_swarm.outer.round import OuterRound
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.sync_state import (
    OuterOptimizerFactory,
    StreamingOptions,
    SyncReport,
    SyncState,
)
from lightning_swarm.transport.base import Transport

__all__ = ["OuterOptimizerFactory", "OuterSync", "StreamingOptions", "SyncReport"]

# DiLoCo's Nesterov SGD: the default outer optimizer, and the example every refusal gives.
default_outer_optimizer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
OUTER_OPTIMIZER_EXAMPLE = "functools.partial(torch.optim.SGD, {})".format(
    ", ".join(f"{k}={v}" for k, v in default_outer_optimizer.keywords.items())
)


class OuterSync(SyncState):
    """DiLoCo outer state (``SyncState``) and per-fragment rounds for one set of parameters.

    Args:
        params: the trained parameters by name, in a fixed order identical on every rank.
        defer_anchors: build memory-less placeholders that ``load_state_dict`` must replace.
        shard: this rank's share of a sharded island: only the names it owns get anchors,
            outer state and rounds here; ``None`` owns all.
        budget: rounds on a time budget (``sync_every_s``) instead of every ``sync_every``
            steps (``algorithm.budget``); one fragment and no delay.
        layout: ``params``' layout with this rank's slices (``model_layout`` of the module's
            parameters, DTensors included); ``None``: every parameter whole, as given.
        momentum: how the outer SGD momentum ramps over the run's rounds (``MomentumSchedule``;
            the run's length comes later, from ``set_run_length``); ``None``: constant.

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
        layout: Layout | None = None,
        momentum: MomentumSchedule | None = None,
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
        # A resume replaces the anchors: copying the weights first would add the anchor bytes
        # to RAM at a restart's tightest moment, so ``defer_anchors`` builds placeholders.
        placement = "meta" if defer_anchors else device
        anchors = {
            n: params[n].detach().to(device=placement, dtype=anchor_dtype, copy=True) for n in owned
        }
        outer = _build_outer_optimizer(outer_optimizer, anchors)
        self.sync_every = sync_every
        super().__init__(
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
            outer_optimizer=outer,
            placeholders=defer_anchors,
            fragment_rounds=[0] * len(fragments),
            synced_at=[None if defer_anchors else 0] * len(fragments),
            merged_at=[None] * len(fragments),
            budget=budget,
            layout=layout if layout is not None else model_layout(params),
            momentum=NO_MOMENTUM_SCHEDULE if momentum is None else momentum,
            base_momentum=base_momentum(outer),
        )
        self.engine = OuterRound(self)

    @torch.no_grad()
    def restart_from_params(self) -> None:
        """The anchors <- the parameters, before any round: where a warm start hands over
        (its steps left every island on the same weights)."""
        assert self.outer_steps == 0 and self.held is None, "a round ran before the restart"
        for name in self.owned:
            self.anchors[name].copy_(self.params[name].detach())
        self.placeholders = False

    def set_run_length(self, total_steps: float | None) -> None:
        """The fit's length in inner steps (``None`` or inf: unknown), which places each round
        in the momentum schedule. A time budget's rounds fall at no step known in advance:
        its momentum stays constant."""
        steps = None if self.budget is not None else total_steps
        self.total_rounds = total_rounds(steps, self.sync_every)

    @property
    def streams(self) -> bool:
        return self.engine.streams

    @property
    def anchor_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.anchors.values())

    def outer_state_bytes(self) -> int:
        """Bytes held by the outer optimizer's state tensors (e.g. momentum)."""
        states = self.outer_optimizer.state.values()
        tensors = [v for state in states for v in state.values() if isinstance(v, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def in_flight(self) -> int | None:
        """The fragment sent and not applied yet, or None."""
        return self.held.fragment if self.held is not None else None

    # -- the schedule ----------------------------------------------------------------------
    def on_inner_step(self) -> SyncReport | None:
        """Count one inner step; send (or run) the round the schedule names, apply the one due."""
        engine = self.engine
        self.inner_steps += 1
        step = self.inner_steps
        if self.budget is not None:  # one fragment, no delay (``config.check_budget_options``)
            if not self.budget.spent(self.inner_steps):
                return None
            try:  # the next budget starts when the island leaves this round, however it ends
                return engine.round(0)
            finally:
                self.budget.restart(self.inner_steps)
        sending = self.schedule.sends_at(step)
        if sending is not None and engine.streams:
            return engine.round(sending)
        if sending is not None:
            engine.send(sending, inline=self.schedule.sync_delay == 0)
        applying = self.schedule.applies_at(step)
        # A round sent by the end-of-fit round's step was applied by it.
        if applying is None or (
            self.ended_at is not None and step - self.schedule.sync_delay <= self.ended_at
        ):
            return None
        return engine.apply(applying)

    def finish(self, *, exchange: bool = True) -> list[SyncReport]:
        """The end-of-fit round: every island onto the anchors; returns the reports of the
        rounds it ran. Idempotent by the state it reads: a fragment whose locals already hold
        the anchors is left alone, so a second call runs no collective.

        Per fragment: a round that merged with alpha at this very step is finished by landing
        the locals on the anchors (what a merge with alpha 0 would have left, with no
        exchange); a fragment with steps since its last round runs one more round with alpha
        0 after the round in flight is applied. ``exchange=False`` (elastic islands, time
        budgets: islands that may not all be at this step) never runs a round: such a fragment
        lands on its anchors and this island's steps since its last round are dropped.
        """
        reports = []
        exchange = exchange and self.budget is None
        if exchange:
            pending = self._apply_in_flight()
            if pending is not None:
                reports.append(pending)
        for fragment in range(len(self.fragments)):
            step = self.inner_steps
            if self.synced_at[fragment] == step:
                continue
            if exchange and self.merged_at[fragment] != step:
                reports.append(self.engine.round(fragment, merge_alpha=0.0))
            else:
                self.land_on_anchors(fragment)
                self.synced_at[fragment] = step
        self.ended_at = self.inner_steps
        return reports

    def _apply_in_flight(self) -> SyncReport | None:
        return None if self.held is None else self.engine.apply(self.held.fragment)

    @torch.no_grad()
    def join(self) -> SyncReport:
        """An elastic island's first round, now, after applying a round in flight restored from
        a checkpoint. A healed joiner keeps its progress since its old anchors on the new ones.
        """
        self._apply_in_flight()
        own = {n: self.params[n].float() - self.anchors[n].float() for n in self.owned}
        report = self.engine.round(0)  # no round in flight now
        if report.healed:
            for name in self.owned:
                self.params[name].copy_(self.anchors[name].float() + own[name])
            if self.shard is not None:
                self.shard.gather(list(self.params), self.params)
                self.agree_counters()
        return report

    @torch.no_grad()
    def land_on_anchors(self, fragment: int | None = None) -> None:
        """The parameters of ``fragment`` (default: all) <- their anchors (sharded: collective
        over the island)."""
        fragments = range(len(self.fragments)) if fragment is None else [fragment]
        for f in fragments:
            for name in self.owned_fragments[f]:
                self.params[name].copy_(self.anchors[name])
            if self.shard is not None:
                self.shard.gather(self.fragments[f], self.params)


def _build_outer_optimizer(
    factory: OuterOptimizerFactory, anchors: dict[str, Tensor]
) -> torch.optim.Optimizer:
    optimizer = factory(list(anchors.values()))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SwarmConfigTypeError(
            "outer_optimizer must return a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass e.g. {OUTER_OPTIMIZER_EXAMPLE}."
        )
    return optimizer
