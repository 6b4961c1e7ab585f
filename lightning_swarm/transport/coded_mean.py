"""One bucket's quantized mean by reduce-scatter and all-gather, over any exchange.

The arithmetic of ``reduce_scatter.py`` (result and error: its docstring) without
``torch.distributed``: the caller hands in an ``Exchange`` (``dist.all_to_all_single`` for the
static peer group, torchft's process group for an elastic quorum: ``torchft_quorum.py``).
The owner divides the sum by ``divisor``: n for the static group, the participants for a quorum
(an island being healed sends zeros and is not counted). Every island still decodes the same
encoded mean, so the result is bitwise equal on every island whatever the divisor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.buckets import Piece, numel_of
from lightning_swarm.transport.pieces import (
    decode_flat,
    encode_flat,
    encode_pieces,
    encoded_nbytes,
    plan_shares,
    write_flat,
)

Exchange = Callable[[Tensor, list[int], list[int]], Tensor]
"""(send, send_sizes, recv_sizes) -> received: one all-to-all of uint8 bytes."""


def reduce_scatter_bytes(share_nbytes: Sequence[int], island_index: int) -> int:
    """Bytes one rank sends (and receives) for one bucket whose shares encode to
    ``share_nbytes``: every other share out (and its own share's n - 1 contributions in), then
    its encoded mean to n - 1 islands (and every other share's mean in)."""
    others = sum(share_nbytes) - share_nbytes[island_index]
    return others + (len(share_nbytes) - 1) * share_nbytes[island_index]


@torch.no_grad()
def coded_bucket_mean(
    flats: list[Tensor],
    bucket: list[Piece],
    *,
    codec: Codec,
    num_islands: int,
    island_index: int,
    divisor: int,
    exchange: Exchange,
    device: torch.device,
) -> int:
    """Overwrite ``bucket``'s pieces of ``flats`` with the decoded, encoded mean over the
    islands (collective through ``exchange``); returns the bytes this rank sent (= received).
    """
    shares = plan_shares(bucket, num_islands, codec.block_size)
    sizes = [encoded_nbytes(codec, share) for share in shares]
    own = shares[island_index]
    with record_function(labels.SCATTER_SHARES):
        payload = torch.cat([encode_pieces(codec, flats, share, device) for share in shares])
        contributions = exchange(payload, sizes, [sizes[island_index]] * num_islands)
        del payload
    with record_function(labels.REDUCE_SHARE):
        mean = _encoded_mean(codec, contributions, own, num_islands, divisor, device)
        del contributions
    with record_function(labels.GATHER_MEANS):
        means = exchange(mean.repeat(num_islands), [mean.numel()] * num_islands, sizes)
        del mean
    offset = 0
    for share, size in zip(shares, sizes, strict=True):
        # Every island decodes the same bytes, its own share's included: bitwise equal.
        write_flat(flats, share, decode_flat(codec, means[offset : offset + size], share))
        offset += size
    return reduce_scatter_bytes(sizes, island_index)


def _encoded_mean(
    codec: Codec,
    contributions: Tensor,
    own: list[Piece],
    num_islands: int,
    divisor: int,
    device: torch.device,
) -> Tensor:
    """The encoded mean of this island's share from the n islands' encoded contributions
    (back to back, island order 0 .. n - 1), their sum divided by ``divisor``."""
    if not own:
        return torch.empty(0, dtype=torch.uint8, device=device)
    size = contributions.numel() // num_islands
    total = torch.zeros(numel_of(own), dtype=torch.float32, device=device)
    for island in range(num_islands):  # fixed order: the same float sum everywhere
        raw = contributions[island * size : (island + 1) * size]
        total.add_(decode_flat(codec, raw, own))
    return encode_flat(codec, total.div_(divisor), own)
