"""Asking the lighthouse for a round's quorum, and saying why none came.

torchft asks a lost lighthouse again only ``quorum_retries`` times, so ``quorum_retries_for``
spaces retries ``RETRY_SPACING_S`` apart to find one restarted within ``quorum_timeout_s``; a
failed quorum is cleared from the Manager (``forget_failed_quorum``) so the island can ask anew;
an island back from a suspension asks again with a whole timeout. Every way out other than a
quorum is a ``MembershipError`` saying which: the lighthouse is gone, too few islands came, or
the island came back to find no swarm.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import socket
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.errors import (
    LighthouseLostError,
    MembershipError,
    QuorumTimeoutError,
    SwarmGoneError,
)
from lightning_swarm.membership.suspension import SuspensionWatch
from lightning_swarm.membership.torchft_private import (
    forget_failed_quorum,
    set_up_group_for_this_quorum,
    tap_quorums,
)

RETRY_SPACING_S = 1.0
"""How often the manager server asks a lighthouse that did not answer, roughly."""


def quorum_retries_for(quorum_timeout_s: float) -> int:
    """torchft's ``quorum_retries`` that spaces its attempts about ``RETRY_SPACING_S`` apart."""
    return max(1, math.ceil(quorum_timeout_s / RETRY_SPACING_S))


def lighthouse_problem(address: str, timeout_s: float = 2.0) -> str | None:
    """Why nothing accepts a TCP connection at the lighthouse's ``address`` within
    ``timeout_s`` (the address has no host or port, or the connect's error); ``None`` when
    something does."""
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


def request_quorum(
    manager: Any, config: ElasticConfig, watch: SuspensionWatch, last_round_at: float
) -> None:
    """This round's quorum from ``manager``, within ``config.quorum_timeout_s``.

    ``last_round_at`` is when this island last committed a round (monotonic): if it was away
    since then and finds no quorum, the swarm went on without it, or ended.

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
            manager.start_quorum(timeout=datetime.timedelta(seconds=left))
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

    torchft keeps a quorum's group while the lighthouse hands out the same quorum id, but a
    restarted lighthouse counts ids from the start again, and whether an island still holds a
    usable group is its own knowledge: islands then decide differently and hang
    (``docs/elastic.md``). So the decision comes from the quorum alone, which every member
    receives alike: this class sees each quorum on its way to the Manager
    (``torchft_private.tap_quorums``) and has torchft set the group up anew, under a prefix named
    by the quorum's id, members and ``max_step``. Within one lighthouse's life that name is new
    for every quorum (a committed round raises ``max_step``; one committed nowhere is reported
    by ``count_commit_failure``, on which the lighthouse raises the id). Across a restart a
    repeated name fails its set-up within about twice the round timeout, is reported, and the
    next quorum has a new id. The price is one group set-up per round.
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._pending: str | None = None
        tap_quorums(manager, self._see)  # the quorum is visible only on its way to torchft

    def _see(self, quorum: Any) -> None:
        self._pending = quorum_name(quorum.quorum_id, quorum.replica_ids, quorum.max_step)
        set_up_group_for_this_quorum(self._manager)

    def store_prefix(self, store_addr: str) -> str:
        """The store address for setting up the pending quorum's group."""
        return f"{store_addr}/{self._pending}"


def quorum_name(quorum_id: int, replica_ids: Sequence[str], max_step: int) -> str:
    """A quorum's name: the same on every member, new for every quorum of one lighthouse."""
    members = ",".join(replica_ids)
    return hashlib.sha256(f"{quorum_id}/{members}/{max_step}".encode()).hexdigest()[:16]


class ShortRounds:
    """Raises once rounds keep falling short of ``min_islands`` for ``quorum_timeout_s``."""

    def __init__(self, config: ElasticConfig) -> None:
        self.config = config
        self._short_since: float | None = None

    def see(self, participants: int, committed: bool) -> None:
        """One round's islands and vote.

        Raises:
            QuorumTimeoutError: every round of the last ``quorum_timeout_s`` fell short.
        """
        if participants >= self.config.min_islands or committed:
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
