"""Every private name of torchft (and of torch's gloo group) that elastic membership touches.

One function per name says why no public call serves and what breaks if it changes; each has a
test in ``tests/test_torchft_private.py``. A missing name raises ``TorchftVersionError`` naming
it and the fix (class attributes in ``check_torchft``, instance ones before they are written).
torch's own private names (a group's timeout setter) are used in ``transport/link.py`` only,
whose ``TORCH_PRIVATE_NAMES`` ``check_torchft`` checks with torchft's.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_swarm.membership.errors import TorchftVersionError
from lightning_swarm.transport.link import TORCH_PRIVATE_NAMES

TORCHFT_VERSION = "0.2.0"  # the release whose private names this module was written against

CLASS_NAMES: tuple[tuple[str, str, str], ...] = (
    ("torchft.coordination", "ManagerClient", "_quorum"),
    ("torchft.process_group", "ProcessGroupWrapper", "_create_pg"),
    ("torchft.process_group", "ProcessGroupWrapper", "parent"),
    *TORCH_PRIVATE_NAMES,
)

MANAGER = "torchft.manager.Manager"
GROUP = "torchft.process_group.ProcessGroupWrapper"


def _require(obj: object, owner: str, name: str) -> None:
    if hasattr(obj, name):
        return
    try:
        installed = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        installed = "(not installed)"
    raise TorchftVersionError(
        f"lightning_swarm uses the private {owner}.{name}, which the installed torchft "
        f"{installed} (torch {torch.__version__}) does not have; "
        f"lightning_swarm/membership/torchft_private.py was written for torchft "
        f"{TORCHFT_VERSION}. Install torchft=={TORCHFT_VERSION} "
        "(pip install 'lightning-swarm[elastic]'), or update that module to this torchft."
    )


def check_torchft() -> None:
    """Raise ``TorchftVersionError`` naming the first of ``CLASS_NAMES`` that is missing."""
    for module, cls, name in CLASS_NAMES:
        _require(getattr(importlib.import_module(module), cls), f"{module}.{cls}", name)


def forget_failed_quorum(manager: Any) -> None:
    """Clear ``Manager._quorum_future`` after a failed quorum request: ``start_quorum`` re-raises
    the kept failure, so an island could never ask anew (a lighthouse restart would end it)."""
    _require(manager, MANAGER, "_quorum_future")
    manager._quorum_future = None


def count_commit_failure(manager: Any) -> None:
    """Add one to ``Manager._commit_failures``, which the next quorum request reports: torchft
    counts only votes that returned, and a failed round must get the next quorum a new id, so
    that no member reuses its rendezvous prefix (``quorum.QuorumIdentity``)."""
    _require(manager, MANAGER, "_commit_failures")
    manager._commit_failures += 1


class _QuorumTap:
    """torchft's ``ManagerClient``, with each quorum ``_quorum`` returns shown to ``on_quorum``."""

    def __init__(self, client: Any, on_quorum: Callable[[Any], None]) -> None:
        self._client = client
        self._on_quorum = on_quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self._on_quorum(result)
        return result


def tap_quorums(manager: Any, on_quorum: Callable[[Any], None]) -> None:
    """Have ``on_quorum(quorum)`` see every quorum ``manager`` receives (on torchft's quorum
    thread) before torchft sets the group up, by wrapping ``Manager._client`` and its
    ``ManagerClient._quorum``: nothing else shows a quorum's id, members and ``max_step`` then.
    If either changes, the group is set up under torchft's own prefix."""
    _require(manager, MANAGER, "_client")
    client = manager._client
    _require(client, "torchft.coordination.ManagerClient", "_quorum")
    manager._client = _QuorumTap(client, on_quorum)


def set_up_group_for_this_quorum(manager: Any) -> None:
    """Make torchft set the group up for the quorum it handles now (from ``tap_quorums``'s
    hook): torchft sets up only when the id differs from ``Manager._quorum_id`` (``-1``: none
    yet). If it changes, a quorum with a repeated id keeps a stale group."""
    _require(manager, MANAGER, "_quorum_id")
    manager._quorum_id = -1


def quorum_rank(pg: Any) -> int:
    """This island's rank in the quorum's group ``pg``: the wrapper's ``rank()`` is always 0,
    only ``ProcessGroupWrapper.parent`` (undocumented) knows it. If it changes, every island
    takes share 0 of the coded mean."""
    _require(pg, GROUP, "parent")
    return int(pg.parent.rank())


def record_group_args(
    pg: Any,
    replica_id: str,
    rank: int,
    quorum_id: int | None,
    group_rank: int | None,
    group_world_size: int | None,
    global_ranks: list[int] | None,
) -> None:
    """Record ``configure``'s arguments on ``pg`` in its private fields, as torchft's
    ``configure`` (which ``QuorumGroup`` replaces) does: ``_create_pg`` and ``abort`` read them.
    If they change, groups get torchft's defaults and errors are logged without ids."""
    values = {
        "_replica_id": replica_id,
        "_rank": rank,
        "_quorum_id": quorum_id,
        "_group_rank": group_rank,
        "_group_world_size": group_world_size,
        "_global_ranks": global_ranks,
    }
    for name in values:
        _require(pg, GROUP, name)
    for name, value in values.items():
        setattr(pg, name, value)


def create_gloo_group(
    pg: Any,
    store: dist.Store,
    rank: int,
    world_size: int,
    *,
    connect_timeout: datetime.timedelta,
    collective_timeout: datetime.timedelta,
) -> dist.ProcessGroup:
    """torchft's gloo group over ``store`` through ``ProcessGroupWrapper._create_pg`` (the set-up
    without the store connection ``configure`` opens), its connects bounded by
    ``connect_timeout``; ``collective_timeout`` is set back after, raised or not."""
    _require(pg, GROUP, "_create_pg")
    pg.set_timeout(connect_timeout)
    try:
        group: dist.ProcessGroup = pg._create_pg(store, rank, world_size)
    finally:
        pg.set_timeout(collective_timeout)
    return group


def install_group(pg: Any, group: dist.ProcessGroup) -> None:
    """Make ``group`` the torch group under torchft's wrapper ``pg`` (``ProcessGroupWrapper._pg``),
    as the end of ``configure`` does. If it changes, the wrapper's collectives have no group."""
    _require(pg, GROUP, "_pg")
    pg._pg = group
