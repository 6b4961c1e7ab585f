"""The quantized mean of a round's pseudo-gradients over the quorum, flat in islands.

The static path's quantized reduce-scatter runs here over the quorum's torchft gloo group, which
lacks reduce-scatter but forwards ``alltoall_base``. Every member owns a share, an island being
healed too; it contributes zeros and the owners divide by ``manager.num_participants()``. Every
island decodes the same encoded mean, so anchors stay bitwise equal. A failed exchange is
reported to the manager, so the commit gate votes no and the garbage is never applied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import AllToAllOptions

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.membership.torchft_private import quorum_rank
from lightning_swarm.transport.reduce_scatter import coded_bucket_mean


def coded_quorum_mean(manager: Any, pg: Any, runs: list[Tensor], codec: Codec) -> int:
    """Overwrite one bucket's ``runs`` (flat float32 CPU views, each starting on a codec block
    of its tensor) with their quantized mean over the quorum; returns the bytes this island
    sent (= received), 0 when the exchange failed."""
    # The island's place in the quorum is the order of the round header's rows, too.
    num_islands, island_index = pg.size(), quorum_rank(pg)
    divisor = max(manager.num_participants(), 1)
    if not manager.is_participating():
        for run in runs:
            run.zero_()

    def exchange(send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        if num_islands == 1:
            return send
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        pg.alltoall_base(received, send, recv_sizes, send_sizes, AllToAllOptions()).wait()
        return received

    try:
        return coded_bucket_mean(
            runs,
            codec=codec,
            num_islands=num_islands,
            island_index=island_index,
            divisor=divisor,
            exchange=exchange,
            device=torch.device("cpu"),
        )
    except Exception as err:  # a dead peer: the commit gate turns this into a "no"
        manager.report_error(err)
        return 0
