"""Which membership a ``SwarmConfig`` asks for, and torchft's options, checked before launch.

``static``: the islands are the blocks of one torch.distributed world, all in every round.
``torchft``: islands meet at a lighthouse and may fail, restart and join.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from lightning_swarm.config import ROUND_TIMEOUT_FLOOR_S, SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.transport.link import LinkTimeouts

MEMBERSHIPS = ("static", "torchft")


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def check_membership(name: object) -> str:
    """``name`` if it is a known membership; ``ValueError`` naming the choices otherwise."""
    if name not in MEMBERSHIPS:
        raise SwarmConfigError(
            f"membership must be one of {list(MEMBERSHIPS)}, got {name!r}; 'static' is one "
            "torch.distributed world, 'torchft' lets islands fail, restart and join through a "
            "lighthouse (pip install 'lightning-swarm[elastic]')."
        )
    return str(name)


@dataclass(frozen=True)
class ElasticConfig:
    """Where the lighthouse is, who this island is (unique among live islands), how long to wait.

    ``quorum_timeout_s`` also bounds how long rounds may fall short of ``min_islands``;
    ``round_timeout_s`` bounds a round's collectives, heal and vote (``None``: ``timeouts``).
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
        if "://" not in self.lighthouse:
            # torchft's client takes the address as a URI: without a scheme it never connects,
            # and reports a running lighthouse unreachable after connect_timeout_s.
            raise SwarmConfigError(
                f"lighthouse={self.lighthouse!r} has no scheme, and torchft connects only to a "
                f"URL (without one it reports a running lighthouse unreachable); give "
                f"lighthouse='http://{self.lighthouse}' (the address `swarm-lighthouse` prints)."
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
            if value is None and name == "round_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                derive = " (or None to derive it per round)" if name == "round_timeout_s" else ""
                raise SwarmConfigError(
                    f"{name} must be a positive number of seconds{derive}, got {value!r}"
                )

    @property
    def timeouts(self) -> LinkTimeouts:
        """``round_timeout_s``, or derived from a round's payload and link rate."""
        return LinkTimeouts("round_timeout_s", ROUND_TIMEOUT_FLOOR_S, self.round_timeout_s)


def elastic_options(config: SwarmConfig) -> ElasticConfig | None:
    """``None`` for ``membership="static"``; the checked torchft options otherwise (``ValueError``
    for an option of the other membership, or one torchft cannot serve)."""
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
