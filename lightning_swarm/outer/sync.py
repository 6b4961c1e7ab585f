"""The outer state of one inner optimizer's parameters, and the coordinator of its rounds.

``OuterSync`` ties the DiLoCo math (``lightning_swarm.algorithm``) to a ``Transport``. It knows
nothing of Lightning: the ``OuterLoop`` calls ``on_inner_step`` after every real inner optimizer
step and gets a ``SyncReport`` back when a round was applied.

Rounds (Streaming DiLoCo, arXiv 2501.18512). The parameters are split into fragments, each
syncing on a ``FragmentSchedule``; one fragment, no delay and no codec is plain DiLoCo,
operation for operation. Each due round takes one of two forms, bitwise equal where both apply:
- the streamed round (the default, ``lightning_swarm.outer.bucketed``): one bucketed pass that
  forms, averages, steps and merges the fragment's tensors bucket by bucket, with no full-size
  temporary. It runs when the transport offers a bucket mean (all-reduce), ``sync_delay == 0``,
  the outer optimizer has a functional step (SGD, Adam, AdamW), the anchors are installed and
  every anchor and parameter is contiguous (checked per round: a resume may change them).
- the two-phase round (``lightning_swarm.outer.two_phase``) otherwise: a send after step ``s``
  and an apply after step ``s + sync_delay``, the exchange in the ``SyncWorker`` thread while
  training continues when the delay is positive; also every round with ``stream=False``.

The end of fit (``finish``). Between rounds every island holds its own local weights. ``finish``
applies a round in flight early, then runs one inline round of every fragment whose locals
may differ from its anchors (steps since its last applied round, or a merge with
``merge_alpha > 0``), merging with alpha 0: afterwards every island holds the anchors, bit for
bit (unless the transport skipped that round). Which fragments run depends only on counters
that are identical everywhere, so every rank runs the same collectives. ``ended_at`` records the
step, so a round the schedule would still apply later (training went on, or a resume from a
checkpoint written after ``finish``) is not applied twice.

Ownership and lifetime:
- Sharded (``shard``, ``lightning_swarm.outer.shard``): only the ``owned`` names have anchors,
  outer state, pseudo-gradients and residuals here; ``params`` and ``fragments`` still name
  every trained parameter, and after each applied round the owners gather the new
  parameters to the whole island. Counters are island-wide (the shares agree every round).
- ``anchors`` are owned here: one tensor per trained parameter, on ``anchor_device`` in
  ``anchor_dtype``, created as a copy of the parameters at construction time. They are never
  aliased to the model's parameters, and always hold the pure global model (no alpha mixing).
- The outer optimizer is built over all anchors and owns its state (e.g. Nesterov momentum),
  which therefore lives on the anchor device too.
- ``residuals`` (error feedback) are per-island state, like the inner optimizer's; the anchors,
  outer state, counters and an in-flight round's averaged result are global (``state.py``).
- ``params`` are the model's live parameters, owned by the LightningModule; an apply overwrites
  (or mixes into) them in place.
- The streamed round's reused buffers (``BucketedRound``) live as long as this object.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm import merge_into_local
from lightning_swarm.algorithm.fragments import FragmentSchedule, check_fragments
from lightning_swarm.algorithm.outer_fast import FastKind, fast_outer_kind
from lightning_swarm.outer.bucketed import BucketedResult, BucketedRound, BucketMean
from lightning_swarm.outer.checkpoint_state import SyncState
from lightning_swarm.outer.reports import OuterOptimizerFactory, StreamingOptions, SyncReport
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.staging import CudaStaging, pin_round_memory
from lightning_swarm.transport.base import Transport

__all__ = ["OuterOptimizerFactory", "OuterSync", "StreamingOptions", "SyncReport"]


class OuterSync(SyncState):
    """DiLoCo outer state and per-fragment rounds for one set of parameters.

    Args:
        params: the trained parameters by name, in a fixed order identical on every rank.
        outer_optimizer: factory called once with the anchors.
        transport: averages pseudo-gradients across islands.
        sync_every: inner steps between two rounds of the same fragment.
        anchor_device: device for anchors and outer optimizer state.
        anchor_dtype: dtype of the stored anchors.
        defer_anchors: build memory-less placeholders that ``load_state_dict`` must replace.
        streaming: fragments, delay, merge and error feedback (``Streaming``).
        stream: run eligible rounds as one bucketed pass (``lightning_swarm.outer.bucketed``):
            a transport with a bucket mean (all-reduce), no sync delay, outer SGD or Adam(W).
            ``False`` keeps the two-phase round for every round (same bits, slower).
        shard: this rank's share of a sharded island (``lightning_swarm.outer.shard``): only
            the names it owns get anchors, outer state and rounds here; ``None`` owns all.

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
        stream: bool = True,
        shard: IslandShard | None = None,
    ) -> None:
        self.params = dict(params)
        self.shard = shard
        self.owned = [n for n in self.params if shard is None or shard.owns(n)]
        self.transport = transport
        self.sync_every = sync_every
        self.anchor_device = torch.device(anchor_device)
        self.anchor_dtype = anchor_dtype
        self._outer_optimizer_factory = outer_optimizer
        self.streaming = streaming or StreamingOptions()
        self.fragments = check_fragments(self.streaming.fragments, list(self.params))
        self.schedule = self._build_schedule()
        owned = set(self.owned)
        # Each fragment's names this rank computes, exchanges and steps (all of them unsharded).
        self._owned_fragments = [[n for n in names if n in owned] for names in self.fragments]
        self._placeholders = defer_anchors
        self.anchors = self._build_anchors("meta" if defer_anchors else anchor_device)
        self.outer_optimizer = self._build_outer_optimizer()
        self.inner_steps = 0
        self.outer_steps = 0
        self.fragment_rounds = [0] * len(self.fragments)
        # Per fragment: the inner step after which its locals last equalled its anchors on
        # every island (None: unknown, e.g. placeholders awaiting a resume).
        self.synced_at = [None if defer_anchors else 0] * len(self.fragments)
        self.ended_at = None
        self.residuals = {}
        self._in_flight = None
        self._stream = self._build_stream(stream)

    def reset_to_anchors(self) -> None:
        """Every parameter becomes its anchor again; error-feedback residuals are dropped.

        For an island whose state went non-finite (``outer.reset``). Sharded, each rank writes
        its own names and the island gathers the rest (collective over the island).
        """
        with torch.no_grad():
            for name in self.owned:
                merge_into_local(self.params[name].data, self.anchors[name], 0.0)
        self.residuals = {}
        if self.shard is not None:
            self.shard.gather(list(self.params), self.params)

    def _build_schedule(self) -> FragmentSchedule:
        schedule = FragmentSchedule(
            sync_every=self.sync_every,
            num_fragments=len(self.fragments),
            sync_delay=self.streaming.sync_delay,
            merge_alpha=self.streaming.merge_alpha,
        )
        if schedule.sync_delay > 0 and self.streaming.worker is None:
            raise ValueError("sync_delay > 0 needs a SyncWorker to run the delayed exchanges")
        return schedule

    @torch.no_grad()
    def _build_anchors(self, placement: torch.device | str) -> dict[str, Tensor]:
        """A copy of each owned parameter, or memory-less placeholders (``placement="meta"``).

        A resume replaces the anchors right after setup: copying the weights first would add
        the full anchor bytes to RAM at the tightest moment of a restart, so ``defer_anchors``
        builds placeholders that ``load_state_dict`` must replace; a round on placeholders
        raises (``_send``) instead of training on half-loaded state.
        """
        return {
            name: self.params[name]
            .detach()
            .to(device=placement, dtype=self.anchor_dtype, copy=True)
            for name in self.owned
        }

    def _build_outer_optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._outer_optimizer_factory(list(self.anchors.values()))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "outer_optimizer must return a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; pass e.g. "
                "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)."
            )
        return optimizer

    def _build_stream(self, stream: bool) -> BucketedRound | None:
        """The bucketed one-pass round where this transport and schedule allow it."""
        if stream and isinstance(self.transport, BucketMean) and self.schedule.sync_delay == 0:
            return BucketedRound(self.transport.bucket_numel, staging=CudaStaging())
        return None

    @property
    def anchor_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.anchors.values())

    def outer_state_bytes(self) -> int:
        """Bytes held by the outer optimizer's state tensors (e.g. momentum)."""
        total = 0
        for state in self.outer_optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    total += value.numel() * value.element_size()
        return total

    @property
    def in_flight(self) -> int | None:
        """The fragment sent and not applied yet, or None."""
        return self._in_flight.fragment if self._in_flight is not None else None

    def on_inner_step(self) -> SyncReport | None:
        """Count one inner step; send and/or apply the fragment the schedule names."""
        self.inner_steps += 1
        step = self.inner_steps
        sending = self.schedule.sends_at(step)
        kind = self._stream_kind()
        if sending is not None and kind is not None:
            return self._stream_round(sending, kind)
        if sending is not None:
            self._send(sending, inline=self.schedule.sync_delay == 0)
        applying = self.schedule.applies_at(step)
        if applying is None or self._applied_by_finish(step - self.schedule.sync_delay):
            return None
        return self._apply(applying)

    def _applied_by_finish(self, send_step: int) -> bool:
        return self.ended_at is not None and send_step <= self.ended_at

    def finish(self) -> list[SyncReport]:
        """The end-of-fit round: every island ends holding the anchors (see module docstring).

        Returns the reports of the rounds it ran (none when every fragment is in sync).
        """
        reports = []
        if self._in_flight is not None:
            reports.append(self._apply(self._in_flight.fragment))
        for fragment in range(len(self.fragments)):
            if self.synced_at[fragment] == self.inner_steps:
                continue
            kind = self._stream_kind()
            if kind is not None:
                reports.append(self._stream_round(fragment, kind, merge_alpha=0.0))
            else:
                self._send(fragment, inline=True)
                reports.append(self._apply(fragment, merge_alpha=0.0))
        self.ended_at = self.inner_steps
        return reports

    def round_now(self) -> SyncReport:
        """One round now, outside the inner-step schedule: an elastic island's first round.

        Raises:
            ValueError: with several fragments or a round in flight (elastic runs have neither).
        """
        if len(self.fragments) != 1 or self._in_flight is not None:
            raise ValueError("a round outside the schedule needs one fragment and none in flight")
        self._send(0, inline=True)
        return self._apply(0)

    def _stream_kind(self) -> FastKind | None:
        """The functional outer step a streamed round would use now, or None for the old path.

        Checked per round: a resume rebuilds the optimizer and may install other anchors.
        """
        if self._stream is None:
            return None
        if self._placeholders:  # the two-phase round raises the clear error
            return None
        if any(not a.is_contiguous() for a in self.anchors.values()):
            return None
        if any(not p.is_contiguous() for p in self.params.values()):
            return None
        return fast_outer_kind(self.outer_optimizer)

    @torch.no_grad()
    def _stream_round(
        self, fragment: int, kind: FastKind, *, merge_alpha: float | None = None
    ) -> SyncReport:
        """Fragment ``fragment``'s whole round (delay 0) in one bucketed pass over its tensors.

        ``merge_alpha`` overrides the schedule's, as in ``_apply``.
        """
        assert self._stream is not None and self._in_flight is None
        alpha = self.schedule.merge_alpha if merge_alpha is None else merge_alpha
        start = time.perf_counter()
        result = BucketedResult(0.0, 0)  # a share with no tensors in this fragment
        error: BaseException | None = None
        try:
            result = self._run_stream(self._owned_fragments[fragment], kind, alpha)
        except Exception as err:
            if self.shard is None:
                raise
            error = err
        norm = result.norm
        if self.shard is not None:
            _, norm = self.shard.agree(True, result.norm, error)
            self.shard.gather(self.fragments[fragment], self.params)
        self.outer_steps += 1
        self.fragment_rounds[fragment] += 1
        if alpha == 0.0:
            self.synced_at[fragment] = self.inner_steps
        return SyncReport(
            outer_steps=self.outer_steps,
            pseudo_grad_norm=norm,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_sent,
            wall_s=time.perf_counter() - start,
            applied=True,
            fragment=fragment,
            fragment_rounds=self.fragment_rounds[fragment],
            transport_s=result.reduce_s,
        )

    def _run_stream(self, names: list[str], kind: FastKind, alpha: float) -> BucketedResult:
        """The streamed pass over ``names`` (this rank's share of the fragment)."""
        assert self._stream is not None
        result = BucketedResult(0.0, 0)
        on_cuda = bool(names) and self.params[names[0]].device.type == "cuda"
        if on_cuda and self.anchor_device.type == "cpu":
            pin_round_memory(self.outer_optimizer, self.anchors)
        assert isinstance(self.transport, BucketMean)
        if names:
            with record_function(labels.BUCKETED_ROUND):
                result = self._stream.run(
                    params=[self.params[name] for name in names],
                    anchors=[self.anchors[name] for name in names],
                    optimizer=self.outer_optimizer,
                    kind=kind,
                    reducer=self.transport,
                    merge_alpha=alpha,
                    seed=self.outer_steps,  # the same on every island: bf16 noise agrees
                )
        return result
