"""Elastic membership on torchft: a quorum per outer round, a commit gate, healing.

``TorchftMembership`` is a ``Transport`` whose islands torchft's Lighthouse decides every round:
quorum (a joiner is healed from a live island; the genesis quorum heals every island to the
first one's anchors), round header (refusals before any tensor moves), the mean over the
participants, then the commit gate. A failure anywhere abandons the round on the survivors
(anchors unchanged, local progress kept); only the header's refusals and a quorum that never
comes raise. An island of several ranks fans out from rank 0 (``per_rank=False``) or runs a
Manager per rank over its share (``per_rank=True``); its ranks agree on one outcome. Managers and
their groups belong to this object until ``close``; healed state goes to ``load_fn``, which keeps
it until the training thread installs it (``ElasticOuter.settle``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.model_layout import Layout, describe_difference, fingerprint
from lightning_swarm.membership.adopt import RoundAdoption
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.errors import (
    MembershipError,
    ModelMismatchError,
)
from lightning_swarm.membership.fanout import IslandFanout, RoundOutcome
from lightning_swarm.membership.quorum import ShortRounds, count_failed_vote, request_quorum
from lightning_swarm.membership.quorum_coded import coded_quorum_mean
from lightning_swarm.membership.quorum_mean import bucketed_mean
from lightning_swarm.membership.quorum_watch import QuorumWatch
from lightning_swarm.membership.round_header import (
    HeaderRow,
    Settings,
    Verdict,
    decode_settings,
    encode_settings,
    island_hash,
    judge,
    reference_index,
    refusal,
    settings_disagree,
    settings_hash,
    settings_tensor,
)
from lightning_swarm.membership.suspension import SuspensionWatch
from lightning_swarm.membership.torchft_manager import seconds, start_island_managers
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.checks import all_finite

PhaseHook = Callable[[str, int], None]
"""Called with (phase, round) as each phase of a round starts on each rank that talks to
torchft (the island's rank 0, or every rank per rank): quorum,
pg_setup, header, mean, commit, heal_send, heal_recv; round 0 is the island's first (its join).
For failure injection in tests: it may kill or stop the process at a chosen moment."""
StateFn = Callable[[], dict[str, Any]]
LoadFn = Callable[[dict[str, Any]], None]
HealedFn = Callable[[], None]


@dataclass
class MembershipTotals:
    """What this island saw of the swarm (identical on every rank of the island, except the
    heal figures of a per-rank island: each rank's own share)."""

    islands_in_round: int = 0
    rounds_committed: int = 0
    rounds_abandoned: int = 0
    heal_bytes: int = 0
    heal_time_s: float = 0.0
    heals: int = 0


_REFUSALS = (Verdict.DIVERGED, Verdict.DUPLICATE, Verdict.MODEL, Verdict.SETTINGS)


class TorchftMembership:
    """Averages pseudo-gradients over this round's quorum of islands; see the module docstring.

    Args:
        config: lighthouse, island id, minimum islands and timeouts.
        layout: this island's model layout (``algorithm.model_layout.model_layout``).
        state_fn: returns the global state a joiner needs (anchors, outer state, counters);
            per rank: this rank's share of it.
        load_fn: installs such a state (fan-out: on every rank of a healed island; per rank:
            on each rank whose share was healed).
        island_group: the island's process group (``None``: the default group when one
            exists, else an island of one rank).
        bucket_numel: float32 elements per all-reduce bucket.
        codec: quantize the mean (``quorum_coded``); ``None`` averages float32.
        background: rounds run on a worker thread while the training thread's DDP uses the
            island's group (``sync_delay > 0``): the fan-out then gets a gloo group of its
            own, since two threads' collectives on one group interleave differently per rank.
        per_rank: every rank of the island exchanges its own share with a Manager of its own
            (see the module docstring); ``False``: rank 0 exchanges and fans out.
        island_healed_fn: called on every rank of the island after a round in which any of
            its ranks was healed (after ``load_fn``), e.g. to have the healed shares gathered.

    Raises:
        LighthouseUnreachableError: the lighthouse did not answer in ``connect_timeout_s``.
    """

    def __init__(
        self,
        config: ElasticConfig,
        *,
        layout: Layout,
        state_fn: StateFn,
        load_fn: LoadFn,
        island_group: dist.ProcessGroup | None = None,
        bucket_numel: int = 8 << 20,
        codec: Codec | None = None,
        background: bool = False,
        per_rank: bool = False,
        island_healed_fn: HealedFn | None = None,
    ) -> None:
        self.config = config
        self.layout = dict(layout)
        self.bucket_numel = bucket_numel
        self.codec = codec
        # Streaming DiLoCo: which round this island averages, its own or the swarm's.
        self.adoption = RoundAdoption()
        self.last_round_bytes = 0
        self.totals = MembershipTotals()
        self._state_fn, self._load_fn = state_fn, load_fn
        self._island_healed_fn = island_healed_fn
        self._fanout = IslandFanout(island_group, side_group=True if background else None)
        self.per_rank = per_rank and self._fanout.size > 1
        # Per rank, the quorum and the vote wait for every rank of the island: each rank takes
        # part in every round, an empty share too (the outer loop reads this).
        self.every_rank_in_round = self.per_rank
        # Whether this rank talks to torchft: every rank per rank, else the island's rank 0.
        self.exchanges = self.per_rank or self._fanout.is_leader
        self._short_rounds = ShortRounds(config)
        self._settings: Settings = {}
        self._row = HeaderRow(
            island=island_hash(config.island_id),
            model=fingerprint(self.layout),
            healing=0,
            joined_ns=time.time_ns(),
            nonce=secrets.randbits(62),
            finite=1,
            settings=settings_hash(encode_settings({})),
            settings_len=len(encode_settings({})),
        )
        if self.per_rank:  # the island's ranks send identical rows: rank 0's identity
            ident = self._fanout.share_text(f"{self._row.joined_ns}:{self._row.nonce}")
            self._row.joined_ns, self._row.nonce = (int(v) for v in ident.split(":"))
        self._manager: Any = None
        self.on_phase: PhaseHook | None = None
        self._watch: SuspensionWatch | None = None
        self._quorum_watch = QuorumWatch(config.island_id)
        self._last_commit_at = time.monotonic()
        self._rounds_started = 0
        self._healed: dict[str, Any] | None = None
        self._rows: list[HeaderRow] = []  # the last round header's
        self._island_healed = False
        self._start_managers()

    def _start_managers(self) -> None:
        """This rank's Manager, if it talks to torchft; rank 0's first (collective)."""
        parts = start_island_managers(
            self.config,
            self._fanout,
            per_rank=self.per_rank,
            load_fn=self._load_healed,
            state_fn=self._state_for_peer,
            on_phase=self._phase,
        )
        if parts is not None:
            self._parts = parts  # keeps the island's store alive on its rank 0
            self._manager, self._pg = parts.manager, parts.pg
            self.heal_transport, self._identity = parts.heal_transport, parts.identity
            self._watch = SuspensionWatch()

    def agree_on(self, settings: Settings) -> None:
        """The DiLoCo settings every island of the swarm must share (``swarm_settings``), set
        before the first round; an island whose settings differ is refused, naming them."""
        self._settings = dict(settings)
        encoded = encode_settings(self._settings)
        self._row.settings, self._row.settings_len = settings_hash(encoded), len(encoded)

    # -- healing hooks (called by torchft on the island's rank 0) --------------------------------
    def _state_for_peer(self) -> dict[str, Any]:
        return {"layout": self.layout, "user": self._state_fn()}

    def _load_healed(self, state: dict[str, Any]) -> None:
        swarm_layout = state.get("layout")
        if swarm_layout != self.layout:
            raise ModelMismatchError(
                f"island {self.config.island_id!r} was refused: its model differs from the "
                f"swarm's: {describe_difference(self.layout, dict(swarm_layout or {}))}. "
                "Start it with the model the swarm trains."
            )
        self._healed = state["user"]

    # -- the round --------------------------------------------------------------------------------
    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        """Overwrite ``tensors`` with their mean over this round's islands (if committed)."""
        start = time.perf_counter()
        for t in tensors.values():
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError("TorchftMembership averages contiguous float32 tensors only")
        if self.per_rank:
            outcome = self._rank_round(list(tensors.values()))
        else:
            outcome = self._fanned_round(list(tensors.values()))
        if outcome.healed is not None:
            self._load_fn(outcome.healed)
            self.totals.heals += 1
            self.totals.heal_bytes += outcome.heal_bytes
            self.totals.heal_time_s += outcome.heal_s
        if self._island_healed and self._island_healed_fn is not None:
            self._island_healed_fn()
        self.totals.islands_in_round = outcome.participants
        self.totals.rounds_committed += int(outcome.committed)
        self.totals.rounds_abandoned += int(not outcome.committed)
        moved = self.last_round_bytes if self.exchanges else 0
        return RoundStats(
            bytes_sent=moved,
            bytes_received=moved,
            wall_s=time.perf_counter() - start,
            # An island that adopted the swarm's round drops its own (``adoption.take``).
            applied=outcome.committed and not outcome.genesis and self.adoption.adopted is None,
        )

    def _fanned_round(self, tensors: list[Tensor]) -> RoundOutcome:
        """Rank 0 runs the round; the island's other ranks receive its outcome."""
        outcome, error = RoundOutcome(), None
        if self._fanout.is_leader:
            try:
                outcome = self._lead_round(tensors, all_finite(tensors))
            except MembershipError as err:
                error = err
        self._fanout.share_error(error)
        outcome = self._fanout.share_outcome(outcome, tensors)
        self.adoption.share(self._fanout)
        self._island_healed = outcome.healed is not None
        return outcome

    def _rank_round(self, tensors: list[Tensor]) -> RoundOutcome:
        """Every rank runs the round with its share; the island ends it alike."""
        # Agreed before anything can fail, so that every rank's collectives stay matched.
        finite = self._fanout.all_true(all_finite(tensors))
        outcome, error = RoundOutcome(), None
        try:
            outcome = self._lead_round(tensors, finite)
        except MembershipError as err:
            error = err
        except Exception:  # e.g. position 0's manager server went away
            # This rank's round failed (abandoned, as torchft's own errors are); the island
            # learns any refusal from the agreement below, which every rank must reach.
            count_failed_vote(self._manager)
            outcome = RoundOutcome()
        outcome.committed, self._island_healed = self._fanout.agree_round(
            error, outcome.committed, outcome.healed is not None
        )
        adopted = self.adoption.adopted
        if adopted is not None and adopted.applied and not outcome.committed:
            # Another rank's share failed: the island applies none of the swarm's round.
            adopted.applied, adopted.deltas = False, {}
        return outcome

    def _lead_round(self, tensors: list[Tensor], finite: bool) -> RoundOutcome:
        """The round as this rank sees it: quorum, header, mean, vote (no island collective)."""
        manager = self._manager
        self._healed = None
        self._rounds_started += 1
        self._phase("quorum")
        self._quorum()
        healing = not manager.is_participating()
        genesis = manager.current_step() == 0
        self._phase("header")
        self.adoption.mark(self._row)
        conflict = self._check_round_header(healing, finite)
        participants = manager.num_participants()
        averaged = None if conflict else self.adoption.contribution(self._rows, self._row, tensors)
        if averaged is None and not conflict:
            manager.report_error(MembershipError("the islands were at different fragments"))
            conflict = True
        averaged = tensors if averaged is None else averaged
        self.last_round_bytes = 0
        if not conflict:
            self._phase("mean")
            self._allreduce(averaged)
        self._phase("commit")
        committed = self._commit_gate()
        self._short_rounds.see(participants, committed)
        if committed:
            self._last_commit_at = time.monotonic()
        self.adoption.conclude(averaged, committed and not genesis and not conflict)
        outcome = RoundOutcome(committed=committed, genesis=genesis, participants=participants)
        if self._healed is not None:
            outcome.healed = self._healed
            outcome.heal_bytes = self.heal_transport.last_heal_bytes
            outcome.heal_s = self.heal_transport.last_heal_s
        return outcome

    def _commit_gate(self) -> bool:
        """torchft's vote; a timeout of the vote itself (this island was suspended across it)
        counts as an abandoned round: the next quorum heals the island if the others went on."""
        try:
            return bool(self._manager.should_commit(timeout=seconds(self.config.round_timeout_s)))
        except TimeoutError:
            count_failed_vote(self._manager)
            return False

    def _phase(self, name: str) -> None:
        """Tell the fault hook (tests only) which phase of which round starts now."""
        if self.on_phase is not None:
            self.on_phase(name, self._rounds_started - 1)

    def _quorum(self) -> None:
        assert self._watch is not None, "the island's rank 0 watches for suspensions"
        request_quorum(self._manager, self.config, self._watch, self._last_commit_at)

    def _check_round_header(self, healing: bool, finite: bool) -> bool:
        """All-gather the round header (``round_header``); True when the round is abandoned.

        Raises the refusal of this island when the header shows it is at fault.
        """
        self._row.healing, self._row.finite = int(healing), int(finite or healing)
        try:
            rows = self._gather_rows()
            swarm_settings = self._exchange_settings(rows) if settings_disagree(rows) else None
        except Exception as err:  # a dead peer: torchft's commit gate turns this into a "no"
            self._manager.report_error(err)
            return True
        self._rows = rows
        verdict = judge(rows, self._row)
        if self._fanout.is_leader:  # one warning per island
            self._quorum_watch.see(rows)
        if verdict in _REFUSALS:
            self._refuse(verdict, rows, healing, swarm_settings)
        if verdict is Verdict.ABANDON:
            self._manager.report_error(MembershipError("a refused island was in the round"))
            return True
        return False

    def _gather_rows(self) -> list[HeaderRow]:
        mine = self._row.tensor()
        rows = [torch.empty_like(mine) for _ in range(self._pg.size())]
        self._pg.allgather([rows], [mine], AllgatherOptions()).wait()
        return [HeaderRow.of(r) for r in rows]

    def _exchange_settings(self, rows: list[HeaderRow]) -> Settings:
        """Every member's settings (the hashes disagree); returns the swarm's reference."""
        mine = settings_tensor(encode_settings(self._settings), rows)
        gathered = [torch.empty_like(mine) for _ in rows]
        self._pg.allgather([gathered], [mine], AllgatherOptions()).wait()
        index = reference_index(rows)
        return decode_settings(gathered[index], rows[index].settings_len)

    def _refuse(
        self, verdict: Verdict, rows: list[HeaderRow], healing: bool, swarm: Settings | None
    ) -> None:
        if verdict is Verdict.DUPLICATE:
            self._manager.shutdown(wait=False)
        if verdict is Verdict.MODEL and healing:
            # The healed layout names the difference (raised by _load_healed in the vote).
            self._manager.should_commit(timeout=seconds(self.config.round_timeout_s))
        model = rows[reference_index(rows)].model
        raise refusal(verdict, self.config.island_id, self._row.model, model, self._settings, swarm)

    def _allreduce(self, tensors: list[Tensor]) -> None:
        """The mean over participating islands, bucketed, written back in place."""
        if self.codec is not None:
            self.last_round_bytes = coded_quorum_mean(
                self._manager, self._pg, tensors, self.codec, self.bucket_numel
            )
        else:
            self.last_round_bytes = bucketed_mean(
                self._manager, tensors, self.bucket_numel, self._pg.size()
            )

    def close(self) -> None:
        """Leave the swarm: stop heartbeats and the manager. Idempotent."""
        if self._manager is not None:
            self._manager.shutdown(wait=True)
            self._manager = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._fanout.close()
