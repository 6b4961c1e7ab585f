"""Which membership a ``SwarmConfig`` asks for, checked before any process starts.

``elastic_options`` returns ``None`` for the static membership (nothing to build) and an
``ElasticConfig`` for torchft, after refusing the options that do not work with it yet: the
swarm transport, quantized pseudo-gradients and Streaming DiLoCo (fragments, delayed rounds).
Their rounds span several exchanges or steps, while a torchft round is one quorum, one mean and
one commit; each refusal names the option and the fix.
"""

from __future__ import annotations

from lightning_swarm.algorithm.codecs import NO_CODEC
from lightning_swarm.config import SwarmConfig
from lightning_swarm.membership.static import check_membership
from lightning_swarm.membership.torchft import ElasticConfig


def elastic_options(config: SwarmConfig) -> ElasticConfig | None:
    """``None`` for ``membership="static"``; the checked torchft options otherwise."""
    if check_membership(config.membership) == "static":
        return None
    refused = {
        "transport": (config.transport != "allreduce", "transport=allreduce"),
        "quantize": (config.quantize != NO_CODEC, f"quantize={NO_CODEC}"),
        "num_fragments": (config.num_fragments != 1, "num_fragments=1"),
        "sync_delay": (config.sync_delay != 0, "sync_delay=0"),
    }
    for option, (bad, fix) in refused.items():
        if bad:
            raise ValueError(
                f"membership='torchft' does not support {option}={getattr(config, option)!r} "
                f"yet; use {fix} with elastic islands, or membership='static'."
            )
    return ElasticConfig(
        lighthouse=config.lighthouse or "",
        island_id=config.island_id or "",
        min_islands=config.min_islands,
        quorum_timeout_s=config.quorum_timeout_s,
        round_timeout_s=config.round_timeout_s,
    )
