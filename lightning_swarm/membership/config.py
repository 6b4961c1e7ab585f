"""Which membership a ``SwarmConfig`` asks for, and torchft's options, checked before launch.

``elastic_options`` returns ``None`` for the static membership (refusing a ``lighthouse`` or
``island_id`` given with it) and an ``ElasticConfig`` for torchft, after refusing the swarm
transport, whose multi-exchange rounds do not fit a torchft round; refusals name the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_swarm.config import ROUND_TIMEOUT_FLOOR_S, SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.membership.static import check_membership
from lightning_swarm.transport.link import LinkTimeouts


@dataclass(frozen=True)
class ElasticConfig:
    """Where the lighthouse is, who this island is, and how long to wait.

    Attributes:
        lighthouse: the lighthouse's address, e.g. ``http://host:29510``.
        island_id: this island's name, unique among live islands.
        min_islands: a round commits only with at least this many islands in it.
        quorum_timeout_s: how long a round waits for ``min_islands`` islands; also how long
            rounds may keep falling short of ``min_islands`` before the island gives up.
        round_timeout_s: bound on every collective, heal and commit gate of a round; a dead
            peer is noticed within it. ``None`` derives it per round (``timeouts``).
        connect_timeout_s: how long to try to reach the lighthouse at start.
    """

    lighthouse: str
    island_id: str
    min_islands: int = 2
    quorum_timeout_s: float = 60.0
    round_timeout_s: float | None = None
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.lighthouse, str) or not self.lighthouse:
            raise SwarmConfigError(
                "membership='torchft' needs lighthouse='http://host:port' (the address "
                "`swarm-lighthouse` prints)."
            )
        if not isinstance(self.island_id, str) or not self.island_id or ":" in self.island_id:
            raise SwarmConfigError(
                f"island_id must be a non-empty name without ':', got {self.island_id!r}; give "
                "each launch its own, e.g. island_id=a."
            )
        if isinstance(self.min_islands, bool) or not isinstance(self.min_islands, int):
            raise SwarmConfigError(f"min_islands must be an integer >= 1, got {self.min_islands!r}")
        if self.min_islands < 1:
            raise SwarmConfigError(f"min_islands must be >= 1, got {self.min_islands}")
        for name in ("quorum_timeout_s", "round_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if name == "round_timeout_s" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                derive = " (or None to derive it per round)" if name == "round_timeout_s" else ""
                raise SwarmConfigError(
                    f"{name} must be a positive number of seconds{derive}, got {value!r}"
                )

    @property
    def timeouts(self) -> LinkTimeouts:
        """Where a round's timeout comes from: ``round_timeout_s`` as set, or derived from the
        round's payload and this rank's measured link rate, at least ``ROUND_TIMEOUT_FLOOR_S``
        (``transport.link``)."""
        return LinkTimeouts("round_timeout_s", ROUND_TIMEOUT_FLOOR_S, self.round_timeout_s)


def elastic_options(config: SwarmConfig) -> ElasticConfig | None:
    """``None`` for ``membership="static"``; the checked torchft options otherwise.

    Raises:
        ValueError: an option that needs the other membership, or one torchft cannot serve.
    """
    if check_membership(config.membership) == "static":
        # With a lighthouse or island id, this launch would silently train alone.
        for option in ("lighthouse", "island_id"):
            value = getattr(config, option)
            if value is not None:
                raise SwarmConfigError(
                    f"{option}={value!r} is used only with membership='torchft', but membership="
                    f"'static': this launch would train alone, ignoring it. Set membership="
                    f"'torchft' to join the swarm at the lighthouse, or drop {option}."
                )
        return None
    if config.transport != "allreduce":
        raise SwarmConfigError(
            f"membership='torchft' does not support transport={config.transport!r}: the "
            "rotating aggregator's rounds span several exchanges and a spool, while a torchft "
            "round is one quorum, one mean and one commit. Use transport='allreduce' with "
            "elastic islands (quantize, fragments and sync_delay work with it), or "
            "membership='static'."
        )
    return ElasticConfig(
        lighthouse=config.lighthouse or "",
        island_id=config.island_id or "",
        min_islands=config.min_islands,
        quorum_timeout_s=config.quorum_timeout_s,
        round_timeout_s=config.round_timeout_s,
    )
