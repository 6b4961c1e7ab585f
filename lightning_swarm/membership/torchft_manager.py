"""One rank's torchft Manager and what it is handed: the quorum's group and the heal transport.

Imports torchft: import it only when membership is torchft.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchft.checkpointing.transport import CheckpointTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroup, ProcessGroupGloo

from lightning_swarm.membership.config import ElasticConfig, seconds
from lightning_swarm.membership.errors import LighthouseUnreachableError, MembershipError
from lightning_swarm.membership.fanout import IslandFanout
from lightning_swarm.membership.quorum import QuorumIdentity, quorum_retries_for
from lightning_swarm.membership.state_wire import decode_tree, encode_tree, receive_buffers
from lightning_swarm.membership.torchft_private import (
    check_torchft,
    create_gloo_group,
    install_group,
    record_group_args,
)
from lightning_swarm.transport.link import set_backend_timeout

KEPT_STORES = 4
CONNECT_WAITS = 5  # gloo's first connects wait this many times its timeout (waitUntilConnected)
_TAG_LENGTH, _TAG_HEADER, _TAG_FIRST_TENSOR = 1, 2, 3


class QuorumGroup(ProcessGroupGloo):
    """torchft's gloo group, set up for each quorum on a kept store connection: torchft's
    ``configure`` opens a ``TCPStore`` client per set-up, and such connects sometimes hang
    (``docs/elastic.md``). ``prefix`` maps torchft's store address to the quorum's
    (``QuorumIdentity``); ``on_setup`` is a test's fault hook. ``timeout`` bounds store connects
    and, a fifth of it, gloo's first connects; collectives get ``collective_timeout``."""

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
        """torchft 0.2.0's ``configure`` for gloo, on a kept store client (quorum thread)."""
        self._on_setup()
        args = (replica_id, rank, quorum_id, group_rank, group_world_size, global_ranks)
        record_group_args(self, *args)
        self.abort(errored=False)
        address, _, prefix = self._prefix(store_addr).partition("/")
        try:
            store = dist.PrefixStore(prefix, self._store(address))
            # gloo waits five times its timeout for a group's first connects, all of it when a
            # peer froze right after publishing its address: the connects get a fifth.
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
        set_backend_timeout(pg, self.collective_timeout, torch.device("cpu"))
        install_group(self, pg)


class TensorHealTransport(CheckpointTransport[Any]):
    """Heals over ``pg`` without pickle: a JSON header (``state_wire``) plus raw tensor bytes.

    The sender's state does not change during the send (its training thread waits for the
    quorum); received tensors are fresh CPU tensors owned by the caller. The tensors wait
    ``timeout_for(their bytes)`` when set, the rest torchft's ``timeout``.
    """

    def __init__(self, pg: ProcessGroup, on_phase: Callable[[str], None]) -> None:
        self._pg = pg
        self._on_phase = on_phase  # the fault hook (tests): "heal_send" / "heal_recv"
        self.timeout_for: Callable[[int], datetime.timedelta] | None = None
        self.last_heal_bytes = 0
        self.last_heal_s = 0.0

    def _wait(self, works: list[Any], nbytes: int, timeout: datetime.timedelta) -> None:
        wait = timeout if self.timeout_for is None else self.timeout_for(nbytes)
        for work in works:
            work.wait(wait)

    def metadata(self) -> str:
        return "lightning_swarm-tensor-heal"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: datetime.timedelta
    ) -> None:
        header, tensors = encode_tree({"step": step, "state": state_dict})
        length = torch.tensor([len(header)], dtype=torch.int64)
        header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        for dst in dst_ranks:
            works = [
                self._pg.send([length], dst, tag=_TAG_LENGTH),
                self._pg.send([header_t], dst, tag=_TAG_HEADER),
            ]
            self._on_phase("heal_send")
            works += [
                self._pg.send([t], dst, tag=_TAG_FIRST_TENSOR + i)
                for i, t in enumerate(tensors)
                if t.numel()
            ]
            self._wait(works, sum(t.numel() for t in tensors), timeout)

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: datetime.timedelta
    ) -> Any:
        start = time.perf_counter()
        length = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([length], src_rank, tag=_TAG_LENGTH).wait(timeout)
        if not 0 < int(length.item()) < 1 << 31:
            raise ValueError(f"a healing peer announced a header of {int(length.item())} B")
        header_t = torch.empty(int(length.item()), dtype=torch.uint8)
        self._pg.recv([header_t], src_rank, tag=_TAG_HEADER).wait(timeout)
        header = header_t.numpy().tobytes()
        self._on_phase("heal_recv")
        payload = receive_buffers(header)
        works = [
            self._pg.recv([t], src_rank, tag=_TAG_FIRST_TENSOR + i)
            for i, t in enumerate(payload)
            if t.numel()
        ]
        self._wait(works, sum(t.numel() for t in payload), timeout)
        tree = decode_tree(header, payload)
        if not isinstance(tree, dict) or tree.get("step") != step:
            raise ValueError(f"a healing peer sent the state of another step (expected {step})")
        self.last_heal_bytes = sum(t.numel() for t in payload)
        self.last_heal_s = time.perf_counter() - start
        return tree["state"]


@dataclass
class RankManager:
    """One rank's Manager; ``store`` keeps the island's ``TCPStore`` alive where it is hosted."""

    manager: Any
    pg: QuorumGroup
    heal_transport: TensorHealTransport
    store: dist.TCPStore | None = None


def start_island_managers(
    config: ElasticConfig,
    fanout: IslandFanout,
    *,
    per_rank: bool,
    load_fn: Callable[[Any], None],
    state_fn: Callable[[], Any],
    on_phase: Callable[[str], None],
) -> RankManager | None:
    """This rank's Manager; ``None`` on a rank that does not talk to torchft (fan-out). Position
    0 hosts the island's store and manager server (the lighthouse's one client) and starts
    first; rank r's group joins rank r of every island. Collective over the island.

    Raises:
        LighthouseUnreachableError: on every rank, when a position could not reach the
            lighthouse (or position 0's manager server) in ``connect_timeout_s``.
        TorchftVersionError: the installed torchft lacks a private name this package uses.
    """
    # torchft takes one timeout for everything (set-ups, RPCs, heals, votes): the base one;
    # the membership passes each round's own to the calls that take one and to the group.
    base = seconds(config.timeouts.base_s)

    def start(host: str, port: int, rank: int) -> RankManager:
        check_torchft()  # before any thread of torchft's runs: an upgrade fails here, by name
        holder: list[QuorumIdentity] = []
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
                world_size=fanout.size if per_rank else 1,
                store_addr=host,
                store_port=port,
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
        return RankManager(manager, pg, heal_transport)

    parts: RankManager | None = None

    def host() -> str:
        nonlocal parts
        store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
        parts = start(socket.gethostname(), store.port, rank=0)
        parts.store = store
        return f"{socket.gethostname()}:{store.port}"

    address = fanout.on_leader(host, "")
    if per_rank:
        error = None
        if not fanout.is_leader:
            name, _, port = address.rpartition(":")
            try:
                parts = start(name, int(port), rank=fanout.position)
            except MembershipError as err:
                error = err
        fanout.share_error(error)
    return parts
