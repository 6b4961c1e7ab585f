"""``SyncState``: what one ``OuterSync``'s rounds read and write, saved as an ``OuterRecord``.

``params`` are the module's, written in place by an applied round; ``anchors`` are owned here
(``owned`` names only, never aliased to a parameter). ``residuals`` are the island's own.
``StreamingOptions`` (never mutated) and ``SyncReport`` (the caller's) hold no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.budget import RoundBudget
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.diloco import keep_state_float32
from lightning_swarm.algorithm.fragments import FragmentSchedule
from lightning_swarm.algorithm.model_layout import Layout, plain_layout
from lightning_swarm.algorithm.outer_optimizer import select_by_name
from lightning_swarm.algorithm.outer_schedule import NO_MOMENTUM_SCHEDULE, MomentumSchedule
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.resume.outer_record import OuterCounters, OuterRecord, PendingRound
from lightning_swarm.transport.base import RoundPlace, RoundStats, Transport

OuterOptimizerFactory = Callable[[Iterable[Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class SyncReport:
    """One applied (or skipped) round as seen by this rank.

    ``wall_s`` is the time the training thread was blocked by the round; ``transport_s`` the
    exchange's own duration, wherever it ran (hidden behind inner steps when ``sync_delay > 0``).
    """

    outer_steps: int
    pseudo_grad_norm: float
    bytes_sent: int
    bytes_received: int
    wall_s: float
    applied: bool
    fragment: int = 0
    fragment_rounds: int = 0
    transport_s: float = 0.0
    # Islands rejected for NaN or inf in this round, and whether this island was one of them.
    non_finite_islands: tuple[int, ...] = ()
    rejected_own: bool = False
    # This island's outer state was installed from a live island's in this round (elastic).
    healed: bool = False
    # The outer optimizer's (first group's) momentum in this round's step; None: it has none.
    outer_momentum: float | None = None


@dataclass
class StreamingOptions:
    """Streaming DiLoCo options of one ``OuterSync`` (defaults: plain DiLoCo).

    ``fragments`` cover every parameter name exactly once (``None``: one fragment);
    ``merge_alpha``: on apply, ``local <- (1 - alpha) * global + alpha * local``; ``codec``: the
    transport's, for error feedback; ``worker`` runs delayed exchanges (``sync_delay > 0``).
    """

    fragments: Sequence[Sequence[str]] | None = None
    sync_delay: int = 0
    merge_alpha: float = 0.0
    codec: Codec | None = None
    error_feedback: bool = False
    worker: SyncWorker | None = field(default=None, compare=False)


@dataclass
class Exchanged:
    """A round's exchange: the transport's stats and the averaged pseudo-gradient's norm (both
    identical on all ranks); the averaged tensors are written into the round's deltas in place."""

    stats: RoundStats
    norm: float
    # True when ``norm`` is already the whole island's (a round restored from a checkpoint).
    combined: bool = False
    # The swarm's round the island took in place of its own (``transport.base.Opening``) and
    # its averaged deltas (a buffer of their own); the own round is dropped.
    adopted: RoundPlace | None = None
    adopted_flat: Tensor | None = None
    adopted_deltas: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def streamed(cls, sumsq: Tensor, sent: int) -> Exchanged:
        """A streamed pass: the norm from its sum of squares, bytes sent (= received)."""
        return cls(RoundStats(bytes_sent=sent, bytes_received=sent), float(sumsq.sqrt().item()))


@dataclass
class RoundInFlight:
    """A fragment's held round between its send and its apply.

    ``deltas`` are float32 pseudo-gradients the exchange overwrites in place with the average;
    until ``future`` resolves they belong to the worker thread.
    """

    fragment: int
    send_step: int
    deltas: dict[str, Tensor]
    flat: Tensor | None = None  # the buffer ``deltas`` are views of (None: restored by name)
    send_blocked_s: float = 0.0
    future: Future[Exchanged] | None = None
    result: Exchanged | None = None
    error: Exception | None = None  # a sharded inline exchange that failed (raised at apply)
    # A state dict holds ``deltas``: the engine must not reuse ``flat`` for a later round.
    exported: bool = False

    def wait(self) -> Exchanged:
        """The exchange's result, waiting for the worker when it is still running."""
        if self.result is None:
            assert self.future is not None
            with record_function(labels.WAIT):
                self.result = SyncWorker.wait(
                    self.future,
                    f"the outer sync of fragment {self.fragment} (sent after inner step "
                    f"{self.send_step})",
                )
            self.future = None
        return self.result


