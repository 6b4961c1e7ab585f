"""Elastic membership on torchft: a ``Transport`` whose islands the Lighthouse decides each round.

A round: quorum (joiners healed; the genesis quorum heals all to the first island's anchors),
round header, mean, commit gate; a failure abandons it on the survivors, only refusals and a
quorum that never comes raise. torchft's threads touch only a mailbox: the engine's offer, and the
healed state ``agree`` returns for the engine to install on its training thread.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.model_layout import (
    Layout,
    ParamLayout,
    describe_difference,
    fingerprint,
)
from lightning_swarm.membership.config import ElasticConfig, seconds
from lightning_swarm.membership.errors import (
    DuplicateIslandError,
    MembershipError,
    ModelMismatchError,
    QuorumTimeoutError,
)
from lightning_swarm.membership.fanout import IslandFanout, RoundOutcome
from lightning_swarm.membership.quorum import QuorumWatch, SuspensionWatch, request_quorum
from lightning_swarm.membership.round_header import (
    HeaderRow,
    Settings,
    abandons,
    island_hash,
    opening_of,
    reference_index,
    refusal,
    swarm_settings_of,
    weighed,
)
from lightning_swarm.membership.torchft_private import count_commit_failure, quorum_rank
from lightning_swarm.transport.allreduce import ring_allreduce_bytes
from lightning_swarm.transport.base import (
    Bucket,
    Done,
    Handle,
    Opening,
    RoundPlace,
    RoundRequest,
    RoundStats,
)
from lightning_swarm.transport.errors import BadWorkError
from lightning_swarm.transport.link import LinkRate
from lightning_swarm.transport.reduce_scatter import coded_bucket_mean

log = logging.getLogger(__name__)
T = TypeVar("T")

# Tests' fault hook, called with (phase, round) as each phase starts on each rank that talks to
# torchft: quorum, pg_setup, header, mean, commit, heal_send, heal_recv; round 0 is the join.
PhaseHook = Callable[[str, int], None]


def coded_quorum_mean(manager: Any, pg: Any, runs: list[Tensor], codec: Codec) -> int:
    """Overwrite one bucket's ``runs`` (flat float32 CPU views, each starting on a codec block
    of its tensor) with their quantized mean over the quorum, bitwise equal on every island;
    returns the bytes this island sent (= received), 0 when the exchange failed (reported to
    the manager: the vote is no). An island being healed owns a share and contributes zeros;
    the owners divide by the participants.
    """
    num_islands, island_index = pg.size(), quorum_rank(pg)  # the header rows' order, too
    if not manager.is_participating():
        for run in runs:
            run.zero_()

    def exchange(send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        if num_islands == 1:
            return send
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        pg.alltoall_base(received, send, recv_sizes, send_sizes, AllToAllOptions()).wait()
        return received

    try:
        return coded_bucket_mean(
            runs,
            codec=codec,
            num_islands=num_islands,
            island_index=island_index,
            divisor=max(manager.num_participants(), 1),
            exchange=exchange,
            device=torch.device("cpu"),
        )
    except Exception as err:  # a dead peer: the commit gate turns this into a "no"
        manager.report_error(err)
        return 0


@dataclass
class MembershipTotals:
    """What this island saw of the swarm (alike on its ranks; per rank, heals are each rank's)."""

    islands_in_round: int = 0
    rounds_abandoned: int = 0
    heal_bytes: int = 0
    heal_time_s: float = 0.0
    heals: int = 0


class TorchftMembership:
    """Averages pseudo-gradients over each round's quorum; owns its Managers until ``close``.

    ``island_group``: ``None`` is the default group when one exists, else an island of one rank.
    ``background``: rounds run on a worker thread beside the training thread's DDP, so the
    fan-out gets a gloo group of its own (two threads' collectives on one group interleave
    differently per rank). ``per_rank``: every rank runs a Manager over its own share.
    """

    pipelined = False
    heals = True  # ``open`` takes an offer: the engine builds one for every round

    def __init__(
        self,
        config: ElasticConfig,
        *,
        layout: Layout,
        island_group: dist.ProcessGroup | None = None,
        bucket_numel: int = 8 << 20,
        codec: Codec | None = None,
        background: bool = False,
        per_rank: bool = False,
    ) -> None:
        self.config = config
        self.layout = dict(layout)
        self.bucket_numel = bucket_numel
        self.codec = codec
        self.last_round_bytes = 0
        self.totals = MembershipTotals()
        self.on_phase: PhaseHook | None = None
        # The round in progress, from ``open`` to ``agree``.
        self._offer: Mapping[str, Any] | None = None
        self._started: list[Tensor] = []
        self._outcome = RoundOutcome()
        self._healed: dict[str, Any] | None = None
        self._error: MembershipError | None = None
        self._failed = False
        self._fanout = IslandFanout(island_group, side_group=True if background else None)
        self.per_rank = per_rank and self._fanout.size > 1
        # Per rank, each rank takes part in every round, an empty share too (the outer loop).
        self.every_rank_in_round = self.per_rank
        # Whether this rank talks to torchft: every rank per rank, else the island's rank 0.
        self.exchanges = self.per_rank or self._fanout.is_leader
        self._row = HeaderRow(
            island=island_hash(config.island_id),
            model=fingerprint(self.layout),
            healing=0,
            joined_ns=time.time_ns(),
            nonce=secrets.randbits(62),
            finite=1,
        )
        self.agree_on({})
        if self.per_rank:  # the island's ranks send identical rows: rank 0's identity
            identity = (self._row.joined_ns, self._row.nonce)
            self._row.joined_ns, self._row.nonce = self._fanout.on_leader(lambda: identity, (0, 0))
        self._quorum_watch = QuorumWatch(config.island_id)
        self._last_commit_at = time.monotonic()
        self._short_since: float | None = None  # rounds fell short of min_islands since
        self._rounds_started = 0
        # The last member this island saw refused (its own error says why), for a quorum that
        # then never forms: the island's partner left, and the timeout should say so.
        self._refused_note: str | None = None
        # This rank's link rate, measured by its own exchanges, and the round's bound.
        self._link = LinkRate(num_islands=1)
        self.round_timeout_s = config.timeouts.base_s
        self._manager: Any = None
        self._watch: SuspensionWatch | None = None
        from lightning_swarm.membership.torchft_manager import start_island_managers  # torchft

        parts = start_island_managers(
            config,
            self._fanout,
            per_rank=self.per_rank,
            load_fn=self._load_healed,
            state_fn=self._state_for_peer,
            on_phase=self._phase,
        )
        if parts is not None:
            self._parts = parts  # keeps the island's store alive on its position 0
            self._manager, self._pg = parts.manager, parts.pg
            self.heal_transport = parts.heal_transport
            self.heal_transport.timeout_for = self._heal_timeout
            self._watch = SuspensionWatch()

    def agree_on(self, settings: Settings) -> None:
        """The settings every island of the swarm must share, set before the first round."""
        self._settings: Settings = dict(settings)
        self._row.set_settings(self._settings)

    # -- healing hooks: torchft calls them on its own threads; they touch the mailbox only ------
    def _state_for_peer(self) -> dict[str, Any]:
        return {"layout": self.layout, "user": dict(self._offer or {})}

    def _load_healed(self, state: dict[str, Any]) -> None:
        swarm_layout = state.get("layout")
        if swarm_layout != self.layout:
            theirs = {n: ParamLayout(*e) for n, e in dict(swarm_layout or {}).items()}
            mine = {n: ParamLayout(*e) for n, e in self.layout.items()}
            shapes = {n: (e.shape, e.dtype) for n, e in mine.items()}
            split = shapes == {n: (e.shape, e.dtype) for n, e in theirs.items()}
            fix = (
                "Launch it with the swarm's island layout: the same island_parallel, number of "
                "ranks, tensor_parallel_size and pipeline_parallel_size, so that each rank holds "
                "the slices its counterparts hold."
                if split  # the same model, split otherwise between the island's ranks
                else "Start it with the model the swarm trains."
            )
            what = "it splits the model otherwise than" if split else "its model differs from"
            raise ModelMismatchError(
                f"island {self.config.island_id!r} was refused: {what} the swarm's: "
                f"{describe_difference(self.layout, dict(swarm_layout or {}))}. {fix}"
            )
        self._healed = state["user"]

    # -- the round: ``transport.base.Transport`` ------------------------------------------
    @property
    def block_size(self) -> int:
        return 1 if self.codec is None else self.codec.block_size

    def open(self, request: RoundRequest) -> Opening:
        """Quorum, round header and this island's opening (collective over the island);
        ``offer`` is what torchft sends a healing peer during the quorum. Raises a
        ``MembershipError`` on every rank when this island was refused (per rank: at
        ``agree``) or no quorum came."""
        self._offer = request.offer
        work = request.work
        self._row.work, self._row.inner_steps = (0, 0) if work is None else astuple(work)
        self._started, self.last_round_bytes = [], 0
        self._error, self._failed, self._outcome = None, False, RoundOutcome()
        if self.per_rank:
            # Agreed before anything can fail, so that every rank's collectives stay matched.
            finite = self._fanout.all_true(request.finite)
            return self._kept(lambda: self._lead_open(request, finite), Opening(abandon=True))
        return self._fanout.on_leader(lambda: self._lead_open(request, request.finite), Opening())

    def start(self, bucket: Bucket) -> Handle:
        """The bucket's mean over the quorum, in place, now; a failed exchange makes the vote
        no. Fan-out: the other ranks receive rank 0's means at ``agree``."""
        self._started.append(bucket.flat)
        if not self.exchanges:
            return Done()
        before = self.last_round_bytes
        self._allreduce(bucket.run_views() if self.codec is not None else [bucket.flat])
        return Done(self.last_round_bytes - before)

    def agree(self) -> RoundStats:
        """torchft's commit vote (a heal arrives in it), ended alike on every rank of the
        island; the round applies when committed past the genesis quorum."""
        if self.per_rank:
            outcome = RoundOutcome()
            if self._error is None and not self._failed:
                outcome = self._kept(self._lead_agree, outcome)
            outcome.committed, island_healed = self._fanout.agree_round(
                self._error, outcome.committed, outcome.healed is not None
            )
        else:
            outcome = self._fanout.lead_round(self._lead_agree, self._started)
            island_healed = outcome.healed is not None
        if outcome.healed is not None:
            self.totals.heals += 1
            self.totals.heal_bytes += outcome.heal_bytes
            self.totals.heal_time_s += outcome.heal_s
        self.totals.islands_in_round = outcome.participants
        self.totals.rounds_abandoned += int(not outcome.committed)
        return RoundStats(
            applied=outcome.committed and not outcome.genesis,
            heal=outcome.healed,
            island_healed=island_healed,
        )

    def _kept(self, run: Callable[[], T], fallback: T) -> T:
        """Per rank: ``run()``; a ``MembershipError`` is kept for ``agree``, any other (position
        0's manager server went away) abandons the round, as torchft's own errors do."""
        try:
            return run()
        except MembershipError as err:
            self._error = err
        except Exception:
            self._failed = True
            count_commit_failure(self._manager)
        return fallback

    def _lead_open(self, request: RoundRequest, finite: bool) -> Opening:
        """Quorum, header and opening as this rank sees them (no island collective)."""
        manager = self._manager
        self._healed = None
        self._rounds_started += 1
        # The round's bound, set before the quorum request sets the group up on its thread.
        self._link.begin(request.round_index, request.names)
        timeouts = self.config.timeouts
        self.round_timeout_s = timeouts.for_round(self._link.payload_bytes, self._link.rate_bps)
        self._pg.collective_timeout = seconds(self.round_timeout_s)
        self._phase("quorum")
        assert self._watch is not None, "a rank that talks to torchft watches for suspensions"
        try:
            request_quorum(manager, self.config, self._watch, self._last_commit_at)
        except QuorumTimeoutError as err:
            raise self._with_refusal(err) from err
        healing = not manager.is_participating()
        self._outcome = RoundOutcome(
            genesis=manager.current_step() == 0, participants=manager.num_participants()
        )
        self._link.num_islands = self._outcome.participants
        self._phase("header")
        place = astuple(request.place or RoundPlace(0, 0, 0))
        self._row.fragment, self._row.send_step, self._row.apply_step = place
        rows = self._check_round_header(healing, finite)
        opening = Opening(abandon=True) if rows is None else opening_of(rows, self._row)
        if opening.abandon and rows is not None:
            manager.report_error(MembershipError("the islands were at different fragments"))
        if request.work is not None and rows is not None and not opening.abandon:
            try:
                opening = weighed(rows, self._row, opening)
            except BadWorkError as err:  # every member reads the same rows: all abandon
                if self._fanout.is_leader:
                    log.error("island %r abandons this round: %s", self.config.island_id, err)
                manager.report_error(err)
                opening = Opening(abandon=True)
        if not opening.abandon:
            self._phase("mean")
            self._link.started()
        return opening

    def _lead_agree(self) -> RoundOutcome:
        """The vote as this rank sees it, with any heal it delivered (no island collective);
        ``QuorumTimeoutError`` once rounds fell short of ``min_islands`` for the quorum timeout."""
        outcome = self._outcome
        if self._manager.errored():
            self._link.discard()
        self._link.finished()
        self._phase("commit")
        try:  # a vote that timed out (a suspension) counts as an abandoned round
            timeout = seconds(self.round_timeout_s)
            outcome.committed = bool(self._manager.should_commit(timeout=timeout))
        except TimeoutError:
            count_commit_failure(self._manager)
        now, short = time.monotonic(), outcome.participants < self.config.min_islands
        if outcome.committed or not short:
            self._short_since = None
        else:
            self._short_since = self._short_since or now
            if now - self._short_since > self.config.quorum_timeout_s:
                raise self._with_refusal(
                    QuorumTimeoutError(
                        f"island {self.config.island_id!r}: only {outcome.participants} "
                        f"island(s) in the rounds of the last {now - self._short_since:.0f} s, "
                        f"fewer than min_islands={self.config.min_islands}; start more islands "
                        "or lower min_islands."
                    )
                )
        if outcome.committed:
            self._last_commit_at = now
        if self._healed is not None:
            outcome.healed, self._healed = self._healed, None
            outcome.heal_bytes = self.heal_transport.last_heal_bytes
            outcome.heal_s = self.heal_transport.last_heal_s
        return outcome

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name, self._rounds_started - 1)

    def _check_round_header(self, healing: bool, finite: bool) -> list[HeaderRow] | None:
        """The round header's rows (all-gathered), ``None`` when the round is abandoned;
        raises this island's refusal when it is at fault."""
        self._row.healing, self._row.finite = int(healing), int(finite or healing)
        try:
            rows = [HeaderRow.of(r) for r in self._allgather(self._row.tensor())]
            swarm_settings = swarm_settings_of(rows, self._settings, self._allgather)
        except Exception as err:  # a dead peer: torchft's commit gate turns this into a "no"
            self._manager.report_error(err)
            return None
        error = refusal(rows, self._row, self.config.island_id, self._settings, swarm_settings)
        if self._fanout.is_leader:  # one warning per island
            self._quorum_watch.see(rows)
        if isinstance(error, DuplicateIslandError):
            self._manager.shutdown(wait=False)
        if isinstance(error, ModelMismatchError) and healing:
            # The healed layout names the difference (raised by _load_healed in the vote).
            self._manager.should_commit(timeout=seconds(self.round_timeout_s))
        if error is not None:
            raise error
        if abandons(rows, self._row):
            self._manager.report_error(MembershipError("a refused island was in the round"))
            self._note_refused(rows)
            return None
        return rows

    def _note_refused(self, rows: list[HeaderRow]) -> None:
        reference = rows[reference_index(rows)]
        for row in rows:
            what = (
                "model"
                if row.model != reference.model
                else "DiLoCo settings"
                if row.settings != reference.settings
                else None
            )
            if what is not None:
                self._refused_note = (
                    f"The last island that came, island_id hash {row.island:x}, was refused in "
                    f"round {self._rounds_started - 1}: its {what} differ from the swarm's (its "
                    "own error names the difference); restart it with the swarm's, and this "
                    "island's quorum forms again."
                )

    def _with_refusal(self, err: QuorumTimeoutError) -> QuorumTimeoutError:
        """``err`` with the last refusal this island saw, if any, in its message."""
        if self._refused_note is None:
            return err
        return type(err)(f"{err} {self._refused_note}")

    def _allgather(self, mine: Tensor) -> list[Tensor]:
        gathered = [torch.empty_like(mine) for _ in range(self._pg.size())]
        self._pg.allgather([gathered], [mine], AllgatherOptions()).wait()
        return gathered

    def _allreduce(self, tensors: list[Tensor]) -> None:
        """One bucket's mean over the participants, in place: its runs through the coded mean,
        or its flat through ``Manager.allreduce`` (which zeroes a healing island's share and
        records a failure instead of raising)."""
        if self.codec is not None:
            self.last_round_bytes += coded_quorum_mean(self._manager, self._pg, tensors, self.codec)
            if not self._manager.errored():
                self._link.arrived()
            return
        (flat,) = tensors
        staged = flat if flat.device.type == "cpu" else flat.cpu()  # the quorum's group is gloo
        self._manager.allreduce(staged).wait()
        if staged is not flat:
            flat.copy_(staged)
        if not self._manager.errored():
            self._link.arrived()
            nbytes = flat.numel() * flat.element_size()
            self.last_round_bytes += ring_allreduce_bytes(nbytes, self._pg.size())

    def _heal_timeout(self, nbytes: int) -> datetime.timedelta:
        return seconds(self.config.timeouts.for_round(nbytes, self._link.rate_bps))

    def close(self) -> None:
        """Leave the swarm: stop heartbeats and the manager. Idempotent."""
        if self._manager is not None:
            self._manager.shutdown(wait=True)
            self._manager = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._fanout.close()
