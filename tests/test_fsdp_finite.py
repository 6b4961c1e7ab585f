"""Model-sharded islands agree on one finite verdict per island (2 islands x 2 ranks, gloo).

Under FSDP the ranks of an island hold different shards, so a NaN can sit in one rank's shard
only. Its peer group alone would see it: that group would raise while the island's other peer
groups went on with the round, and the island's ranks would part ways mid-collective. With the
island group given to the transport, every rank of every island raises the same error.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from lightning_swarm.config import SwarmConfig
from lightning_swarm.outer import OuterLoop
from lightning_swarm.outer.build import transport_for
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.checks import NonFinitePseudoGradientError
from lightning_swarm.transport.groups import build_groups
from tests.dist_utils import run_ranks


def _round_with_one_bad_shard(rank: int, world: int, quantize: str, out: Path) -> None:
    topology = IslandTopology(world_size=world, island_size=2, global_rank=rank)
    groups = build_groups(topology)
    config = SwarmConfig(island_size=2, island_parallel="fsdp", sync_every=1, quantize=quantize)
    # This rank's shard of a parameter (sizes differ by position, as FSDP's uneven shards do).
    shard = torch.nn.Parameter(torch.full((3 - topology.local_index,), 0.5))
    optimizer = torch.optim.SGD([shard], lr=0.1)
    loop = OuterLoop(
        [optimizer],
        {id(shard): "w"},
        config=config,
        transport=transport_for(
            config,
            groups.peers,
            num_islands=2,
            island_index=topology.island_index,
            device=torch.device("cpu"),
            island_group=groups.island,
        ),
        num_islands=2,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7),
    )
    outcome = "synced"
    try:
        with torch.no_grad():
            shard.add_(float("nan") if rank == 1 else 0.1)  # island 0, position 1 only
        loop.on_inner_step(optimizer)
    except NonFinitePseudoGradientError as err:
        outcome = str(err)
    finally:
        loop.close()
        groups.destroy()
    (out / f"rank{rank}").write_text(outcome)


@pytest.mark.parametrize("quantize", ["none", "int8"], ids=["streamed", "quantized"])
def test_a_nan_in_one_shard_stops_every_rank(tmp_path: Path, quantize: str) -> None:
    run_ranks(_round_with_one_bad_shard, 4, quantize, tmp_path, timeout_s=60)
    for rank in range(4):
        outcome = (tmp_path / f"rank{rank}").read_text()
        assert "the pseudo-gradient of island(s) [0] holds NaN or inf" in outcome, (rank, outcome)
