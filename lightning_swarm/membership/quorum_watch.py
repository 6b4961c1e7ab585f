"""Noticing quorums that leave live islands out: a lighthouse whose join timeout is too short.

torchft's lighthouse forms a quorum once ``--min-islands`` islands asked for one and its join
timeout has run out for the earliest of them. DiLoCo islands ask once per round, each when its
inner steps are done, so a join timeout shorter than the spread of those moments (torchft's own
``LighthouseServer`` defaults to 100 ms) forms quorums without islands that are alive and about
to ask. Measured here with it: an island stepping at 0.12 s against two at 0.05 s was left out
of every quorum, healed each time, and never committed a round.

``QuorumWatch`` reads each round header's members, (island id hash, nonce): a member that was
in one round, missing from a later one, and back with the same nonce was alive all along (a
restarted island has a new nonce). After ``returns_to_warn`` such returns it warns once, naming
the setting and the fix. A single return can be a suspended island coming back, so one is not
enough.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lightning_swarm.membership.round_header import HeaderRow


class QuorumWatch:
    """Counts live islands that quorums left out, and warns once (see the module docstring)."""

    def __init__(self, island_id: str, returns_to_warn: int = 2) -> None:
        self.island_id = island_id
        self.returns_to_warn = returns_to_warn
        self.returns = 0
        self._previous: set[tuple[int, int]] = set()
        self._missing: set[tuple[int, int]] = set()
        self._warned = False

    def see(self, rows: Sequence[HeaderRow]) -> None:
        """Take in one round's header rows."""
        members = {(r.island, r.nonce) for r in rows}
        self.returns += len(members & self._missing)
        self._missing = (self._missing | self._previous) - members
        self._previous = members
        if self.returns >= self.returns_to_warn and not self._warned:
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
