"""``OuterLoop``: one ``OuterSync`` per optimizer of a fit, the worker, the totals and figures;
``transport_for``: the transport it owns.

Built once per fit without importing lightning. It owns the transport and the ``SyncWorker``,
closed by ``close``, which must run before the process groups are destroyed; its ``OuterSync``s
stay readable after. Parameters stay the module's (a DTensor's local shard), written in place.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_swarm.algorithm.budget import Clock, RoundBudget
from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.algorithm.fragments import build_fragments, check_fragments
from lightning_swarm.algorithm.model_layout import Layout
from lightning_swarm.config import DEFAULT_TIMEOUT_S, SwarmConfig
from lightning_swarm.errors import SwarmConfigError, SwarmError
from lightning_swarm.outer.params import ParameterWatch, trained_params
from lightning_swarm.outer.shard import IslandShard, partition_by_bytes
from lightning_swarm.outer.sync import OUTER_OPTIMIZER_EXAMPLE, OuterSync, default_outer_optimizer
from lightning_swarm.outer.sync_state import OuterOptimizerFactory, StreamingOptions, SyncReport
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.transport import Transport, build_transport, ring_allreduce_bytes
from lightning_swarm.transport.link import LinkTimeouts


def as_outer_optimizer(factory: object) -> OuterOptimizerFactory:
    """``factory`` checked, or DiLoCo's Nesterov SGD for None."""
    if factory is None:
        return default_outer_optimizer
    if not callable(factory):
        raise SwarmConfigError(
            f"outer_optimizer must be a callable returning an optimizer, got "
            f"{type(factory).__name__}; pass e.g. {OUTER_OPTIMIZER_EXAMPLE}."
        )
    check_outer_optimizer(factory, option="outer_optimizer")
    return factory


# The transport a ``SwarmConfig`` asks for, over this rank's peer group; owned by the loop.
def staging_device(root_device: torch.device) -> torch.device:
    """Where transport buckets live: NCCL reduces device tensors only, so under NCCL a bucket
    visits the rank's accelerator (anchors stay put); any other backend stages on the CPU."""
    return root_device if dist.get_backend() == "nccl" else torch.device("cpu")


def transport_for(
    config: SwarmConfig,
    peers: dist.ProcessGroup | None,
    *,
    num_islands: int,
    island_index: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
) -> Transport:
    """The transport ``config`` names, averaging over ``peers``; buckets are staged on
    ``device``; ``island_group`` is given for model-sharded islands only."""
    timeouts = LinkTimeouts("timeout_s", DEFAULT_TIMEOUT_S, config.timeout_s)
    return build_transport(
        config.transport,
        group=peers,
        num_islands=num_islands,
        island_index=island_index,
        device=device,
        codec=codec_for(config.quantize, config.quantize_block_size),
        bucket_numel=config.bucket_numel,
        swarm=config.swarm,
        island_group=island_group,
        timeouts=timeouts,
    )


# How torch's optimizers name a hyper-parameter in their "Invalid ..." messages.
_SPOKEN = {"lr": "learning rate", "eps": "epsilon", "betas": "beta"}


def check_outer_optimizer(factory: OuterOptimizerFactory, *, option: str) -> None:
    """Build the outer optimizer once over a scratch tensor, so a bad hyper-parameter fails
    now, naming ``option.<key>`` (torch would fail at setup, on every rank, naming no option).
    Any other failure is left for setup: a factory may need a process group or a device.

    Raises:
        ValueError: the factory raised ValueError or TypeError; torch's reason is kept.
    """
    try:
        factory([torch.zeros(1, requires_grad=True)])
    except (ValueError, TypeError) as err:
        keywords: dict[str, Any] = dict(getattr(factory, "keywords", None) or {})
        reason = str(err)
        spoken = {k: _SPOKEN.get(k, k) for k in keywords}
        named = [k for k in keywords if spoken[k] in reason.lower() or k in reason]
        named = named or list(keywords)
        given = ", ".join(f"{option}.{k}={keywords[k]!r}" for k in named) or option
        raise SwarmConfigError(
            f"{given} is refused by the outer optimizer: {reason}. Give a value it accepts "
            f"(e.g. {option}.lr=0.7)."
        ) from err
    except Exception:  # see the docstring: setup reports it, with its context
        pass


@dataclass
class SwarmTotals:
    """Running totals of this rank's outer rounds (all optimizers)."""

    outer_steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    sync_wall_s: float = 0.0