@dataclass(kw_only=True, eq=False, repr=False)
class SyncState:
    """The fields an ``OuterSync`` and its round engine share, and their (de)serialisation
    (identity equality and the default repr: it holds tensors).

    ``owned_fragments``: per fragment, the owned names it contains. ``synced_at``: per fragment,
    the inner step after which its locals last equalled its anchors on every island (None:
    unknown). ``merged_at``: per fragment, the inner step of its last applied round that
    merged with ``alpha != 0`` (the locals then hold a mix; landing them on the anchors at that
    step ends the fragment as a round with alpha 0 would have). ``budget``: the island's time
    budget (``sync_every_s``), replacing ``schedule``.
    """

    params: dict[str, torch.nn.Parameter]
    shard: IslandShard | None
    owned: list[str]
    owned_fragments: list[list[str]]
    fragments: list[list[str]]
    transport: Transport
    schedule: FragmentSchedule
    streaming: StreamingOptions
    anchor_device: torch.device
    anchor_dtype: torch.dtype
    outer_optimizer_factory: OuterOptimizerFactory
    anchors: dict[str, Tensor]
    outer_optimizer: torch.optim.Optimizer
    placeholders: bool  # memory-less anchors awaiting a resume
    layout: Layout  # every parameter's global shape, dtype and this rank's slice of it
    inner_steps: int = 0
    outer_steps: int = 0
    fragment_rounds: list[int] = field(default_factory=list)
    synced_at: list[int | None] = field(default_factory=list)
    ended_at: int | None = None
    merged_at: list[int | None] = field(default_factory=list)
    residuals: dict[str, Tensor] = field(default_factory=dict)
    held: RoundInFlight | None = None  # the round sent and not applied yet
    budget: RoundBudget | None = None
    # The outer momentum schedule, the run's rounds per fragment (None: unknown, constant
    # momentum) and each param group's own momentum as the factory built it.
    momentum: MomentumSchedule = field(default_factory=lambda: NO_MOMENTUM_SCHEDULE)
    total_rounds: int | None = None
    base_momentum: list[float | None] = field(default_factory=list)
    # The first param group's momentum at each fragment's last outer step (what the round
    # reports as ``swarm/outer_momentum``); None where the optimizer has no momentum.
    momentum_used: dict[int, float | None] = field(default_factory=dict)

    def schedule_momentum(self, fragment: int) -> None:
        """Before ``fragment``'s outer step: each SGD group's momentum is its own value times
        the schedule's factor at the fragment's round index, a pure function of counters a
        resume or a heal restores (so the step is the same bits after either). A flat schedule
        leaves the momentum as the optimizer holds it (its own, a checkpoint's or a caller's)."""
        groups = self.outer_optimizer.param_groups
        if not self.momentum.flat:
            factor = self.momentum.factor(self.fragment_rounds[fragment], self.total_rounds)
            for group, base in zip(groups, self.base_momentum, strict=True):
                if base is not None:
                    group["momentum"] = base * factor
        first = groups[0].get("momentum")
        self.momentum_used[fragment] = float(first) if isinstance(first, (int, float)) else None

    # -- the record: what a save holds and a healing peer receives ---------------------------
    def record(self, *, for_peer: bool = False) -> OuterRecord:
        """The global state; tensors are not copied (write it out before the next round).

        For a save, after waiting for the round in flight, which it holds with its averaged
        result, so a resumed run applies it at the same step as an uninterrupted one. For a
        healing peer (``for_peer``): no round in flight, the counters of the round's send and
        the share when sharded; anchors and outer state do not move until that round's apply.
        """
        rnd, pending = self.held, None
        if rnd is not None and not for_peer:
            result = rnd.wait()
            rnd.exported = True
            pending = PendingRound(
                fragment=rnd.fragment,
                send_step=rnd.send_step,
                deltas=dict(rnd.deltas),
                # An adopted round replaced the own one, which is not applied (the adopted
                # round is not saved: a resumed island takes the swarm's next round).
                applied=result.stats.applied and result.adopted is None,
                norm=result.norm,
                bytes_sent=result.stats.bytes_sent,
                bytes_received=result.stats.bytes_received,
                transport_s=result.stats.wall_s,
                share_norm=not result.combined if self.shard is not None else None,
            )
        inner = rnd.send_step if for_peer and rnd is not None else self.inner_steps
        shard = self.shard
        return OuterRecord(
            anchors=dict(self.anchors),
            outer_optimizer=self.outer_optimizer.state_dict(),
            counters=OuterCounters(
                inner_steps=inner,
                outer_steps=self.outer_steps,
                fragment_rounds=list(self.fragment_rounds),
                synced_at=list(self.synced_at),
                ended_at=self.ended_at,
                merged_at=list(self.merged_at),
            ),
            pending=pending,
            # The outer optimizer's state is positional: a re-shard needs the names.
            param_names=list(self.owned) if shard is not None else None,
            share=(self.shard.position, self.shard.size)
            if for_peer and self.shard is not None
            else None,
            layout=None if for_peer else plain_layout({n: self.layout[n] for n in self.owned}),
        )

    def state_dict(self) -> dict[str, Any]:
        """Anchors, outer optimizer state, counters and a round in flight (global state)."""
        return self.record().to_dict()

    def load_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Check a saved state, then install it."""
        record = OuterRecord.of(state)
        self.check_state_dict(record)
        self.load_checked_state_dict(record)

    def peer_offer(self) -> dict[str, Any]:
        """``record(for_peer=True)`` as a dict, built by the engine when it opens a round."""
        return self.record(for_peer=True).to_dict()

    def drain(self) -> None:
        """Wait for a round in flight without applying it (before a save or at teardown)."""
        if self.held is not None:
            self.held.wait()

    def island_state_dict(self) -> dict[str, Any]:
        """This island's own state, after any round in flight: residuals (sharded with feedback:
        collective, complete on the island's first rank, which writes its file) and, under a
        time budget, the budget and the island's own inner-step count."""
        self.drain()
        residuals = dict(self.residuals)
        if self.shard is not None and self.streaming.error_feedback:
            residuals = self.shard.collect(residuals)
        state: dict[str, Any] = {"residuals": residuals}
        if self.budget is not None:
            state["budget"] = {**self.budget.state_dict(), "inner_steps": self.inner_steps}
        return state

    # -- checks, on every rank before anything is installed ----------------------------------
    def check_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Refuse a saved state that cannot be installed as saved.

        Raises:
            SwarmCheckpointError: a parameter has no anchor, or an anchor of another shape; or
                the saved round in flight is not the one this run's schedule expects.
        """
        record = OuterRecord.of(state)
        # A healing peer's share (``peer_offer``) holds the anchors of this rank's names only.
        self.check_anchors(record.anchors, names=None if record.share is None else self.owned)
        step, ended = record.counters.inner_steps, record.counters.ended_at
        # Rounds sent by the end-of-fit round's step were applied by it.
        expected = self.schedule.in_flight(step, sent_after=int(ended or 0)) if step else None
        found = None if record.pending is None else record.pending.fragment
        if found != expected:
            raise SwarmCheckpointError(
                f"the checkpoint has fragment {found} in flight at inner step {step} "
                f"but this run's schedule expects {expected}; resume with the sync_every, "
                "num_fragments and sync_delay the checkpoint was written with."
            )

    def check_anchors(
        self, anchors: Mapping[str, Tensor], names: Iterable[str] | None = None
    ) -> None:
        """Refuse saved anchors unless each of ``names`` (default: every parameter) has one of
        its parameter's shape."""
        for name in self.params if names is None else names:
            p = self.params[name]
            anchor = anchors.get(name)
            if anchor is None or tuple(anchor.shape) != tuple(p.shape):
                found = "no anchor" if anchor is None else f"shape {tuple(anchor.shape)}"
                raise SwarmCheckpointError(
                    f"parameter {name!r} (shape {tuple(p.shape)}) has {found}; the saved "
                    "anchors are damaged or from another model. Resume with the model the "
                    "checkpoint was written by, or from another checkpoint."
                )

    # -- installs ----------------------------------------------------------------------------
    def load_checked_state_dict(self, state: Mapping[str, Any] | OuterRecord) -> None:
        """Install a record that passed ``check_state_dict``.

        Anchors already on the anchor device and dtype are adopted, not copied (memory-mapped
        ones stay file-backed until a round writes them); sharded, only owned names are kept.
        """
        record = OuterRecord.of(state)
        self.anchors = {
            name: record.anchors[name].to(device=self.anchor_device, dtype=self.anchor_dtype)
            for name in self.owned
        }
        self.outer_optimizer = self.outer_optimizer_factory(list(self.anchors.values()))
        optimizer_state = select_by_name(record.outer_optimizer, record.names, self.owned)
        self.outer_optimizer.load_state_dict(optimizer_state)
        keep_state_float32(self.outer_optimizer, optimizer_state)
        self.placeholders = False
        c = record.counters
        self.inner_steps, self.outer_steps, self.ended_at = c.inner_steps, c.outer_steps, c.ended_at
        # Saves older than the end-of-fit round lack these: in sync unknown, fit never ended.
        rounds, synced, merged = c.fragment_rounds, c.synced_at, c.merged_at
        unknown: list[int | None] = [None] * len(self.fragments)
        self.fragment_rounds = [0] * len(self.fragments) if rounds is None else list(rounds)
        self.synced_at = list(unknown) if synced is None else list(synced)
        self.merged_at = list(unknown) if merged is None else list(merged)
        self.held = None
        pending = record.pending
        if pending is not None:
            stats = RoundStats(
                bytes_sent=pending.bytes_sent,
                bytes_received=pending.bytes_received,
                wall_s=pending.transport_s,
                applied=pending.applied,
            )
            owned = set(self.owned)
            deltas = {n: t.to(torch.float32) for n, t in pending.deltas.items() if n in owned}
            result = Exchanged(stats, pending.norm, combined=not pending.share_norm)
            self.held = RoundInFlight(pending.fragment, pending.send_step, deltas, result=result)

    def load_island_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install an ``island_state_dict`` (after ``load_state_dict``): the owned residuals on
        the anchor device; a budgeted island takes back its own inner-step count.

        Raises:
            SwarmCheckpointError: a residual does not fit this model.
        """
        residuals: Mapping[str, Tensor] = state.get("residuals", {})
        for name, residual in residuals.items():
            if name not in self.params or residual.shape != self.params[name].shape:
                raise SwarmCheckpointError(
                    f"saved error-feedback residual {name!r} does not fit this model; resume "
                    "with the model and fragments the checkpoint was written by."
                )
        owned = set(self.owned)
        self.residuals = {
            name: r.to(device=self.anchor_device, dtype=torch.float32)
            for name, r in residuals.items()
            if name in owned
        }
        saved = state.get("budget")
        if self.budget is not None and saved is not None:
            self.budget.load_state_dict(saved)
            self.inner_steps = int(saved["inner_steps"])

    @torch.no_grad()
    def install_heal(self, stats: RoundStats) -> bool:
        """Install the heal a round delivered (a live island's ``peer_offer``) as ``local <-
        anchor_new + (local - anchor_old)``: a heal whose round is then abandoned must not leave
        stale weights under the new anchors. After a heal anywhere in the island, gather its
        parameters and counters (collective when sharded). Returns whether it was healed.

        Raises:
            ValueError: the offer is another share of the outer state than this rank's.
        """
        if stats.heal is not None:
            saved, shard = OuterRecord.of(stats.heal), self.shard
            mine = None if shard is None else (shard.position, shard.size)
            theirs, names = saved.share, saved.names
            if theirs != mine or (shard is not None and list(names) != self.owned):
                raise ValueError(
                    f"a healing peer sent the share {_share_text(theirs)} with {len(names)} "
                    f"tensor(s), but this rank holds the share {_share_text(mine)} with "
                    f"{len(self.owned)}: islands of a swarm must split the outer state alike "
                    "(the same number of ranks per island and shard_outer on every island)."
                )
            own = {n: self.params[n].float() - self.anchors[n].float() for n in self.owned}
            record = replace(saved, counters=replace(saved.counters, inner_steps=0), pending=None)
            self.check_state_dict(record)
            self.load_checked_state_dict(record)
            self.inner_steps = saved.counters.inner_steps
            for name in self.owned:
                self.params[name].copy_(self.anchors[name].float() + own[name])
        if stats.island_healed and self.shard is not None:
            self.shard.gather(list(self.params), self.params)
            self.agree_counters()
        return stats.heal is not None or stats.island_healed

    def agree_counters(self) -> None:
        """Position 0's inner-step counters on every rank of the island (collective): torchft
        may heal each rank from another island, and the shares of one island must count alike,
        as their checkpoint files are merged by them."""
        assert self.shard is not None, "only a sharded island's ranks count apart"
        marks = [*self.synced_at, *self.merged_at, self.ended_at]
        values = [self.inner_steps, *(-1 if v is None else v for v in marks)]
        counters = torch.tensor(values, dtype=torch.int64, device=self.shard.device)
        dist.broadcast(counters, group=self.shard.group, group_src=0)
        inner, *agreed = (None if v < 0 else int(v) for v in counters.tolist())
        n = len(self.synced_at)
        assert inner is not None
        self.inner_steps, self.ended_at = inner, agreed[-1]
        self.synced_at, self.merged_at = agreed[:n], agreed[n : 2 * n]

    def count_applied(self, fragment: int, alpha: float) -> None:
        """An applied round of ``fragment`` merged with ``alpha``: advance the counters."""
        self.outer_steps += 1
        self.fragment_rounds[fragment] += 1
        if alpha == 0.0:
            self.synced_at[fragment] = self.inner_steps
        else:
            self.merged_at[fragment] = self.inner_steps


def _share_text(share: tuple[int, int] | None) -> str:
    return "'whole outer state'" if share is None else f"'position {share[0]} of {share[1]}'"
