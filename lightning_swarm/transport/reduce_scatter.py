"""Quantized reduce-scatter + all-gather: the mean of encoded pseudo-gradients, flat in islands.

An all-reduce cannot sum int8 or int4 codes (each island's block scales differ). Instead each of
the n islands owns a share of every bucket (whole codec blocks, ``transport.pieces``): every
island encodes its shares and sends share j to island j (``all_to_all_single``); the owner
decodes the n contributions in island order, sums them in float32, divides by n and encodes the
mean once; a second ``all_to_all_single`` (shares' sizes differ, and gloo's all-gather wants
equal ones) hands every island every share's encoded mean, which every island, the owner
included, decodes: the anchors stay bitwise equal. A rank moves about ``2 (n - 1) / n`` of the
encoded bucket (exact bytes: ``docs/scaling.md``).

Result, elementwise: ``decode(encode(mean_i decode(encode(x_i))))``, independent of buckets and
shares since pieces start on the tensors' own blocks, so the caller's error feedback with the same
codec stays exact. Error: ``mean_i`` of each island's codec bound plus ``Codec.error_bound(mean)``;
that second error is the same on every island and is not fed back.

Memory, only while a bucket is in flight: about four encoded buckets (to send, received
contributions, copies of the mean to send, gathered means), a float32 accumulator of one share
and one decoded share at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.base import Bucket, Done, Handle, Opening, RoundRequest, RoundStats
from lightning_swarm.transport.buckets import Piece
from lightning_swarm.transport.checks import agree_finite
from lightning_swarm.transport.coded_mean import coded_bucket_mean
from lightning_swarm.transport.link import LinkTimeouts, LinkWatch
from lightning_swarm.transport.pieces import check_coded_options


class ReduceScatterTransport:
    """Mean over a peer group of codec-encoded tensors by a quantized reduce-scatter and
    all-gather; see the module docstring for the result, its error, bytes and memory.

    Args:
        group: the peer group (one rank per island, group rank = island index); ``None`` means
            the default group.
        num_islands: size of the peer group.
        island_index: this rank's island (its rank in ``group``).
        codec: how payloads are encoded (``Codec("int8", block_size=128)`` etc.).
        bucket_numel: float32 elements per bucket; bounds the extra memory.
        device: where encoding, exchange and accumulation happen (``cuda`` for NCCL, ``cpu``
            for gloo); the caller's tensors stay where they are.
        island_group: a model-sharded island's group: its ranks agree on one finite verdict
            first (``checks.island_verdict``); ``None`` otherwise.
        timeouts: where the peer group's collective timeout comes from (``transport.link``);
            ``None`` keeps the group's own. A timeout or a peer that went away raises
            ``RoundTimeoutError`` or ``PeerLostError`` either way.

    Raises:
        ValueError: ``num_islands < 1``, ``island_index`` outside the group, or
            ``bucket_numel`` below the codec's block size.
    """

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
        check_coded_options(num_islands, codec, bucket_numel)
        if not 0 <= island_index < num_islands:
            raise ValueError(
                f"island_index={island_index} is outside the peer group of {num_islands} "
                "islands; pass this rank's rank in the peer group."
            )
        self.group = group
        self.num_islands = num_islands
        self.island_index = island_index
        self.codec = codec
        self.bucket_numel = bucket_numel
        self.device = torch.device(device)
        self.island_group = island_group
        self.link = LinkWatch(group, num_islands=num_islands, timeouts=timeouts)

    # The contract (``transport.base.Transport``).
    pipelined = True
    heals = False
    every_rank_in_round = False

    @property
    def block_size(self) -> int:
        return self.codec.block_size

    def open(self, request: RoundRequest) -> Opening:
        """Every island agrees on ``finite`` in one message step before any bucket moves
        (``checks.agree_finite``, ``direct=True``); with ``work`` the islands' weights
        ride in the same step. The engine scales its
        contribution before a bucket is started, so it is encoded scaled."""
        self.link.open(request.round_index, request.names)
        with self.link.explained():
            opening = agree_finite(
                request.finite, self.group, self.num_islands, self.device, self.island_group,
                direct=True, work=request.work, island_index=self.island_index,
            )  # fmt: skip
        self.link.started()
        return opening

    @record_function(labels.REDUCE_SCATTER)
    def start(self, bucket: Bucket) -> Handle:
        """Average ``bucket`` in place now (each run encoded on its own blocks, as its tensor's
        would be); the handle is complete."""
        runs = bucket.run_views()
        pieces = [Piece(i, 0, run.numel()) for i, run in enumerate(runs)]
        with self.link.explained():
            sent = coded_bucket_mean(
                runs,
                pieces,
                codec=self.codec,
                num_islands=self.num_islands,
                island_index=self.island_index,
                divisor=self.num_islands,
                exchange=self._exchange,
                device=self.device,
            )
        self.link.arrived()
        return Done(sent)

    def agree(self) -> RoundStats:
        """A round that started every bucket applies (refusals raise at ``open``)."""
        self.link.finished()
        return RoundStats()

    def _exchange(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        """``send`` cut into ``send_sizes`` goes to islands 0 .. n - 1; returns what islands
        0 .. n - 1 sent here, back to back in ``recv_sizes``."""
        if self.num_islands == 1:
            return send
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(
            received,
            send,
            output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes,
            group=self.group,
        )
        return received

    def close(self) -> None:
        """Nothing to release: buffers live only inside ``start``."""
