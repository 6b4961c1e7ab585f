"""Noticing quorums that leave live islands out: a lighthouse whose join timeout is too short.

A lighthouse forms a quorum once its join timeout ran out for the earliest asker, so a timeout
shorter than the spread of the islands' round ends leaves live islands out (``docs/elastic.md``).
``QuorumWatch`` reads each header's (island id hash, nonce): a member missing from one round and
back with the same nonce was alive all along. After ``RETURNS_TO_WARN`` such returns it warns
once, naming the fix; one return alone may be a suspended island.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lightning_swarm.membership.round_header import HeaderRow

RETURNS_TO_WARN = 2


class QuorumWatch:
    """Counts live islands that quorums left out, and warns once (see the module docstring)."""

    def __init__(self, island_id: str) -> None:
        self.island_id = island_id
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
