"""The transport a ``SwarmConfig`` asks for, over this rank's peer group; built once per fit,
owned and closed by the ``OuterLoop``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_swarm.algorithm.codecs import Codec, codec_for
from lightning_swarm.config import DEFAULT_TIMEOUT_S, SwarmConfig
from lightning_swarm.transport import Transport, build_transport
from lightning_swarm.transport.link import LinkTimeouts


def codec_of(config: SwarmConfig) -> Codec | None:
    """The codec the ``quantize`` and ``quantize_block_size`` options name (``None``: none)."""
    return codec_for(config.quantize, config.quantize_block_size)


def staging_device(root_device: torch.device) -> torch.device:
    """Where transport buckets live: NCCL reduces device tensors only, so under NCCL a bucket
    visits the rank's accelerator (anchors stay put); any other backend stages on the CPU."""
    return root_device if dist.get_backend() == "nccl" else torch.device("cpu")


def transport_for(
    config: SwarmConfig,
    peers: dist.ProcessGroup | None,
    *,
    num_islands: int,
    island_index: int,
    device: torch.device,
    island_group: dist.ProcessGroup | None = None,
) -> Transport:
    """The transport ``config`` names, averaging over ``peers``; buckets are staged on
    ``device``; ``island_group`` is given for model-sharded islands only."""
    timeouts = LinkTimeouts("timeout_s", DEFAULT_TIMEOUT_S, config.timeout_s)
    return build_transport(
        config.transport,
        group=peers,
        num_islands=num_islands,
        island_index=island_index,
        device=device,
        codec=codec_of(config),
        bucket_numel=config.bucket_numel,
        swarm=config.swarm,
        island_group=island_group,
        timeouts=timeouts,
    )
