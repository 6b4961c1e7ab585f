"""Process groups for islands and peer groups, built from an ``IslandTopology``.

``torch.distributed.new_group`` is collective over the whole world: every rank must create every
group, in the same order, even the groups it is not a member of. This module is the one place
that does so, so the order cannot drift between ranks.

The peer group may use another backend than the island groups (``peer_backend``): in an NCCL
world the swarm transport's CPU traffic runs on a gloo peer group created beside the NCCL
groups (``factory.peer_backend`` says when).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_swarm.topology import IslandTopology


@dataclass
class SwarmGroups:
    """The groups one rank takes part in.

    Attributes:
        island: this rank's island (DDP's group); ``None`` when islands are single ranks.
        peers: this rank's peer group across islands (the transport's group); ``None`` when there
            is a single island, or the default group when every rank is its own island (unless
            ``build_groups`` was asked for a dedicated one).
        created: groups created here, destroyed by ``destroy``.
    """

    island: dist.ProcessGroup | None
    peers: dist.ProcessGroup | None
    created: list[dist.ProcessGroup]

    def destroy(self) -> None:
        for group in self.created:
            dist.destroy_process_group(group)
        self.created.clear()


def build_groups(
    topology: IslandTopology,
    backend: str | None = None,
    *,
    dedicated_peers: bool = False,
    peer_backend: str | None = None,
    timeout: timedelta | None = None,
) -> SwarmGroups:
    """Create the island and peer groups for ``topology`` (collective on every rank).

    With ``dedicated_peers`` the peer group is always a group of its own, never the default
    group: a transport driven from a background thread must not share a group with the
    training thread's collectives (their order would differ between ranks). A
    ``peer_backend`` (e.g. ``"gloo"`` in an NCCL world) also gives the peer group a group of
    its own, with that backend. ``timeout`` bounds every collective of the new groups
    (``None``: torch's default, not the world's).
    """
    if peer_backend is not None:
        dedicated_peers = True
    created: list[dist.ProcessGroup] = []
    island: dist.ProcessGroup | None = None
    peers: dist.ProcessGroup | None = None
    if topology.island_size > 1:
        for index in range(topology.num_islands):
            group = dist.new_group(topology.island_ranks(index), backend=backend, timeout=timeout)
            if index == topology.island_index:
                island = _member(group)
                created.append(island)
    if topology.num_islands > 1:
        if topology.island_size == 1 and not dedicated_peers:
            peers = dist.group.WORLD
        else:
            for local in range(topology.island_size):
                group = dist.new_group(
                    topology.peer_ranks(local), backend=peer_backend or backend, timeout=timeout
                )
                if local == topology.local_index:
                    peers = _member(group)
                    created.append(peers)
    return SwarmGroups(island=island, peers=peers, created=created)


def _member(group: object) -> dist.ProcessGroup:
    """The group handle of a group this rank belongs to.

    ``new_group`` returns a sentinel for non-members (typed as such from torch 2.14 on); every
    caller here asks only for groups that contain this rank.
    """
    assert isinstance(group, dist.ProcessGroup), "asked for a group this rank is not in"
    return group
