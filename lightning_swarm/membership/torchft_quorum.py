"""Elastic membership on torchft: a quorum per outer round, a commit gate, healing.

``TorchftMembership`` is a ``Transport`` (``average(tensors, round_index=...)``) whose set of
islands is decided anew every round by torchft's Lighthouse. One round, on the island's rank 0:

1. quorum (``quorum.request_quorum``): ``Manager.start_quorum``; a joiner (new, restarted, or
   an island that missed a commit) is healed here from a live island: anchors, outer optimizer
   state and counters, over the quorum's process group (``TensorHealTransport``, no pickle). A
   lighthouse restarted within ``quorum_timeout_s`` is asked again; each new membership gets a
   process group of its own (``QuorumIdentity``); an island back from a suspension asks anew;
2. round header (``round_header``): a tiny all-gather of one row per island (island id hash,
   model fingerprint, healing, join time, nonce, finite, settings hash) over the quorum's group.
   A duplicate ``island_id``, a model or DiLoCo settings that differ, or a pseudo-gradient with
   NaN or inf makes every member abandon the round before any pseudo-gradient moves; the
   offending island raises and leaves;
3. the mean over the participating islands (``Manager.allreduce``, bucketed; with a codec the
   quantized reduce-scatter of ``quorum_coded``); an island being healed contributes zeros
   and is not counted. With fragments, an island being healed averages the swarm's fragment,
   not its own, and adopts the swarm's round (``adopt``; ``adoption.take`` hands it over);
4. the commit gate (``Manager.should_commit``): a failed member makes the survivors' collectives
   fail, so they vote no and the round is abandoned (anchors unchanged, local progress kept for
   the next round). A survivor that voted differently is behind by one commit at the next quorum
   and torchft heals it from the others, so the swarm converges on one history.
   A failure anywhere in the round, the set-up of the quorum's group included, abandons the
   round on the survivors; only the refusals of step 2 and a quorum that never comes raise.

A test can inject failures at each phase through ``on_phase`` (``PhaseHook``).

The very first quorum of a swarm (torchft step 0) is the genesis round: every island except the
first is healed to the first island's anchors and no outer step is taken (``applied`` false).

Islands of several ranks: only the island's rank 0 talks to torchft (one Manager per island,
replica group size 1). The island's other ranks follow over the island's own process group: rank
0 broadcasts the round's outcome, a healed state, an adopted round and the averaged tensors.
Every rank of the island therefore sees the same outcome and the same errors. With rounds on a
background worker (``background``) the fan-out gets a gloo group of its own. The cross-island
bytes are those of one rank per island; the island's fast fabric carries the fan-out.

Ownership: the Manager, its TCPStore and its process group belong to this object until
``close``. Healed state is handed to ``load_fn`` (the outer loop), which adopts its tensors.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.membership.adopt import RoundAdoption
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.errors import (
    LighthouseUnreachableError,
    MembershipError,
    ModelMismatchError,
    QuorumTimeoutError,
)
from lightning_swarm.membership.fanout import IslandFanout, RoundOutcome
from lightning_swarm.membership.model_fingerprint import Layout, describe_difference, fingerprint
from lightning_swarm.membership.quorum import (
    QuorumIdentity,
    quorum_retries_for,
    request_quorum,
)
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
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.checks import all_finite

PhaseHook = Callable[[str, int], None]
"""Called with (phase, round) as each phase of a round starts on the island's rank 0: quorum,
pg_setup, header, mean, commit, heal_send, heal_recv; round 0 is the island's first (its join).
For failure injection in tests: it may kill or stop the process at a chosen moment."""
StateFn = Callable[[], dict[str, Any]]
LoadFn = Callable[[dict[str, Any]], None]


@dataclass
class MembershipTotals:
    """What this island saw of the swarm (identical on every rank of the island)."""

    islands_in_round: int = 0
    rounds_committed: int = 0
    rounds_abandoned: int = 0
    heal_bytes: int = 0
    heal_time_s: float = 0.0
    heals: int = 0


_REFUSALS = (Verdict.DIVERGED, Verdict.DUPLICATE, Verdict.MODEL, Verdict.SETTINGS)


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


class TorchftMembership:
    """Averages pseudo-gradients over this round's quorum of islands; see the module docstring.

    Args:
        config: lighthouse, island id, minimum islands and timeouts.
        layout: this island's model layout (``membership.layout.model_layout``).
        state_fn: returns the global state a joiner needs (anchors, outer state, counters).
        load_fn: installs such a state (called on every rank of a healed island).
        island_group: the island's process group (``None``: the default group when one
            exists, else an island of one rank).
        bucket_numel: float32 elements per all-reduce bucket.
        codec: quantize the mean (``quorum_coded``); ``None`` averages float32.
        background: rounds run on a worker thread while the training thread's DDP uses the
            island's group (``sync_delay > 0``): the fan-out then gets a gloo group of its
            own, since two threads' collectives on one group interleave differently per rank.

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
        self._fanout = IslandFanout(island_group, side_group=True if background else None)
        self._short_since: float | None = None
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
        self._manager: Any = None
        self.on_phase: PhaseHook | None = None
        self._watch: SuspensionWatch | None = None
        self._quorum_watch = QuorumWatch(config.island_id)
        self._last_commit_at = time.monotonic()
        self._rounds_started = 0
        self._healed: dict[str, Any] | None = None
        self._rows: list[HeaderRow] = []  # the last round header's
        error = None
        if self._fanout.is_leader:
            self._watch = SuspensionWatch()
            try:
                self._start_manager()
            except MembershipError as err:
                self._watch.close()  # the fan-out below still needs the island's group
                error = err
        self._fanout.share_error(error)

    def _start_manager(self) -> None:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        from lightning_swarm.membership.heal import TensorHealTransport

        config = self.config
        host = socket.gethostname()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._pg = ProcessGroupGloo(timeout=_seconds(config.round_timeout_s))
        configure = self._pg.configure

        def configure_after_hook(store_addr: str, *args: Any, **kwargs: Any) -> None:
            # Runs in torchft's quorum thread, as the process group of a new quorum is set up.
            self._phase("pg_setup")
            configure(self._identity.store_prefix(store_addr), *args, **kwargs)
            self._identity.set_up()

        self._pg.configure = configure_after_hook
        self.heal_transport = TensorHealTransport(
            self._pg, _seconds(config.round_timeout_s), on_phase=self._phase
        )
        try:
            self._manager = Manager(
                pg=self._pg,
                load_state_dict=self._load_healed,
                state_dict=self._state_for_peer,
                min_replica_size=config.min_islands,
                use_async_quorum=True,
                timeout=_seconds(config.round_timeout_s),
                quorum_timeout=_seconds(config.quorum_timeout_s),
                connect_timeout=_seconds(config.connect_timeout_s),
                rank=0,
                world_size=1,
                store_addr=host,
                store_port=self._store.port,
                lighthouse_addr=config.lighthouse,
                replica_id=config.island_id,
                checkpoint_transport=self.heal_transport,
                init_sync=True,
                quorum_retries=quorum_retries_for(config.quorum_timeout_s),
            )
        except RuntimeError as err:
            raise LighthouseUnreachableError(
                f"island {config.island_id!r} could not reach the lighthouse at "
                f"{config.lighthouse} within connect_timeout_s={config.connect_timeout_s}: "
                f"{str(err).splitlines()[0][:200]}. Start it with `swarm-lighthouse "
                "--min-islands N --port P` and pass its address as lighthouse=http://host:P."
            ) from err
        self._identity = QuorumIdentity(self._manager)

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
        outcome, error = RoundOutcome(), None
        if self._fanout.is_leader:
            try:
                outcome = self._lead_round(list(tensors.values()))
            except MembershipError as err:
                error = err
        self._fanout.share_error(error)
        outcome = self._fanout.share_outcome(outcome, list(tensors.values()))
        self.adoption.share(self._fanout)
        if outcome.healed is not None:
            self._load_fn(outcome.healed)
            self.totals.heals += 1
            self.totals.heal_bytes += outcome.heal_bytes
            self.totals.heal_time_s += outcome.heal_s
        self.totals.islands_in_round = outcome.participants
        self.totals.rounds_committed += int(outcome.committed)
        self.totals.rounds_abandoned += int(not outcome.committed)
        moved = self.last_round_bytes if self._fanout.is_leader else 0
        return RoundStats(
            bytes_sent=moved,
            bytes_received=moved,
            wall_s=time.perf_counter() - start,
            # An island that adopted the swarm's round drops its own (``adoption.take``).
            applied=outcome.committed and not outcome.genesis and self.adoption.adopted is None,
        )

    def _lead_round(self, tensors: list[Tensor]) -> RoundOutcome:
        manager = self._manager
        self._healed = None
        self._rounds_started += 1
        self._phase("quorum")
        self._quorum()
        healing = not manager.is_participating()
        genesis = manager.current_step() == 0
        self._phase("header")
        self.adoption.mark(self._row)
        conflict = self._check_round_header(healing, all_finite(tensors))
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
        self._watch_min_islands(participants, committed)
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
            return bool(self._manager.should_commit(timeout=_seconds(self.config.round_timeout_s)))
        except TimeoutError:
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
            self._manager.should_commit(timeout=_seconds(self.config.round_timeout_s))
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

    def _watch_min_islands(self, participants: int, committed: bool) -> None:
        short = participants < self.config.min_islands and not committed
        if not short:
            self._short_since = None
            return
        now = time.monotonic()
        self._short_since = self._short_since or now
        if now - self._short_since > self.config.quorum_timeout_s:
            raise QuorumTimeoutError(
                f"island {self.config.island_id!r}: only {participants} island(s) in the rounds "
                f"of the last {now - self._short_since:.0f} s, fewer than min_islands="
                f"{self.config.min_islands}; start more islands or lower min_islands."
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
