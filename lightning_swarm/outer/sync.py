"""The outer state of one inner optimizer's parameters: anchors, outer optimizer, fragment rounds.

``OuterSync`` ties the DiLoCo math (``lightning_swarm.algorithm``) to a ``Transport``. It knows
nothing of Lightning: the ``OuterLoop`` calls ``on_inner_step`` after every real inner optimizer
step and gets a ``SyncReport`` back when a round was applied.

Rounds (Streaming DiLoCo, arXiv 2501.18512). The parameters are split into fragments, each
syncing on a ``FragmentSchedule``. After inner step ``s`` where fragment ``f`` is due, ``_send``
computes its pseudo-gradients and starts the exchange (error feedback, then
``transport.average``); after step ``s + sync_delay``, ``_apply`` waits for the result, steps the
outer optimizer on fragment ``f``'s anchors only (the other anchors have no gradient, so SGD and
Adam skip them) and merges the new anchors into the locals with ``merge_alpha``. With
``sync_delay == 0`` the exchange runs inline; otherwise in the ``SyncWorker`` thread while
training continues. One fragment, no delay and no codec is plain DiLoCo, operation for operation.

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
- Pseudo-gradients exist only while a round is in flight (at most one: the schedule guarantees
  fragment f has applied before fragment f + 1 sends). Until the worker's future resolves, the
  round's tensors and the fragment's error-feedback residuals belong to the worker.
- ``residuals`` (error feedback) are per-island state, like the inner optimizer's; the anchors,
  outer state, counters and an in-flight round's averaged result are global.
- ``params`` are the model's live parameters, owned by the LightningModule; an apply overwrites
  (or mixes into) them in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from lightning_swarm.algorithm import global_norm, merge_into_local, outer_step, pseudo_gradient
from lightning_swarm.algorithm.codecs import Codec, with_error_feedback
from lightning_swarm.algorithm.fragments import FragmentSchedule, check_fragments
from lightning_swarm.algorithm.optimizer_state import select_by_name
from lightning_swarm.algorithm.outer_fast import FastKind, fast_outer_kind
from lightning_swarm.algorithm.precision import keep_state_float32
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.outer.stream import BucketMean, StreamResult, StreamRound, pin_round_memory
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.transport.base import RoundStats, Transport

OuterOptimizerFactory = Callable[[Iterable[Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class SyncReport:
    """One applied (or skipped) round as seen by this rank.

    ``wall_s`` is the time the training thread was blocked by the round: computing the
    pseudo-gradients at the send, the exchange itself when it ran inline, waiting for the worker
    and the outer step and merge at the apply. ``transport_s`` is the exchange's own duration,
    wherever it ran (hidden behind inner steps when ``sync_delay > 0``).
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


@dataclass
class _Exchanged:
    """What an exchange reported: the transport's round stats and the averaged
    pseudo-gradient's norm (both identical on all ranks). The averaged tensors themselves are
    written into the round's ``deltas`` in place."""

    stats: RoundStats
    norm: float
    # True when ``norm`` is already the whole island's (a round restored from a checkpoint).
    combined: bool = False


@dataclass
class _Round:
    """A fragment's round between its send and its apply."""

    fragment: int
    send_step: int
    deltas: dict[str, Tensor]
    send_blocked_s: float = 0.0
    future: Future[_Exchanged] | None = None
    result: _Exchanged | None = None
    error: Exception | None = None  # a sharded inline exchange that failed (raised at apply)


@dataclass
class Streaming:
    """Streaming DiLoCo options of one ``OuterSync`` (defaults: plain DiLoCo).

    Attributes:
        fragments: lists of parameter names, together covering every parameter exactly once;
            ``None`` = one fragment of all parameters.
        sync_delay: tau, inner steps between a fragment's send and its apply.
        merge_alpha: on apply, ``local <- (1 - alpha) * global + alpha * local``.
        codec: the transport's codec, needed for error feedback; ``None`` = no feedback.
        error_feedback: keep each parameter's quantization error for its next round.
        worker: runs delayed exchanges; required when ``sync_delay > 0``.
    """

    fragments: Sequence[Sequence[str]] | None = None
    sync_delay: int = 0
    merge_alpha: float = 0.0
    codec: Codec | None = None
    error_feedback: bool = False
    worker: SyncWorker | None = field(default=None, compare=False)


