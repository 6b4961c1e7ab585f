"""The transport factory, the peer group's backend (a gloo side group for NCCL worlds) and the
profiler labels of a round, over real gloo process groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport import (
    AllReduceTransport,
    ReduceScatterTransport,
    SwarmAggregator,
    SwarmTransportConfig,
    build_transport,
    peer_backend,
)
from lightning_swarm.transport.groups import build_groups
from tests.dist_utils import run_ranks
from tests.transport_rounds import average

AGG = "lightning_swarm::aggregator::"
TRANSPORT = "lightning_swarm::transport::"


def test_peer_backend_asks_for_gloo_only_for_the_swarm_transport_beside_nccl() -> None:
    assert peer_backend("swarm", "nccl") == "gloo"
    assert peer_backend("swarm", "gloo") is None
    assert peer_backend("allreduce", "nccl") is None
    with pytest.raises(ValueError, match="transport='pigeon' is not known"):
        peer_backend("pigeon", "gloo")


def _groups_worker(rank: int, world: int, out: str) -> None:
    topology = IslandTopology(world_size=world, island_size=1, global_rank=rank)
    # As in an NCCL world: the swarm transport asks for a side group; here it is exercised
    # with gloo, the backend it asks for.
    groups = build_groups(topology, backend="gloo", peer_backend=peer_backend("swarm", "nccl"))
    assert groups.peers is not None and groups.peers is not dist.group.WORLD
    assert groups.peers in groups.created
    assert dist.get_backend(groups.peers) == "gloo"
    common = {
        "num_islands": world,
        "island_index": rank,
        "codec": None,
        "bucket_numel": 2**18,
        "swarm": SwarmTransportConfig(offload=False),
    }
    # The accelerator's device is what the strategy passes with NCCL: the swarm transport
    # still works on the CPU (this machine has no CUDA, so any CUDA buffer would fail).
    swarm = build_transport("swarm", group=groups.peers, device=torch.device("cuda"), **common)
    assert isinstance(swarm, SwarmAggregator) and swarm.device == torch.device("cpu")
    tensors = {"w": torch.full((5,), float(rank))}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert average(swarm, tensors, round_index=0).applied
    assert torch.equal(tensors["w"], torch.full((5,), (world - 1) / 2))
    labels = sorted({e.name for e in prof.events() if e.name.startswith(AGG)})
    swarm.close()
    cpu = torch.device("cpu")
    plain = build_transport("allreduce", group=None, device=cpu, **common)
    coded = build_transport(
        "allreduce", group=None, device=cpu, **common | {"codec": codec_for("int8")}
    )
    assert isinstance(plain, AllReduceTransport) and isinstance(coded, ReduceScatterTransport)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        average(plain, {"w": torch.ones(4)}, round_index=0)
        average(coded, {"w": torch.ones(4)}, round_index=0)
    labels += sorted({e.name for e in prof.events() if e.name.startswith(TRANSPORT)})
    Path(out, f"{rank}.json").write_text(json.dumps(labels))
    groups.destroy()


def test_factory_builds_each_transport_and_the_swarm_one_runs_on_a_gloo_side_group(
    tmp_path: Path,
) -> None:
    run_ranks(_groups_worker, 2, str(tmp_path))
    aggregator = json.loads((tmp_path / "0.json").read_text())
    peer = json.loads((tmp_path / "1.json").read_text())
    labels = [AGG + "aggregate", AGG + "receive", AGG + "round", AGG + "send"]
    reduce = [TRANSPORT + name for name in ("allreduce", "gather_means", "reduce_scatter")]
    reduce += [TRANSPORT + "reduce_share", TRANSPORT + "scatter_shares"]
    assert aggregator == labels + reduce
    assert peer == [AGG + "receive", AGG + "round", AGG + "send", *reduce]
