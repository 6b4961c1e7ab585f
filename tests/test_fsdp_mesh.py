"""Island meshes (``transport.groups.build_island_mesh``): every island its own (dp, tp) mesh.

4 gloo ranks, no training: the ranks each mesh dimension spans, row-major positions, and that a
rank's peer group (same position in every island) is the same (dp, tp) coordinate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.groups import build_groups, build_island_mesh
from tests.dist_utils import run_ranks


def _describe(rank: int, world: int, island_size: int, tp: int, out: Path) -> None:
    topology = IslandTopology(world_size=world, island_size=island_size, global_rank=rank)
    groups = build_groups(topology)
    mesh = build_island_mesh(topology, tp, device_type="cpu")
    try:
        dp_mesh, tp_mesh = mesh.mesh["data_parallel"], mesh.mesh["tensor_parallel"]
        info = {
            "dp_ranks": sorted(dist.get_process_group_ranks(dp_mesh.get_group())),
            "tp_ranks": sorted(dist.get_process_group_ranks(tp_mesh.get_group())),
            "coordinate": (dp_mesh.get_local_rank(), tp_mesh.get_local_rank()),
            "island_group_is_dp": groups.island is dp_mesh.get_group(),
            "shape": mesh.shape,
        }
        # a sum over the dp dimension stays inside the island: never across islands
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=dp_mesh.get_group())
        info["dp_sum"] = float(value)
    finally:
        mesh.destroy()
        groups.destroy()
    torch.save(info, out / f"rank{rank}.pt")


@pytest.mark.parametrize(
    ("island_size", "tp", "dp_ranks", "tp_ranks"),
    [
        # 2 islands of (dp 2 x tp 1)
        (2, 1, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0], [1], [2], [3]]),
        # 2 islands of (dp 1 x tp 2)
        (2, 2, [[0], [1], [2], [3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),
        # 1 island of (dp 2 x tp 2): positions row-major, tp fastest
        (4, 2, [[0, 2], [1, 3], [0, 2], [1, 3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ],
    ids=["2x(2x1)", "2x(1x2)", "1x(2x2)"],
)
def test_island_mesh_layout(
    tmp_path: Path, island_size: int, tp: int, dp_ranks: list, tp_ranks: list
) -> None:
    run_ranks(_describe, 4, island_size, tp, tmp_path, timeout_s=60)
    infos = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for rank, info in enumerate(infos):
        position = rank % island_size
        assert info["dp_ranks"] == dp_ranks[rank], rank
        assert info["tp_ranks"] == tp_ranks[rank], rank
        assert info["coordinate"] == divmod(position, tp), rank
        assert info["shape"] == {"data_parallel": island_size // tp, "tensor_parallel": tp}
        assert not info["island_group_is_dp"]  # the island group is the outer round's alone
        assert info["dp_sum"] == float(sum(dp_ranks[rank])), rank
