"""Quantized reduce-scatter + all-gather: the mean of encoded pseudo-gradients, flat in islands.

Each island owns a share of every bucket (``buckets.plan_shares``), sums the islands' decoded
contributions in island order and encodes the mean once; every island decodes those same bytes,
so anchors stay bitwise equal. Result: ``decode(encode(mean_i decode(encode(x_i))))``,
independent of buckets and shares (pieces start on their tensors' blocks), so error feedback
with the same codec stays exact. Sizes follow from piece lengths: no header travels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.allreduce import AllReduceTransport
from lightning_swarm.transport.base import Bucket, Done, Handle
from lightning_swarm.transport.buckets import Piece, check_bucket, numel_of, placed, plan_shares
from lightning_swarm.transport.link import LinkTimeouts

# (send, send_sizes, recv_sizes) -> received: one all-to-all of uint8 bytes.
Exchange = Callable[[Tensor, list[int], list[int]], Tensor]


def encode_pieces(
    codec: Codec, flats: Sequence[Tensor], pieces: Sequence[Piece], device: torch.device
) -> Tensor:
    """The payload (uint8, on ``device``) of ``pieces`` of the flat tensors ``flats``."""
    parts = [
        codec.to_bytes(codec.encode(flats[p.tensor_index][p.start : p.stop].to(device)))
        for p in pieces
    ]
    return _joined(parts, torch.uint8, device)


def decode_flat(codec: Codec, payload: Tensor, pieces: Sequence[Piece]) -> Tensor:
    """Decode the payload of ``pieces`` into one new flat float32 tensor, pieces back to back."""
    parts = []
    offset = 0
    for p in pieces:
        size = codec.encoded_nbytes(p.length)
        parts.append(codec.decode(codec.from_bytes(payload[offset : offset + size], p.length)))
        offset += size
    if offset != payload.numel():
        raise ValueError(
            f"a payload of {payload.numel()} bytes does not hold pieces of {offset} bytes; "
            "islands disagree on the layout (same model, quantize and block_size everywhere?)."
        )
    return _joined(parts, torch.float32, payload.device)


def _joined(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def reduce_scatter_bytes(share_nbytes: Sequence[int], island_index: int) -> int:
    """Bytes one rank sends (= receives) for a bucket whose shares encode to ``share_nbytes``:
    every other share out, then its own share's encoded mean to n - 1 islands."""
    others = sum(share_nbytes) - share_nbytes[island_index]
    return others + (len(share_nbytes) - 1) * share_nbytes[island_index]


@torch.no_grad()
def coded_bucket_mean(
    runs: list[Tensor],
    *,
    codec: Codec,
    num_islands: int,
    island_index: int,
    divisor: int,
    exchange: Exchange,
    device: torch.device,
) -> int:
    """Overwrite ``runs`` (one bucket's flat float32 views, each starting on a codec block of
    its tensor) with the decoded, encoded sum over the islands divided by ``divisor``
    (collective through ``exchange``); returns the bytes this rank sent (= received)."""
    bucket = [Piece(i, 0, run.numel()) for i, run in enumerate(runs)]
    shares = plan_shares(bucket, num_islands, codec.block_size)
    sizes = [sum(codec.encoded_nbytes(p.length) for p in share) for share in shares]
    own = shares[island_index]
    with record_function(labels.SCATTER_SHARES):
        payload = torch.cat([encode_pieces(codec, runs, share, device) for share in shares])
        contributions = exchange(payload, sizes, [sizes[island_index]] * num_islands)
        del payload
    with record_function(labels.REDUCE_SHARE):
        size = contributions.numel() // num_islands  # an empty share: empty throughout
        total = torch.zeros(numel_of(own), dtype=torch.float32, device=device)
        for island in range(num_islands):  # fixed order: the same float sum everywhere
            total.add_(decode_flat(codec, contributions[island * size : (island + 1) * size], own))
        total.div_(divisor)
        flat = [Piece(0, at, p.length) for at, p in placed(own)]
        mean = encode_pieces(codec, [total], flat, device)
        del contributions
    with record_function(labels.GATHER_MEANS):
        means = exchange(mean.repeat(num_islands), [mean.numel()] * num_islands, sizes)
        del mean
    offset = 0
    for share, size in zip(shares, sizes, strict=True):
        # Every island decodes the same bytes, its own share's included: bitwise equal.
        values = decode_flat(codec, means[offset : offset + size], share)
        for at, p in placed(share):
            runs[p.tensor_index][p.start : p.stop].copy_(values[at : at + p.length])
        offset += size
    return reduce_scatter_bytes(sizes, island_index)


class ReduceScatterTransport(AllReduceTransport):
    """``AllReduceTransport``'s round with ``codec``-encoded buckets (module docstring);
    ``island_index`` is this rank's rank in ``group``. Only while a bucket is in flight it holds
    about four encoded buckets, a float32 share and one decoded share. ``ValueError``:
    ``num_islands < 1``, ``island_index`` outside the group, or a bucket under one block.
    """

    direct_vote = True

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_islands: int,
        island_index: int,
        codec: Codec,
        bucket_numel: int,
        device: torch.device | str = "cpu",
        island_group: dist.ProcessGroup | None = None,
        timeouts: LinkTimeouts | None = None,
    ) -> None:
        if num_islands < 1:
            raise ValueError(f"num_islands must be >= 1, got {num_islands}")
        check_bucket(bucket_numel, codec.block_size)
        super().__init__(
            group, num_islands=num_islands, bucket_numel=bucket_numel, device=device,
            island_group=island_group, timeouts=timeouts,
        )  # fmt: skip
        if not 0 <= island_index < num_islands:
            raise ValueError(
                f"island_index={island_index} is outside the peer group of {num_islands} "
                "islands; pass this rank's rank in the peer group."
            )
        self.island_index = island_index
        self.codec = codec
        self.block_size = codec.block_size

    def _position(self) -> int:
        return self.island_index

    @record_function(labels.REDUCE_SCATTER)
    def start(self, bucket: Bucket) -> Handle:
        """Average ``bucket`` in place now, each run encoded on its own blocks (scaled by the
        engine first, under ``work``); the handle is complete."""
        with self.link.explained():
            sent = coded_bucket_mean(
                bucket.run_views(), codec=self.codec, num_islands=self.num_islands,
                island_index=self.island_index, divisor=self.num_islands,
                exchange=self._exchange, device=self.device,
            )  # fmt: skip
        self.link.arrived()
        return Done(sent)

    def _exchange(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        if self.num_islands == 1:
            return send
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=self.group)
        return received
