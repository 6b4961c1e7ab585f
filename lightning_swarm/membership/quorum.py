"""Asking the lighthouse for a round's quorum, saying why none came, and watching quorums.

Every way out but a quorum is a ``MembershipError`` naming the cause and the fix.
"""

from __future__ import annotations

import hashlib
import math
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from lightning_swarm.membership.config import ElasticConfig, seconds
from lightning_swarm.membership.errors import (
    LighthouseLostError,
    MembershipError,
    QuorumTimeoutError,
    SwarmGoneError,
)
from lightning_swarm.membership.round_header import HeaderRow
from lightning_swarm.membership.torchft_private import (
    forget_failed_quorum,
    set_up_group_for_this_quorum,
    tap_quorums,
)

RETRY_SPACING_S = 1.0  # how often the manager server asks a lighthouse that did not answer
SUSPENDED_AFTER_S = 5.0  # a tick this much later than due: the process was away, not busy
RETURNS_TO_WARN = 2


def quorum_retries_for(quorum_timeout_s: float) -> int:
    """torchft's ``quorum_retries`` that finds a lighthouse restarted within the timeout."""
    return max(1, math.ceil(quorum_timeout_s / RETRY_SPACING_S))


def lighthouse_problem(address: str, timeout_s: float = 2.0) -> str | None:
    """Why no TCP connection to ``address`` succeeds in ``timeout_s``; ``None`` when one does."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as err:  # a port that is not a number
        return f"the address has no valid port ({err})"
    if host is None or port is None:
        return "the address names no host and port (e.g. http://host:29510)"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as err:
        return f"nothing accepted a connection within {timeout_s:g} s ({err})"


class SuspensionWatch:
    """Records when this process was away (SIGSTOP, or starved of the CPU for seconds): then
    every timeout has expired and the island must ask again rather than give up. A daemon
    thread ticks every ``tick_s`` and records a tick ``gap_s`` late, until ``close``."""

    def __init__(self, tick_s: float = 0.5, gap_s: float = SUSPENDED_AFTER_S) -> None:
        self.tick_s, self.gap_s = tick_s, gap_s
        self._gaps: list[tuple[float, float]] = []  # (monotonic end, seconds away)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-suspension", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if now - last - self.tick_s > self.gap_s:
                with self._lock:
                    self._gaps.append((now, now - last - self.tick_s))
            last = now

    def away_since(self, since: float) -> float:
        """Seconds this process was away in gaps that ended after monotonic time ``since``."""
        with self._lock:
            return sum(away for end, away in self._gaps if end > since)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def request_quorum(
    manager: Any, config: ElasticConfig, watch: SuspensionWatch, last_round_at: float
) -> None:
    """This round's quorum, within ``config.quorum_timeout_s``; an island away while asking
    asks again with a whole timeout. ``last_round_at``: its last commit (monotonic).

    Raises:
        LighthouseLostError: the lighthouse stopped answering for the whole timeout.
        SwarmGoneError: the island was away past its timeouts and no quorum formed after.
        QuorumTimeoutError: the lighthouse answers but too few islands came.
    """
    deadline = time.monotonic() + config.quorum_timeout_s
    while True:
        left = max(deadline - time.monotonic(), 0.5)
        asked = time.monotonic()
        try:
            manager.start_quorum(timeout=seconds(left))
            manager.wait_quorum()
            return
        except TimeoutError as err:
            forget_failed_quorum(manager)
            if watch.away_since(asked):  # away while asking: the request is stale, ask anew
                deadline = time.monotonic() + config.quorum_timeout_s
                continue
            raise quorum_error(config, watch.away_since(last_round_at)) from err


def quorum_error(config: ElasticConfig, away_s: float) -> MembershipError:
    """The error of a quorum that did not come, naming the likely cause."""
    name, timeout = config.island_id, config.quorum_timeout_s
    if lighthouse_problem(config.lighthouse) is not None:
        return LighthouseLostError(
            f"island {name!r}: the lighthouse at {config.lighthouse} stopped answering and did "
            f"not come back within quorum_timeout_s={timeout}; this island stops here (its "
            "last checkpoint is intact). Keep the lighthouse running, or restart it on the "
            "same address within quorum_timeout_s and the islands go on."
        )
    if away_s:
        return SwarmGoneError(
            f"island {name!r} was suspended or starved for {away_s:.0f} s (past its timeouts), "
            f"and no quorum formed in the quorum_timeout_s={timeout} after it continued: the "
            "swarm ended or lost its other islands meanwhile. Its last checkpoint holds its "
            "progress; restart it once the swarm runs again."
        )
    return QuorumTimeoutError(
        f"island {name!r}: fewer islands than the lighthouse's --min-islands met within "
        f"quorum_timeout_s={timeout}; start more islands, lower --min-islands, or raise "
        "quorum_timeout_s."
    )


class QuorumIdentity:
    """Sets a process group up for every quorum, under a store prefix no earlier set-up used.

    torchft keeps a group while the quorum id repeats, but a restarted lighthouse counts ids
    anew and islands then decide differently and hang (``docs/elastic.md``). So every quorum's
    group is set up under its name (id, members, ``max_step``: new for every quorum of one
    lighthouse, as a failed round is counted); across a restart a repeated name fails its
    set-up within the round timeout and the next quorum has a new id.
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._pending: str | None = None
        tap_quorums(manager, self._see)

    def _see(self, quorum: Any) -> None:  # the same name on every member of the quorum
        name = f"{quorum.quorum_id}/{','.join(quorum.replica_ids)}/{quorum.max_step}"
        self._pending = hashlib.sha256(name.encode()).hexdigest()[:16]
        set_up_group_for_this_quorum(self._manager)

    def store_prefix(self, store_addr: str) -> str:
        return f"{store_addr}/{self._pending}"


class QuorumWatch:
    """Warns once when quorums leave live islands out (a lighthouse join timeout shorter than
    a round): a member missing from a header and back with its nonce was alive all along; one
    return may be a suspended island, so it takes ``RETURNS_TO_WARN``."""

    def __init__(self, island_id: str) -> None:
        self.island_id = island_id
        self.returns = 0
        self._previous: set[tuple[int, int]] = set()
        self._missing: set[tuple[int, int]] = set()
        self._warned = False

    def see(self, rows: Sequence[HeaderRow]) -> None:
        members = {(r.island, r.nonce) for r in rows}
        self.returns += len(members & self._missing)
        self._missing = (self._missing | self._previous) - members
        self._previous = members
        if self.returns >= RETURNS_TO_WARN and not self._warned:
            self._warned = True
            warnings.warn(
                f"island {self.island_id!r}: live islands were left out of quorums and came back "
                f"({self.returns} times so far): the lighthouse's join timeout is shorter than a "
                "round, so quorums form without islands still in their inner steps, and a slower "
                "island may never commit a round. torchft's LighthouseServer defaults "
                "join_timeout_ms to 100 ms; start the lighthouse with `swarm-lighthouse` (60 s "
                "by default) or set --join-timeout-ms above the time of one round (sync_every "
                "inner steps plus the round).",
                UserWarning,
                stacklevel=2,
            )