class OuterLoop:
    """The outer rounds of every optimizer of one fit.

    Args:
        names: ``id(parameter) -> name`` for the module's parameters (rank-independent names).
        transport: averages pseudo-gradients across islands; owned by the loop from now on.
        island_group: the island's own process group (``None`` for islands of one rank);
            with ``config.shard_outer`` each rank owns a share of the outer state.
        budget_group: the island's group when it has several ranks (``None`` otherwise): under
            ``config.sync_every_s`` its first rank decides when the island joins a round.

    Raises:
        ValueError: a parameter is trained by two optimizers, the fragment layout does not
            fit the trained parameters, or an optimizer has fewer tensors than a sharded
            island has ranks.
    """

    def __init__(
        self,
        optimizers: Sequence[Optimizer],
        names: Mapping[int, str],
        *,
        config: SwarmConfig,
        transport: Transport,
        num_islands: int,
        outer_optimizer: OuterOptimizerFactory = default_outer_optimizer,
        device: torch.device | None = None,
        defer_anchors: bool = False,
        totals: SwarmTotals | None = None,
        island_group: dist.ProcessGroup | None = None,
        island_position: int = 0,
        budget_group: dist.ProcessGroup | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config
        self.transport = transport
        self.num_islands = num_islands
        self.totals = totals if totals is not None else SwarmTotals()
        self._closed = False
        self._worker = SyncWorker(device=device) if config.sync_delay > 0 else None
        self.outer_syncs: list[OuterSync] = []  # one per optimizer training floats, in order
        self._by_optimizer: dict[int, OuterSync] = {}
        self._optimizer_of: dict[int, Optimizer] = {}  # id(OuterSync) -> its inner optimizer
        self._island_group = island_group
        # Islands restarted after a non-finite contribution, this fit.
        self.islands_reset = 0
        seen: set[int] = set()
        # Frozen at setup and left out (frozen_params="exclude"): by name, for the log.
        self.frozen: dict[str, torch.nn.Parameter] = {}
        exclude = self.frozen if config.frozen_params == "exclude" else None
        for index, optimizer in enumerate(optimizers):
            layout: Layout = {}
            params = trained_params(optimizer, names, index, seen, frozen=exclude, layout=layout)
            if not params:
                continue
            streaming = StreamingOptions(
                fragments=build_fragments(
                    list(params), config.num_fragments, config.fragment_layout
                ),
                sync_delay=config.sync_delay,
                merge_alpha=config.merge_alpha,
                codec=codec_for(config.quantize, config.quantize_block_size),
                error_feedback=config.error_feedback,
                worker=self._worker,
            )
            shard = self._shard(index, params, streaming, island_group, island_position, device)
            outer = OuterSync(
                params,
                outer_optimizer=outer_optimizer,
                transport=transport,
                sync_every=config.sync_every,
                anchor_device=config.anchor_device,
                anchor_dtype=config.anchor_torch_dtype,
                defer_anchors=defer_anchors,
                streaming=streaming,
                shard=shard,
                budget=self._budget(clock, budget_group, device),
                layout=layout,
                momentum=config.momentum_schedule,
            )
            self.outer_syncs.append(outer)
            self._by_optimizer[id(optimizer)] = outer
            self._optimizer_of[id(outer)] = optimizer
        self._watch = ParameterWatch(optimizers, self.frozen)
        if config.sync_every_s is not None and len(self.outer_syncs) > 1:
            raise SwarmConfigError(
                f"sync_every_s={config.sync_every_s} runs one round per time budget, but "
                f"{len(self.outer_syncs)} optimizers train parameters here and each would "
                "decide its own round; train with one optimizer, or drop sync_every_s."
            )

    def _shard(
        self,
        index: int,
        params: Mapping[str, torch.nn.Parameter],
        streaming: StreamingOptions,
        group: dist.ProcessGroup | None,
        position: int,
        device: torch.device | None,
    ) -> IslandShard | None:
        if not self.config.shard_outer or group is None:
            return None
        size = dist.get_world_size(group)
        if size == 1:
            return None
        if len(params) < size:
            raise SwarmConfigError(
                f"shard_outer=True splits each optimizer's tensors among the {size} ranks of an "
                f"island, but optimizer {index} trains only {len(params)} tensor(s); set "
                "shard_outer=False (or use a smaller island_size)."
            )
        fragments = check_fragments(streaming.fragments, list(params))
        sizes = {name: p.numel() * p.element_size() for name, p in params.items()}
        owner = partition_by_bytes(fragments, sizes, size)
        return IslandShard(
            group,
            position,
            size,
            owner,
            self.config.bucket_numel,
            device=IslandShard.device_for(group, device),
        )

    def _budget(
        self, clock: Clock, group: dist.ProcessGroup | None, device: torch.device | None
    ) -> RoundBudget | None:
        """The time budget under ``sync_every_s``: the island's first rank decides for all, as
        their clocks differ."""
        seconds = self.config.sync_every_s
        if seconds is None:
            return None
        decision = None
        if group is not None and dist.get_world_size(group) > 1:
            decision = functools.partial(
                _island_first_rank, group=group, device=IslandShard.device_for(group, device)
            )
        return RoundBudget(seconds, clock=clock, island_decision=decision)

    @property
    def swarm_steps(self) -> int | None:
        """Under a time budget: the most inner steps any island had taken at the last round
        (the same on every rank); ``None`` before the first round and without a budget."""
        counts = [o.budget.swarm_steps for o in self.outer_syncs if o.budget is not None]
        known = [c for c in counts if c is not None]
        return max(known) if known else None

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint save: a time budget's clock stops (``RoundBudget.pause``)."""
        paused = [(o.budget, o.inner_steps) for o in self.outer_syncs if o.budget is not None]
        for budget, inner_steps in paused:
            budget.pause(inner_steps)
        try:
            yield
        finally:
            for budget, _ in paused:
                budget.unpause()

    def restart_from_params(self) -> None:
        """Every optimizer's anchors <- its parameters (the end of a warm start)."""
        for outer in self.outer_syncs:
            outer.restart_from_params()

    def set_run_length(self, total_steps: float | None) -> None:
        """The fit's length in inner steps, for the outer momentum schedule (``OuterSync``)."""
        for outer in self.outer_syncs:
            outer.set_run_length(total_steps)

    def cap_budgets(self, max_inner_steps: int) -> None:
        """Under a time budget: no island trains past ``max_inner_steps`` (``RoundBudget``)."""
        for outer in self.outer_syncs:
            if outer.budget is not None:
                outer.budget.max_inner_steps = max_inner_steps

    def continue_budgets(self) -> None:
        """Right before the first inner step: a budget a resume loaded runs from now."""
        for outer in self.outer_syncs:
            if outer.budget is not None:
                outer.budget.continue_now()

    def frozen_summary(self) -> str:
        """One line for the log: the frozen parameters left out of the outer loop."""
        mib = sum(p.numel() * p.element_size() for p in self.frozen.values()) / 2**20
        return (
            f"swarm: {len(self.frozen)} frozen parameter(s) ({mib:.2f} MiB, e.g. "
            f"{list(self.frozen)[:3]}) left out of the outer loop: no anchors, never exchanged "
            "(frozen_params='exclude'; 'sync' keeps them, to unfreeze them mid-run)."
        )

    # -- rounds ---------------------------------------------------------------------------
    def check_optimizer(self, optimizer: Optimizer) -> None:
        """Before an inner step: refuse parameters without anchors that would train."""
        self._watch.check(optimizer)

    def on_inner_step(self, optimizer: Optimizer) -> dict[str, float] | None:
        """Count one inner step of ``optimizer``; the ``swarm/*`` metrics if a round applied."""
        outer = self._by_optimizer.get(id(optimizer))
        if outer is None:
            return None
        report = outer.on_inner_step()
        return None if report is None else self._record(report, outer)

    def _record(self, report: SyncReport, outer: OuterSync) -> dict[str, float]:
        self.totals.outer_steps += int(report.applied)
        self.totals.bytes_sent += report.bytes_sent
        self.totals.bytes_received += report.bytes_received
        self.totals.sync_wall_s += report.wall_s
        index = self.outer_syncs.index(outer)
        suffix = "" if len(self.outer_syncs) == 1 else f"_opt{index}"
        metrics = {
            f"swarm/outer_steps{suffix}": float(report.outer_steps),
            f"swarm/pseudo_grad_norm{suffix}": report.pseudo_grad_norm,
            "swarm/bytes_sent": float(self.totals.bytes_sent),
            "swarm/bytes_received": float(self.totals.bytes_received),
            f"swarm/sync_time_s{suffix}": report.wall_s,
            f"swarm/transport_time_s{suffix}": report.transport_s,
        }
        if report.applied and report.outer_momentum is not None:
            metrics[f"swarm/outer_momentum{suffix}"] = report.outer_momentum
        if self.config.transport == "swarm":
            self._reset_poisoned(report, outer)
            metrics["swarm/islands_reset"] = float(self.islands_reset)
        if self.config.num_fragments > 1:
            metrics[f"swarm/fragment{report.fragment}_rounds{suffix}"] = float(
                report.fragment_rounds
            )
        return metrics

    def _reset_poisoned(self, report: SyncReport, outer: OuterSync) -> None:
        """Count every island rejected for NaN or inf; if any rank of this one was (collective
        over the island), restart it: the anchors got back at the merge, but the inner
        optimizer's state stays NaN, so it is cleared (hyper-parameters kept), as are residuals.
        """
        self.islands_reset += len(report.non_finite_islands)
        # Also after a skipped round: the anchors did not move, and they are still finite.
        flag, group = report.rejected_own, self._island_group
        if group is not None and dist.get_world_size(group) > 1:
            outer.engine.worker_idle()  # another optimizer's exchange may use the group
            value = torch.tensor([int(flag)])
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            flag = bool(value.item())
        if not flag:
            return
        optimizer = self._optimizer_of[id(outer)]
        outer.land_on_anchors()
        outer.residuals = {}
        optimizer.state.clear()
        warnings.warn(
            f"swarm round {report.outer_steps}: this island's pseudo-gradient held NaN or inf "
            "and was left out of the mean; the island restarts from the new anchors with its "
            f"inner optimizer state ({type(optimizer).__name__}) cleared, so it trains again "
            "from the next step. swarm/islands_reset counts these resets; frequent ones mean "
            "the inner learning rate is too high or the data holds bad values.",
            RuntimeWarning,
            stacklevel=2,
        )

    def finish(self, *, exchange: bool = True) -> dict[str, float] | None:
        """The end-of-fit round of every optimizer, in order (``OuterSync.finish``); the
        metrics of the rounds it ran (later rounds' keys win), or None when it ran none."""
        metrics: dict[str, float] = {}
        for outer in self.outer_syncs:
            for report in outer.finish(exchange=exchange):
                metrics.update(self._record(report, outer))
        return metrics or None

    def drain(self) -> None:
        """Wait for every round in flight without applying it."""
        for outer in self.outer_syncs:
            outer.drain()

    def close(self) -> None:
        """Drain and join the worker, then close the transport. Idempotent.

        A round still in flight is dropped (a checkpoint taken before holds it). After a failed
        fit a failed round only warns, not to mask the error that ended the fit.
        """
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            try:
                self.drain()
            except SwarmError as err:  # a SyncWorkerError, or the round's own error
                warnings.warn(
                    f"{err}; the round was dropped at teardown", RuntimeWarning, stacklevel=2
                )
            finally:
                self._worker.close()
                self._worker = None
        self.transport.close()

    # -- figures (the census's ``SwarmMemoryReport``) -------------------------------------
    def memory_key(self) -> tuple[int, int]:
        """Changes whenever anchor or outer-state sizes may have changed (a round applied)."""
        return (len(self.outer_syncs), self.totals.outer_steps)

    def anchor_bytes(self) -> int:
        return sum(o.anchor_bytes for o in self.outer_syncs)

    def outer_state_bytes(self) -> int:
        return sum(o.outer_state_bytes() for o in self.outer_syncs)

    def spool_bytes(self) -> int | None:
        """Bytes the transport holds on disk now, where it spools (``None`` otherwise)."""
        spool_bytes = getattr(self.transport, "spool_bytes", None)
        return int(spool_bytes()) if callable(spool_bytes) else None

    def anchor_spans(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each CPU anchor's storage, once per storage."""
        spans: dict[int, int] = {}
        for outer in self.outer_syncs:
            for anchor in outer.anchors.values():
                if anchor.device.type == "cpu":
                    storage = anchor.untyped_storage()
                    spans[storage.data_ptr()] = storage.nbytes()
        return list(spans.items())

    def ddp_equivalent_bytes(self) -> int:
        """Bytes one rank would have sent across islands had they run DDP instead (a ring
        all-reduce of every trained gradient at every inner step)."""
        total = 0
        for outer in self.outer_syncs:
            grad_bytes = sum(p.numel() * p.element_size() for p in outer.params.values())
            total += ring_allreduce_bytes(grad_bytes, self.num_islands) * outer.inner_steps
        return total


def _island_first_rank(verdict: bool, *, group: dist.ProcessGroup, device: torch.device) -> bool:
    flag = torch.tensor([int(verdict)], device=device)
    dist.broadcast(flag, group=group, group_src=0)
    return bool(flag.item())
