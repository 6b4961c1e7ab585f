"""Asking the lighthouse for a round's quorum, and saying why none came.

``request_quorum`` is the first phase of every elastic round. It rests on these facts about
torchft 0.2.0, measured on this machine:

- The island's manager server forwards a quorum request to the lighthouse; when that fails (the
  lighthouse is down) it asks again only ``quorum_retries`` times, reconnecting in between and
  spacing the attempts ``timeout / (quorum_retries + 1)`` apart (at least 0.1 s). Without
  retries the island's request then hangs until its timeout, and a lighthouse restarted
  meanwhile never hears from it: a lighthouse restart ended every island.
  ``quorum_retries_for`` asks again about every ``RETRY_SPACING_S``, so a lighthouse restarted
  on its address within ``quorum_timeout_s`` is found again and the swarm goes on.
- A failed quorum stays in the Manager's future and its next ``start_quorum`` raises it again;
  ``_forget_failed_quorum`` clears it so that the island can ask anew.
- A process stopped with SIGSTOP (or starved) keeps its monotonic clock running, so its
  request times out the moment it continues. When ``SuspensionWatch`` saw the island away
  during a request, the swarm went on without it: it asks again with a whole
  ``quorum_timeout_s`` (it is behind, and that quorum heals it) instead of giving up at once.

Invariant: every way out of ``request_quorum`` other than a quorum is a ``MembershipError``
whose message says which of three things happened: the lighthouse is gone, too few islands
came, or the island came back from a suspension to find no swarm.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import socket
import time
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

RETRY_SPACING_S = 1.0
"""How often the manager server asks a lighthouse that did not answer, roughly."""


def quorum_retries_for(quorum_timeout_s: float) -> int:
    """torchft's ``quorum_retries`` that spaces its attempts about ``RETRY_SPACING_S`` apart."""
    return max(1, math.ceil(quorum_timeout_s / RETRY_SPACING_S))


def lighthouse_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether anything accepts a TCP connection at the lighthouse's address."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _forget_failed_quorum(manager: Any) -> None:
    # torchft 0.2.0 keeps the failed future and re-raises it from the next start_quorum.
    manager._quorum_future = None


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
            _forget_failed_quorum(manager)
            if watch.away_since(asked):  # away while asking: the request is stale, ask anew
                deadline = time.monotonic() + config.quorum_timeout_s
                continue
            raise quorum_error(config, watch.away_since(last_round_at)) from err


def quorum_error(config: ElasticConfig, away_s: float) -> MembershipError:
    """The error of a quorum that did not come, naming the likely cause."""
    name, timeout = config.island_id, config.quorum_timeout_s
    if not lighthouse_answers(config.lighthouse):
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
    """Sets a quorum's process group up anew whenever its membership is new to this island.

    torchft sets the process group up again only when the lighthouse's quorum id changes, under
    the store prefix ``torchft/<quorum id>``. A restarted lighthouse counts its ids from the
    start again, so a quorum after a restart can carry the id of an older one with other
    members: measured in the chaos benchmark, two islands kept the group of the old quorum
    (four members) for a new one of two and waited out the round timeout. This wrapper of the
    Manager's client names each quorum by its id and its members, forces a new set-up when that
    name differs from the one the current group was built for, and appends the name to the
    store prefix, so no two memberships share rendezvous keys. Every member of a quorum gets
    the same id and members, so all of them decide alike.
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._client = manager._client
        manager._client = self  # torchft 0.2.0: the quorum result is only visible here
        self._pending: str | None = None
        self._current: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        members = ",".join(result.replica_ids)
        name = hashlib.sha256(f"{result.quorum_id}/{members}".encode()).hexdigest()[:16]
        if name != self._current:
            self._manager._quorum_id = -1  # torchft then sets the group up for this quorum
        self._pending = name
        return result

    def store_prefix(self, store_addr: str) -> str:
        """The store address for setting up the pending quorum's group."""
        return f"{store_addr}/{self._pending}"

    def set_up(self) -> None:
        """The pending quorum's group is set up (a failed set-up is retried next round)."""
        self._current = self._pending


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
