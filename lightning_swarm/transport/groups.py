"""Process groups for islands, peer groups and island meshes, built from an ``IslandTopology``.

``new_group`` is collective over the whole world: every rank creates every group in the same
order, even those it is not in. This is the one place that does so, so the order cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_swarm.topology import IslandTopology


@dataclass
class SwarmGroups:
    """The groups one rank takes part in; ``destroy`` destroys those ``created`` here.

    Attributes:
        island: this rank's island (DDP's group); ``None`` when islands are single ranks.
        peers: this rank's peer group across islands (the transport's); ``None`` with a single
            island, the default group when every rank is its own island (unless dedicated).
        between_rounds: this rank's island again, for the training thread's messages between
            rounds (SIGTERM agreement, ``sync_dist`` logs), which must never interleave with a
            round's. ``None`` unless several islands of several ranks.
    """

    island: dist.ProcessGroup | None
    peers: dist.ProcessGroup | None
    created: list[dist.ProcessGroup]
    between_rounds: dist.ProcessGroup | None = None

    def destroy(self) -> None:
        _destroy(self.created)


def _destroy(created: list[dist.ProcessGroup]) -> None:
    for group in created:
        dist.destroy_process_group(group)
    created.clear()


def build_groups(
    topology: IslandTopology,
    backend: str | None = None,
    *,
    dedicated_peers: bool = False,
    peer_backend: str | None = None,
    island_backend: str | None = None,
    timeout: timedelta | None = None,
) -> SwarmGroups:
    """Create the island and peer groups for ``topology`` (collective on every rank).

    ``dedicated_peers`` (implied by a ``peer_backend``) never reuses the default group for the
    peers: a transport on a background thread must not share a group with the training
    thread's collectives. ``island_backend`` overrides ``backend`` for the island groups
    (model-sharded islands, whose island group carries the swarm transport's CPU agreement).
    ``timeout`` bounds the new groups' collectives (``None``: torch's default).
    """
    if peer_backend is not None:
        dedicated_peers = True
    island: dist.ProcessGroup | None = None
    peers: dist.ProcessGroup | None = None
    islands = [topology.island_ranks(i) for i in range(topology.num_islands)]
    if topology.island_size > 1:
        (island,) = _own_groups(
            islands, [topology.island_index], island_backend or backend, timeout
        )
    if topology.num_islands > 1:
        if topology.island_size == 1 and not dedicated_peers:
            peers = dist.group.WORLD
        else:
            peer_lists = [topology.peer_ranks(i) for i in range(topology.island_size)]
            (peers,) = _own_groups(
                peer_lists, [topology.local_index], peer_backend or backend, timeout
            )
    between_rounds: dist.ProcessGroup | None = None
    if topology.island_size > 1 and topology.num_islands > 1:
        (between_rounds,) = _own_groups(islands, [topology.island_index], backend, timeout)
    created = [g for g in (island, peers, between_rounds) if g not in (None, dist.group.WORLD)]
    return SwarmGroups(island=island, peers=peers, created=created, between_rounds=between_rounds)


def _own_groups(
    rank_lists: list[list[int]], mine: list[int], backend: str | None, timeout: timedelta | None
) -> list[dist.ProcessGroup]:
    """Create one group per rank list (every rank, in order) and return ``mine`` of them."""
    groups = [dist.new_group(ranks, backend=backend, timeout=timeout) for ranks in rank_lists]
    # ``new_group`` returns a sentinel for non-members (typed as such from torch 2.14 on).
    member = [g for i in mine if isinstance(g := groups[i], dist.ProcessGroup)]
    assert len(member) == len(mine), "asked for a group this rank is not in"
    return member


MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")
PIPELINE_DIM = "pipeline_parallel"


@dataclass
class IslandMesh:
    """One rank's view of its island's device mesh: ``(data_parallel, tensor_parallel)``, with
    a leading ``pipeline_parallel`` dimension when the island has pipeline stages.

    Position ``p`` in an island sits at ``(stage, dp, tp)`` in row-major order, so ranks at the
    same position of every island hold the same stage and shard (the topology's peer group).
    ``mesh`` never has an island dimension (that would be HSDP). ``destroy`` the ``created``
    groups after the module that used them is gone.
    """

    mesh: DeviceMesh
    data_parallel_size: int
    tensor_parallel_size: int
    created: list[dist.ProcessGroup]
    pipeline_parallel_size: int = 1

    @property
    def shape(self) -> dict[str, int]:
        """``{"data_parallel": dp, "tensor_parallel": tp}`` (and ``"pipeline_parallel"`` with
        stages), as checkpoints record it."""
        dp, tp = self.data_parallel_size, self.tensor_parallel_size
        shape = {"data_parallel": dp, "tensor_parallel": tp}
        if self.pipeline_parallel_size > 1:
            shape = {PIPELINE_DIM: self.pipeline_parallel_size, **shape}
        return shape

    def coordinates(self, position: int) -> tuple[int, int, int]:
        """``(stage, dp, tp)`` of island position ``position``."""
        stage, rest = divmod(position, self.data_parallel_size * self.tensor_parallel_size)
        return (stage, *divmod(rest, self.tensor_parallel_size))

    def destroy(self) -> None:
        _destroy(self.created)


def build_island_mesh(
    topology: IslandTopology,
    tensor_parallel_size: int,
    *,
    device_type: str,
    backend: str | None = None,
    pipeline_parallel_size: int = 1,
) -> IslandMesh:
    """The device mesh of this rank's island (collective on every rank), by
    ``DeviceMesh.from_group`` (``init_device_mesh`` builds one mesh over the whole world only).
    The data-parallel group is never ``SwarmGroups.island``, even with the same ranks: that one
    carries the outer round's agreement, maybe on the sync worker's thread, while FSDP's
    collectives run on the training thread.
    """
    pp, tp = pipeline_parallel_size, tensor_parallel_size
    dp = topology.island_size // (tp * pp)
    shape = (pp, dp, tp)
    lists: list[list[int]] = []
    mine: list[int] = []
    coordinates = None
    for island in range(topology.num_islands):
        grid = torch.tensor(topology.island_ranks(island)).view(shape)
        # Per mesh dimension, one group along it through every point of the other two.
        for dim in ((0,) if pp > 1 else ()) + (1, 2):
            lines = grid.movedim(dim, -1).reshape(-1, shape[dim]).tolist()
            for line in lines:
                if island == topology.island_index and topology.global_rank in line:
                    mine.append(len(lists))
                lists.append(line)
        if island == topology.island_index:
            coordinates = grid
    assert coordinates is not None
    created = _own_groups(lists, mine, backend, None)
    # DeviceMesh.from_group takes one group per dimension, in the mesh's dimension order.
    names = ((PIPELINE_DIM,) if pp > 1 else ()) + MESH_DIM_NAMES
    layout = coordinates if pp > 1 else coordinates[0]
    mesh = DeviceMesh.from_group(list(created), device_type, mesh=layout, mesh_dim_names=names)
    return IslandMesh(mesh, dp, tp, created, pipeline_parallel_size=pp)
