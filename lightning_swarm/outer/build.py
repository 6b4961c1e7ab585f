"""Which transport a ``SwarmConfig`` asks for, built over the peer group (never lightning).

The strategy calls ``build_transport`` once per fit, at setup, and hands the result to the
``OuterLoop``, which owns it from then on and closes it. ``codec_of`` is the one place that
turns the ``quantize`` options into a ``Codec``, for the transport and for error feedback alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.config import SwarmConfig
from lightning_swarm.transport import (
    AllReduceTransport,
    QuantizedTransport,
    SwarmTransport,
    Transport,
)


def codec_of(config: SwarmConfig) -> Codec:
    """The codec the ``quantize`` and ``quantize_block_size`` options name."""
    return Codec(config.quantize, config.quantize_block_size)


def staging_device(root_device: torch.device) -> torch.device:
    """Where transport buckets live: NCCL reduces device tensors only, so under NCCL a bucket
    visits the rank's accelerator (anchors stay put); any other backend stages on the CPU."""
    return root_device if dist.get_backend() == "nccl" else torch.device("cpu")


def build_transport(
    config: SwarmConfig,
    peers: dist.ProcessGroup | None,
    *,
    num_islands: int,
    island_index: int,
    device: torch.device,
) -> Transport:
    """The transport ``config`` names, averaging over ``peers`` (this rank's peer group).

    ``device`` is where buckets are staged: the accelerator under NCCL (it reduces device
    tensors only), the CPU otherwise; anchors stay on their own device either way.
    """
    if config.transport == "swarm":
        options = config.swarm
        return SwarmTransport(
            peers,
            num_islands=num_islands,
            island_index=island_index,
            offload=options.offload,
            spool_dir=options.spool_dir,
            aggregation=options.aggregation,
            trim_ratio=options.trim_ratio,
            min_contributions=options.min_contributions,
            max_norm=options.max_norm,
            island_weights=options.island_weights,
            chunk_bytes=options.chunk_bytes,
            cleanup_timeout_s=options.cleanup_timeout_s,
            device=device,
            codec=codec_of(config) if config.quantize != "none" else None,
        )
    if config.quantize != "none":
        return QuantizedTransport(
            peers,
            num_islands=num_islands,
            codec=codec_of(config),
            bucket_numel=config.bucket_numel,
            device=device,
        )
    return AllReduceTransport(
        peers,
        num_islands=num_islands,
        bucket_numel=config.bucket_numel,
        device=device,
    )