class OuterSync:
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
        stream: run eligible rounds as one bucketed pass (``lightning_swarm.outer.stream``):
            a transport with a bucket mean (all-reduce), no sync delay, outer SGD or Adam(W).
            ``False`` keeps the two-phase round below for every round (same bits, slower).
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
        streaming: Streaming | None = None,
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
        self.streaming = streaming or Streaming()
        self.fragments = check_fragments(self.streaming.fragments, list(self.params))
        self.schedule = FragmentSchedule(
            sync_every=sync_every,
            num_fragments=len(self.fragments),
            sync_delay=self.streaming.sync_delay,
            merge_alpha=self.streaming.merge_alpha,
        )
        if self.schedule.sync_delay > 0 and self.streaming.worker is None:
            raise ValueError("sync_delay > 0 needs a SyncWorker to run the delayed exchanges")
        owned = set(self.owned)
        # Each fragment's names this rank computes, exchanges and steps (all of them unsharded).
        self._owned_fragments = [[n for n in names if n in owned] for names in self.fragments]
        # A resume replaces the anchors right after setup: copying the weights first would add
        # the full anchor bytes to RAM at the tightest moment of a restart, so ``defer_anchors``
        # builds memory-less placeholders (meta device) that ``load_state_dict`` must replace;
        # a round on placeholders raises (``_send``) instead of training on half-loaded state.
        self._placeholders = defer_anchors
        placement = "meta" if defer_anchors else anchor_device
        with torch.no_grad():
            self.anchors: dict[str, Tensor] = {
                name: self.params[name].detach().to(device=placement, dtype=anchor_dtype, copy=True)
                for name in self.owned
            }
        self.outer_optimizer = outer_optimizer(list(self.anchors.values()))
        if not isinstance(self.outer_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "outer_optimizer must return a torch.optim.Optimizer, got "
                f"{type(self.outer_optimizer).__name__}; pass e.g. "
                "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)."
            )
        self.inner_steps = 0
        self.outer_steps = 0
        self.fragment_rounds = [0] * len(self.fragments)
        # Per fragment: the inner step after which its locals last equalled its anchors on
        # every island (None: unknown, e.g. placeholders awaiting a resume).
        self.synced_at: list[int | None] = [None if defer_anchors else 0] * len(self.fragments)
        self.ended_at: int | None = None
        self.residuals: dict[str, Tensor] = {}
        self._in_flight: _Round | None = None
        # The bucketed one-pass round; its buffers live as long as this object.
        self._stream = (
            StreamRound(self.transport.bucket_numel)
            if stream and isinstance(self.transport, BucketMean) and self.schedule.sync_delay == 0
            else None
        )

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
        names = self._owned_fragments[fragment]
        result = StreamResult(0.0, 0)  # a share with no tensors in this fragment
        error: BaseException | None = None
        try:
            on_cuda = bool(names) and self.params[names[0]].device.type == "cuda"
            if on_cuda and self.anchor_device.type == "cpu":
                pin_round_memory(self.outer_optimizer, self.anchors)
            assert isinstance(self.transport, BucketMean)
            if names:
                with record_function("swarm/streamed_round"):
                    result = self._stream.run(
                        params=[self.params[name] for name in names],
                        anchors=[self.anchors[name] for name in names],
                        optimizer=self.outer_optimizer,
                        kind=kind,
                        reducer=self.transport,
                        merge_alpha=alpha,
                        seed=self.outer_steps,  # the same on every island: bf16 noise agrees
                    )
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

    @torch.no_grad()
    def _send(self, fragment: int, *, inline: bool) -> None:
        """Compute fragment ``fragment``'s pseudo-gradients and start their exchange."""
        assert self._in_flight is None, "the schedule allows one round in flight at a time"
        if self._placeholders:
            raise RuntimeError(
                "an outer round started while the anchors are still placeholders awaiting a "
                "resume (defer_anchors=True and load_state_dict was never called); install the "
                "saved anchors with load_state_dict before the first inner step."
            )
        start = time.perf_counter()
        names = self._owned_fragments[fragment]
        with record_function("swarm/pseudo_gradient"):
            deltas = {
                name: pseudo_gradient(self.anchors[name], self.params[name]) for name in names
            }
        rnd = _Round(fragment, self.inner_steps, deltas)
        round_index = self.outer_steps
        if inline:
            try:
                rnd.result = self._exchange(deltas, round_index)
            except Exception as err:
                if self.shard is None:
                    raise
                rnd.error = err  # the island agrees on it at the apply, then raises
        else:
            assert self.streaming.worker is not None
            rnd.future = self.streaming.worker.submit(lambda: self._exchange(deltas, round_index))
        rnd.send_blocked_s = time.perf_counter() - start
        self._in_flight = rnd

    @torch.no_grad()
    def _exchange(self, deltas: dict[str, Tensor], round_index: int) -> _Exchanged:
        """Error feedback, then the transport's average (runs in the worker when delayed).

        Overwrites ``deltas`` with the average. The residuals of a skipped round are restored:
        its whole pseudo-gradient re-enters the next round anyway (anchors and locals stay).
        """
        if not deltas:  # this rank's share of the fragment is empty: nothing to exchange
            return _Exchanged(RoundStats(applied=True), 0.0)
        codec = self.streaming.codec
        feedback = self.streaming.error_feedback and codec is not None
        previous = {name: self.residuals.get(name) for name in deltas} if feedback else {}
        if feedback:
            assert codec is not None
            for name, delta in deltas.items():
                to_send, new_residual = with_error_feedback(delta, previous[name], codec)
                delta.copy_(to_send)
                self.residuals[name] = new_residual
        try:
            with record_function("swarm/exchange"):
                stats = self.transport.average(deltas, round_index=round_index)
        except BaseException:
            # The round did not happen anywhere (anchors unchanged): neither did its feedback.
            self._restore_residuals(previous)
            raise
        if not stats.applied:
            self._restore_residuals(previous)
            return _Exchanged(stats, 0.0)
        return _Exchanged(stats, global_norm(list(deltas.values())))

    def _restore_residuals(self, previous: Mapping[str, Tensor | None]) -> None:
        for name, old in previous.items():
            if old is None:
                self.residuals.pop(name, None)
            else:
                self.residuals[name] = old

    @torch.no_grad()
    def _apply(self, fragment: int, *, merge_alpha: float | None = None) -> SyncReport:
        """Wait for fragment ``fragment``'s average, step its anchors, merge into the locals.

        ``merge_alpha`` overrides the schedule's (``finish`` merges with 0).
        """
        rnd = self._in_flight
        assert rnd is not None and rnd.fragment == fragment, "apply without a matching send"
        start = time.perf_counter()
        result, applied, norm = self._island_result(rnd)
        self._in_flight = None
        names = self._owned_fragments[fragment]
        alpha = self.schedule.merge_alpha if merge_alpha is None else merge_alpha
        if applied:
            anchors = [self.anchors[name] for name in names]
            deltas = [rnd.deltas[name] for name in names]
            if names:
                with record_function("swarm/outer_step"):
                    # The outer-step count is the same on every island: bf16 noise agrees.
                    outer_step(self.outer_optimizer, anchors, deltas, seed=self.outer_steps)
            self.outer_steps += 1
            self.fragment_rounds[fragment] += 1
            with record_function("swarm/merge"):
                for name in names:
                    merge_into_local(self.params[name].data, self.anchors[name], alpha)
            if self.shard is not None:
                self.shard.gather(self.fragments[fragment], self.params)
            if alpha == 0.0:
                self.synced_at[fragment] = self.inner_steps
        # A skipped round keeps both anchors and locals: the island's progress is not thrown
        # away, it simply enters the next round's pseudo-gradient.
        del rnd.deltas
        return SyncReport(
            outer_steps=self.outer_steps,
            pseudo_grad_norm=norm,
            bytes_sent=result.stats.bytes_sent,
            bytes_received=result.stats.bytes_received,
            wall_s=rnd.send_blocked_s + time.perf_counter() - start,
            applied=applied,
            fragment=fragment,
            fragment_rounds=self.fragment_rounds[fragment],
            transport_s=result.stats.wall_s,
        )

    def _island_result(self, rnd: _Round) -> tuple[_Exchanged, bool, float]:
        """The exchange's result, whether the round applies, and its norm, island-wide.

        Unsharded that is the transport's own verdict. Sharded, every share must agree
        (``IslandShard.agree``) before any rank steps: a failed share raises on every rank.
        """
        if self.shard is None:
            result = self._result(rnd)
            return result, result.stats.applied, result.norm
        error: Exception | None = rnd.error
        result = _Exchanged(RoundStats(applied=False), 0.0)
        if error is None:
            try:
                result = self._result(rnd)
            except Exception as err:
                error = err
        own_norm = 0.0 if result.combined else result.norm
        applied, norm = self.shard.agree(result.stats.applied, own_norm, error)
        return result, applied, result.norm if result.combined else norm

    def _result(self, rnd: _Round) -> _Exchanged:
        if rnd.result is None:
            assert rnd.future is not None
            with record_function("swarm/wait"):
                rnd.result = SyncWorker.wait(
                    rnd.future,
                    f"the outer sync of fragment {rnd.fragment} (sent after inner step "
                    f"{rnd.send_step})",
                )
            rnd.future = None
        return rnd.result

    def round_now(self) -> SyncReport:
        """One round now, outside the inner-step schedule: an elastic island's first round.

        Raises:
            ValueError: with several fragments or a round in flight (elastic runs have neither).
        """
        if len(self.fragments) != 1 or self._in_flight is not None:
            raise ValueError("a round outside the schedule needs one fragment and none in flight")
        self._send(0, inline=True)
        return self._apply(0)

    def drain(self) -> None:
        """Wait for a round in flight without applying it (before a save or at teardown)."""
        if self._in_flight is not None:
            self._result(self._in_flight)

    def state_dict(self) -> dict[str, Any]:
        """Anchors, outer optimizer state, counters and a round in flight (global state).

        A round in flight is waited for; its averaged result (identical on every island) is
        saved so a resumed run applies it at the same step as an uninterrupted one. Tensors
        stay on the anchor device.
        """
        pending = None
        if self._in_flight is not None:
            result = self._result(self._in_flight)
            pending = {
                "fragment": self._in_flight.fragment,
                "send_step": self._in_flight.send_step,
                "deltas": dict(self._in_flight.deltas),
                "applied": result.stats.applied,
                "norm": result.norm,
                "bytes_sent": result.stats.bytes_sent,
                "bytes_received": result.stats.bytes_received,
                "transport_s": result.stats.wall_s,
            }
            if self.shard is not None:
                pending["share_norm"] = not result.combined  # merged shards combine it
        state: dict[str, Any] = {
            "anchors": dict(self.anchors),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "fragment_rounds": list(self.fragment_rounds),
            "pending": pending,
            "synced_at": list(self.synced_at),
            "ended_at": self.ended_at,
        }
        if self.shard is not None:
            # The outer optimizer's state is positional: a re-shard needs the names.
            state["param_names"] = list(self.owned)
        return state

    def island_state_dict(self) -> dict[str, Any]:
        """This island's own state: the error-feedback residuals (after any round in flight).

        Sharded with error feedback, each rank holds the residuals of its share: this is then
        collective over the island, and the island's first rank (which writes the island's
        file) gets every share's residuals.
        """
        self.drain()
        residuals = dict(self.residuals)
        if self.shard is not None and self.streaming.error_feedback:
            residuals = self.shard.collect(residuals)
        return {"residuals": residuals}

    def load_island_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install residuals saved by ``island_state_dict`` (converted to the anchor device)."""
        residuals: Mapping[str, Tensor] = state.get("residuals", {})
        for name, residual in residuals.items():
            if name not in self.params or residual.shape != self.params[name].shape:
                raise ValueError(
                    f"saved error-feedback residual {name!r} does not fit this model; resume "
                    "with the model and fragments the checkpoint was written by."
                )
        owned = set(self.owned)
        self.residuals = {
            name: r.to(device=self.anchor_device, dtype=torch.float32)
            for name, r in residuals.items()
            if name in owned
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install anchors, outer optimizer state, counters and a round in flight.

        The given anchor tensors are adopted, not copied, when they already have this object's
        anchor device and dtype: memory-mapped anchors stay file-backed until a sync writes
        them. Otherwise they are converted (e.g. a float32 file resumed with bfloat16 anchors).
        The outer optimizer is rebuilt over the new anchors, then given the saved state.

        Raises:
            ValueError: a parameter has no anchor, or an anchor of the wrong shape; or the
                saved round in flight does not fit this run's schedule.
        """
        anchors: Mapping[str, Tensor] = state["anchors"]
        for name, p in self.params.items():
            if name not in anchors or tuple(anchors[name].shape) != tuple(p.shape):
                found = tuple(anchors[name].shape) if name in anchors else "no anchor"
                raise ValueError(
                    f"saved anchors do not fit parameter {name!r} (shape {tuple(p.shape)}, "
                    f"saved {found}); resume with the model the checkpoint was written by."
                )
        self.anchors = {
            name: anchors[name].to(device=self.anchor_device, dtype=self.anchor_dtype)
            for name in self.owned
        }
        self._placeholders = False
        self.outer_optimizer = self._outer_optimizer_factory(list(self.anchors.values()))
        saved_names = state.get("param_names") or list(anchors)
        optimizer_state = select_by_name(state["outer_optimizer"], saved_names, self.owned)
        self.outer_optimizer.load_state_dict(optimizer_state)
        keep_state_float32(self.outer_optimizer, optimizer_state)
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        rounds = state.get("fragment_rounds")
        self.fragment_rounds = list(rounds) if rounds is not None else [0] * len(self.fragments)
        # Saves older than the end-of-fit round lack these: in sync unknown, fit never ended.
        synced = state.get("synced_at")
        self.synced_at = list(synced) if synced is not None else [None] * len(self.fragments)
        ended = state.get("ended_at")
        self.ended_at = None if ended is None else int(ended)
        self._in_flight = self._restore_round(state.get("pending"))

    def _restore_round(self, pending: Mapping[str, Any] | None) -> _Round | None:
        expected = None
        if self.inner_steps:
            expected = self.schedule.in_flight(self.inner_steps, sent_after=self.ended_at or 0)
        found = None if pending is None else int(pending["fragment"])
        if found != expected:
            raise ValueError(
                f"the checkpoint has fragment {found} in flight at inner step {self.inner_steps} "
                f"but this run's schedule expects {expected}; resume with the sync_every, "
                "num_fragments and sync_delay the checkpoint was written with."
            )
        if pending is None:
            return None
        stats = RoundStats(
            bytes_sent=int(pending["bytes_sent"]),
            bytes_received=int(pending["bytes_received"]),
            wall_s=float(pending["transport_s"]),
            applied=bool(pending["applied"]),
        )
        owned = set(self.owned)
        deltas = {
            name: t.to(torch.float32) for name, t in pending["deltas"].items() if name in owned
        }
        combined = not pending.get("share_norm", False)
        return _Round(
            int(pending["fragment"]),
            int(pending["send_step"]),
            deltas,
            result=_Exchanged(stats, float(pending["norm"]), combined=combined),
        )
