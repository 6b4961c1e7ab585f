"""The quorum's process group: torchft's gloo group, set up once per quorum on a kept store.

torchft's ``ProcessGroupGloo.configure`` opens a new ``TCPStore`` client per set-up, and such
connects sometimes hang until the timeout (``docs/elastic.md``). ``QuorumGroup`` keeps one client
per store address (at most ``KEPT_STORES``) and sets every group up on a ``PrefixStore`` of it; a
client whose set-up failed is dropped and the next set-up connects anew.
"""

from __future__ import annotations

import datetime
from collections import OrderedDict
from collections.abc import Callable

import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo

from lightning_swarm.membership.torchft_private import (
    create_gloo_group,
    install_group,
    record_group_args,
    set_collective_timeout,
)

KEPT_STORES = 4
CONNECT_WAITS = 5
"""gloo's first connects wait this many times the group's timeout (``Pair::waitUntilConnected``)."""


class QuorumGroup(ProcessGroupGloo):
    """torchft's gloo group; ``configure`` sets it up on a kept store connection.

    ``prefix`` maps the store address torchft asks for (``host:port/torchft/<id>/<rank>``) to the
    one to use (``QuorumIdentity.store_prefix``); ``on_setup`` runs first (a test's fault hook).
    The group's private fields are written through ``torchft_private``. ``timeout`` bounds its
    store connects and, a fifth of it, gloo's first connects; the collectives of the groups set
    up later get ``collective_timeout`` (``timeout`` until the owner sets the round's, which grows
    with its payload, before the quorum request that sets the next one up).
    """

    def __init__(
        self,
        timeout: datetime.timedelta,
        prefix: Callable[[str], str],
        on_setup: Callable[[], None],
    ) -> None:
        super().__init__(timeout=timeout)
        self._round_timeout = timeout
        self.collective_timeout = timeout
        self._prefix = prefix
        self._on_setup = on_setup
        self._stores: OrderedDict[str, dist.TCPStore] = OrderedDict()

    def _store(self, address: str) -> dist.TCPStore:
        store = self._stores.pop(address, None)
        if store is None:
            host, _, port = address.rpartition(":")
            store = dist.TCPStore(
                host.strip("[]"),
                int(port),
                is_master=False,
                wait_for_workers=False,
                timeout=self._round_timeout,
            )
        self._stores[address] = store  # the most recent last
        while len(self._stores) > KEPT_STORES:
            self._stores.popitem(last=False)
        return store

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """What torchft 0.2.0's ``ProcessGroupWrapper.configure`` does for gloo, but on a kept
        store client (runs in torchft's quorum thread)."""
        self._on_setup()
        record_group_args(
            self,
            replica_id=replica_id,
            rank=rank,
            quorum_id=quorum_id,
            group_rank=group_rank,
            group_world_size=group_world_size,
            global_ranks=global_ranks,
        )
        self.abort(errored=False)
        address, _, prefix = self._prefix(store_addr).partition("/")
        try:
            # The rendezvous waits on the store for up to the round timeout.
            store = dist.PrefixStore(prefix, self._store(address))
            # gloo waits five times its timeout for a group's first connects, all of it when a
            # peer froze right after publishing its address (50 s at round_timeout_s=10, seen
            # in the chaos benchmark), so the connects get a fifth of the base timeout and the
            # collectives the round's timeout.
            pg = create_gloo_group(
                self,
                store,
                rank,
                world_size,
                connect_timeout=self._round_timeout / CONNECT_WAITS,
                collective_timeout=self.collective_timeout,
            )
        except Exception:
            self._stores.pop(address, None)  # maybe broken: connect anew next time
            raise
        set_collective_timeout(pg, self.collective_timeout)
        install_group(self, pg)
