"""Model-sharded islands agree on one finite verdict per island (2 islands x 2 ranks, gloo).

Under FSDP the ranks of an island hold different shards, so a NaN can sit in one rank's shard
only. Its peer group alone would see it: that group would raise while the island's other peer
groups went on with the round, and the island's ranks would part ways mid-collective. With the
island group given to the transport, every rank of every island raises the same error.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from lightning_swarm.config import SwarmConfig, SwarmTransportConfig
from lightning_swarm.outer import OuterLoop
from lightning_swarm.outer.loop import transport_for
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.errors import NonFinitePseudoGradientError
from lightning_swarm.transport.groups import build_groups
from tests.dist_utils import run_ranks
from tests.transport_rounds import average


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


def _swarm_round(rank: int, world: int, max_norm: float, aggregator: str, out: Path) -> None:
    """Island 1's shards each stay under ``max_norm`` while the island as a whole exceeds 1.0."""
    topology = IslandTopology(world_size=world, island_size=2, global_rank=rank)
    groups = build_groups(topology)
    config = SwarmConfig(
        island_size=2,
        island_parallel="fsdp",
        sync_every=1,
        transport="swarm",
        swarm=SwarmTransportConfig(offload=False, max_norm=max_norm, aggregator=aggregator),
    )
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
        outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
    )
    try:
        with torch.no_grad():
            # norms: island 0 0.1 x sqrt(5); island 1 0.5 x sqrt(3) and 0.5 x sqrt(2) per
            # shard (0.87, 0.71), 0.5 x sqrt(5) = 1.12 over the island
            shard.add_(0.1 if topology.island_index == 0 else 0.5)
        loop.on_inner_step(optimizer)
    finally:
        loop.close()
        groups.destroy()
    torch.save(
        {"anchor": loop.outer_syncs[0].anchors["w"].clone(), "param": shard.detach().clone()},
        out / f"rank{rank}.pt",
    )


@pytest.mark.parametrize("aggregator", ["rotating", "sharded"])
@pytest.mark.parametrize(("max_norm", "expected"), [(1.0, 0.6), (2.0, 0.8)])
def test_swarm_max_norm_bounds_the_island_norm(
    tmp_path: Path, max_norm: float, expected: float, aggregator: str
) -> None:
    """max_norm=1.0 rejects island 1 in both shards' rounds (anchor 0.5 + 0.1: island 0
    alone); max_norm=2.0 accepts both (0.5 + mean(0.1, 0.5))."""
    run_ranks(_swarm_round, 4, max_norm, aggregator, tmp_path, timeout_s=60)
    for rank in range(4):
        info = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        want = torch.full((3 - rank % 2,), expected)
        torch.testing.assert_close(info["anchor"], want, rtol=0, atol=1e-6)
        torch.testing.assert_close(info["param"], want, rtol=0, atol=1e-6)


def _disk_full(fd: int, data: memoryview, offset: int) -> int:
    raise OSError(28, "No space left on device")


def _spool_fails_on_one_shard(rank: int, world: int, out: Path) -> None:
    """Round 0's aggregators are island 0's ranks; rank 0's spool cannot be written."""
    from lightning_swarm.transport.aggregator.spool import Spool
    from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator

    topology = IslandTopology(world_size=world, island_size=2, global_rank=rank)
    groups = build_groups(topology)
    spool = Spool(out / "spool", write_at=_disk_full if rank == 0 else os.pwrite)
    transport = SwarmAggregator(
        groups.peers,
        num_islands=2,
        island_index=topology.island_index,
        spool=spool,
        chunk_bytes=4096,
        island_group=groups.island,
    )
    tensors = {"w": torch.full((4096,), float(1 + topology.island_index))}
    outcome = "applied"
    try:
        stats = average(transport, tensors, round_index=0)
        outcome = "applied" if stats.applied else "skipped"
    except Exception as err:
        outcome = type(err).__name__
    finally:
        transport.close()
        groups.destroy()
    torch.save({"outcome": outcome, "w": tensors["w"][:4].clone()}, out / f"rank{rank}.pt")


def test_a_failed_aggregator_skips_the_round_on_every_shard(tmp_path: Path) -> None:
    """The other shard's aggregator (rank 1) validated fine, yet skips: no shard of any island
    takes a mean that another shard of it did not take."""
    run_ranks(_spool_fails_on_one_shard, 4, tmp_path, timeout_s=60)
    infos = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    assert infos[0]["outcome"] == "SwarmRoundError"  # its own spool failed
    assert infos[1]["outcome"] == "skipped" and infos[3]["outcome"] == "skipped"
    for rank in (1, 3):  # unchanged: each island keeps its own values
        assert torch.equal(infos[rank]["w"], torch.full((4,), float(1 + rank // 2)))
