"""Gather-based quantized transport: every island's encoded payload goes to every island.

Not what ``quantize`` builds any more: ``transport.reduce_scatter.ReduceScatterTransport``
moves about 2 (n - 1) / n encoded payloads per rank where this one moves n - 1, so this class
stays for comparison (``benchmarks/scaling.py``, docs/scaling.md) and as the reference for
``mean_i decode(encode(x_i))`` without the second encoding of the mean.

An all-reduce cannot sum int8 or int4 codes (each island's block scales differ), so this
transport gathers the encoded payloads and accumulates in float32:

1. The tensors are cut into *pieces* packed into buckets of at most ``bucket_numel`` elements
   (``transport.pieces``). A piece starts at a multiple of the codec's ``block_size`` inside
   its tensor, so every piece is quantized exactly as ``codec.roundtrip(tensor)`` would
   quantize the whole tensor (error feedback computed by the caller with the same codec stays
   exact).
2. Each rank encodes its pieces into one uint8 payload and ``all_gather``s it over the peer
   group (one rank per island, group rank = island index); the payload size follows from the
   shapes, so no header travels.
3. Every rank decodes the payloads in island order 0 .. n-1 and sums them in float32, then
   divides by n. The same operations in the same order on the same bytes give bitwise identical
   results on every rank, including the island's own contribution, which also enters decoded.

The result is ``mean_i decode(encode(x_i))`` for any number of islands; with one island that is
``decode(encode(x))`` and nothing is moved. Extra memory while a bucket is in flight: n encoded
payloads, one float32 accumulator and one decoded payload of ``bucket_numel`` elements each;
nothing is kept between rounds.

Byte accounting: in an all-gather each rank sends its payload to, and receives one from, each of
the other n - 1 islands (the ring all-gather of gloo and NCCL moves exactly that), so
``bytes_sent = bytes_received = (n - 1) * encoded payload bytes``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.checks import agree_finite
from lightning_swarm.transport.pieces import (
    Piece,
    check_coded_options,
    decode_flat,
    encode_pieces,
    flat_views,
    plan_coded_buckets,
    write_flat,
)

__all__ = ["Piece", "QuantizedTransport", "plan_coded_buckets"]


class QuantizedTransport:
    """Mean over a peer group of codec-encoded tensors, gathered and accumulated in float32.

    Args:
        group: the peer group (one rank per island, group rank = island index); ``None`` means
            the default group.
        num_islands: size of the peer group.
        codec: how payloads are encoded (``Codec("int4", block_size=128)`` etc.).
        bucket_numel: float32 elements per bucket; bounds the extra memory (module docstring).
        device: where encoding, gathering and accumulation happen (``cuda`` for NCCL, ``cpu``
            for gloo); the caller's tensors stay where they are.
        island_group: a model-sharded island's group: its ranks agree on one finite verdict
            first (``checks.agree_finite``); ``None`` otherwise.

    Raises:
        ValueError: ``bucket_numel`` below the codec's block size or ``num_islands < 1``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_islands: int,
        codec: Codec,
        bucket_numel: int,
        device: torch.device | str = "cpu",
        island_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_coded_options(num_islands, codec, bucket_numel)
        self.group = group
        self.num_islands = num_islands
        self.codec = codec
        self.bucket_numel = bucket_numel
        self.device = torch.device(device)
        self.island_group = island_group

    @record_function(labels.QUANTIZED)
    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        start = time.perf_counter()
        stats = RoundStats()
        flats = flat_views(tensors, "QuantizedTransport")
        agree_finite(flats, self.group, self.num_islands, self.device, self.island_group)
        numels = [f.numel() for f in flats]
        for bucket in plan_coded_buckets(numels, self.bucket_numel, self.codec.block_size):
            self._average_bucket(flats, bucket, stats)
        stats.wall_s = time.perf_counter() - start
        return stats

    @torch.no_grad()
    def _average_bucket(self, flats: list[Tensor], bucket: list[Piece], stats: RoundStats) -> None:
        payload = encode_pieces(self.codec, flats, bucket, self.device)
        if self.num_islands > 1:
            gathered = [torch.empty_like(payload) for _ in range(self.num_islands)]
            dist.all_gather(gathered, payload, group=self.group)
            moved = (self.num_islands - 1) * payload.numel()
            stats.bytes_sent += moved
            stats.bytes_received += moved
        else:
            gathered = [payload]
        del payload
        total = None
        for island_payload in gathered:  # island order: the float sum is the same on all ranks
            decoded = decode_flat(self.codec, island_payload, bucket)
            total = decoded if total is None else total.add_(decoded)
        assert total is not None
        write_flat(flats, bucket, total.div_(self.num_islands))

    def close(self) -> None:
        """Nothing to release: buckets live only inside ``average``."""
