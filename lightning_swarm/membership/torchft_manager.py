"""One rank's torchft Manager: its process group, heal transport and quorum identity.

``start_manager`` builds a rank's ``Manager``. With one per island, rank 0 fans out; with one per
rank, position 0 hosts the island's manager server (the lighthouse's one client) through which
every position asks for the quorum and votes, and rank r's group joins rank r of every island.
``IslandStore`` is the island's ``TCPStore`` on position 0. ``RankManager`` holds the Manager, its
group and heal transport until ``TorchftMembership.close``.
"""

from __future__ import annotations

import datetime
import functools
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.errors import LighthouseUnreachableError, MembershipError
from lightning_swarm.membership.fanout import IslandFanout
from lightning_swarm.membership.quorum import QuorumIdentity, quorum_retries_for
from lightning_swarm.membership.torchft_private import check_torchft


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


@dataclass
class IslandStore:
    """Where the island's Managers meet: ``host:port`` of a TCPStore hosted by position 0."""

    host: str
    port: int
    server: dist.TCPStore | None = None  # the hosting position's own handle, kept alive

    @classmethod
    def host_here(cls) -> IslandStore:
        host = socket.gethostname()
        server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return cls(host, server.port, server)

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, address: str) -> IslandStore:
        host, _, port = address.rpartition(":")
        return cls(host, int(port))


@dataclass
class RankManager:
    """One rank's Manager and what it was built with."""

    manager: Any
    pg: Any
    heal_transport: Any
    store: IslandStore


def start_island_managers(
    config: ElasticConfig,
    fanout: IslandFanout,
    *,
    per_rank: bool,
    load_fn: Callable[[Any], None],
    state_fn: Callable[[], Any],
    on_phase: Callable[[str], None],
) -> RankManager | None:
    """This rank's Manager: position 0's (which hosts the island's store) first, then, per
    rank, every other position's. ``None`` on a rank that does not talk to torchft (fan-out).

    Collective over the island (``fanout``).

    Raises:
        LighthouseUnreachableError: on every rank of the island, when a position could not
            reach the lighthouse (or position 0's manager server).
    """
    start = functools.partial(
        start_manager,
        config,
        world_size=fanout.size if per_rank else 1,
        load_fn=load_fn,
        state_fn=state_fn,
        on_phase=on_phase,
    )
    parts = fanout.on_leader(lambda: start(IslandStore.host_here(), rank=0), None)
    if not per_rank:
        return parts
    address = fanout.share_text(parts.store.address() if parts is not None else "")
    error = None
    if not fanout.is_leader:
        try:
            parts = start(IslandStore.parse(address), rank=fanout.position)
        except MembershipError as err:
            error = err
    fanout.agree_round(error, committed=True, healed=False)
    return parts


def start_manager(
    config: ElasticConfig,
    store: IslandStore,
    *,
    rank: int,
    world_size: int,
    load_fn: Callable[[Any], None],
    state_fn: Callable[[], Any],
    on_phase: Callable[[str], None],
) -> RankManager:
    """Build the Manager of position ``rank`` of an island of ``world_size`` ranks.

    Position 0 must be built first: it starts the manager server that the others find in the
    store. Collective with nothing; talks to the lighthouse at position 0 only.

    Raises:
        LighthouseUnreachableError: the lighthouse (or position 0's manager server) did not
            answer within ``config.connect_timeout_s``.
        TorchftVersionError: the installed torchft lacks a private name this package uses.
    """
    check_torchft()  # before any thread of torchft's runs: an upgrade fails here, by name
    from torchft.manager import Manager

    from lightning_swarm.membership.heal import TensorHealTransport
    from lightning_swarm.membership.quorum_group import QuorumGroup

    holder: list[QuorumIdentity] = []
    # torchft takes one timeout at construction for everything (set-ups, RPCs, heals, votes):
    # the base one here; the membership passes each round's own (which grows with its
    # payload) to the calls that take one and to the group's collectives.
    base = seconds(config.timeouts.base_s)
    # Set up in torchft's quorum thread for every quorum, under the quorum's own prefix.
    pg = QuorumGroup(
        base,
        prefix=lambda store_addr: holder[0].store_prefix(store_addr),
        on_setup=lambda: on_phase("pg_setup"),
    )
    heal_transport = TensorHealTransport(pg, on_phase=on_phase)
    try:
        manager = Manager(
            pg=pg,
            load_state_dict=load_fn,
            state_dict=state_fn,
            min_replica_size=config.min_islands,
            use_async_quorum=True,
            timeout=base,
            quorum_timeout=seconds(config.quorum_timeout_s),
            connect_timeout=seconds(config.connect_timeout_s),
            rank=rank,
            world_size=world_size,
            store_addr=store.host,
            store_port=store.port,
            lighthouse_addr=config.lighthouse,
            replica_id=config.island_id,
            checkpoint_transport=heal_transport,
            init_sync=True,
            quorum_retries=quorum_retries_for(config.quorum_timeout_s),
        )
    except RuntimeError as err:
        raise LighthouseUnreachableError(
            f"island {config.island_id!r} could not reach the lighthouse at "
            f"{config.lighthouse} within connect_timeout_s={config.connect_timeout_s}: "
            f"{str(err).splitlines()[0][:200]}. Start it with `swarm-lighthouse "
            "--min-islands N --port P` and pass its address as lighthouse=http://host:P."
        ) from err
    holder.append(QuorumIdentity(manager))  # kept alive by ``pg``'s prefix
    return RankManager(manager, pg, heal_transport, store)
