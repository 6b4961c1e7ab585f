"""Every private name of torchft (and of torch's gloo group) that elastic membership touches.

Each is one small function whose docstring names the attribute and why;
``tests/test_torchft_private.py`` has one test per name. A missing name raises
``TorchftVersionError`` naming it and the fix, never an ``AttributeError`` inside a round: class
attributes are checked by ``check_torchft``, instance attributes before they are written. torchft,
an optional extra, is imported only inside these functions.
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

TORCHFT_VERSION = "0.2.0"
"""The torchft release whose private names this module was written against."""

CLASS_NAMES: tuple[tuple[str, str, str], ...] = (
    ("torchft.coordination", "ManagerClient", "_quorum"),
    ("torchft.process_group", "ProcessGroupWrapper", "_create_pg"),
    ("torchft.process_group", "ProcessGroupWrapper", "parent"),
    ("torch.distributed", "ProcessGroup", "_get_backend"),
    ("torch.distributed", "ProcessGroupGloo", "_set_default_timeout"),
)
"""(module, class, attribute) of every class-level private name used below."""

MANAGER = "torchft.manager.Manager"
GROUP = "torchft.process_group.ProcessGroupWrapper"


def _installed_version() -> str:
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def missing(owner: str, name: str) -> TorchftVersionError:
    """The error for private attribute ``owner.name`` that the installed torchft lacks."""
    return TorchftVersionError(
        f"lightning_swarm uses the private {owner}.{name}, which the installed torchft "
        f"{_installed_version()} (torch {torch.__version__}) does not have; "
        f"lightning_swarm/membership/torchft_private.py was written for torchft "
        f"{TORCHFT_VERSION}. Install torchft=={TORCHFT_VERSION} "
        "(pip install 'lightning-swarm[elastic]'), or update that module to this torchft."
    )


def _require(obj: object, owner: str, name: str) -> None:
    if not hasattr(obj, name):
        raise missing(owner, name)


def check_torchft() -> None:
    """Check that every class-level private name in ``CLASS_NAMES`` exists.

    Raises:
        TorchftVersionError: one is missing; the message names it and the fix.
    """
    for module, cls, name in CLASS_NAMES:
        _require(getattr(importlib.import_module(module), cls), f"{module}.{cls}", name)


def forget_failed_quorum(manager: Any) -> None:
    """Clear ``Manager._quorum_future`` after a quorum request failed.

    torchft 0.2.0 keeps the failed future, and ``start_quorum`` first calls its ``result()``,
    which raises the old failure again: without this an island could never ask anew after a
    quorum timed out (a lighthouse restart would end it). No public call resets the future.
    If torchft renames it, the reset would silently do nothing and every later request would
    re-raise the first timeout.
    """
    _require(manager, MANAGER, "_quorum_future")
    manager._quorum_future = None


def count_commit_failure(manager: Any) -> None:
    """Add one to ``Manager._commit_failures``, which the next quorum request reports.

    torchft 0.2.0 counts only votes that returned (``should_commit``); a round whose vote
    timed out, or whose manager server went away, must count as a "no" too, so the lighthouse
    gives the next quorum a new id and no member reuses a failed round's rendezvous prefix
    (``quorum.QuorumIdentity``). No public call counts a failure. If it changes, a failed
    round's quorum id may repeat, and so its rendezvous prefix.
    """
    _require(manager, MANAGER, "_commit_failures")
    manager._commit_failures += 1


class _QuorumTap:
    """Stands in for torchft's ``ManagerClient``: passes every call on, and shows each quorum
    ``_quorum`` returns to ``on_quorum`` (on torchft's quorum thread) before torchft reads it."""

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
    """Have ``on_quorum(quorum)`` see every quorum ``manager`` receives, before torchft uses it.

    Replaces ``Manager._client`` (torchft's ``ManagerClient``) with a stand-in whose
    ``_quorum`` (the private call ``Manager._async_quorum`` makes) passes the result on. torchft
    0.2.0 shows a quorum's id, members and ``max_step`` nowhere else before it sets the
    process group up. If either name changes, ``QuorumIdentity`` would never see a quorum and
    the group would be set up under torchft's own prefix.
    """
    _require(manager, MANAGER, "_client")
    client = manager._client
    _require(client, "torchft.coordination.ManagerClient", "_quorum")
    manager._client = _QuorumTap(client, on_quorum)


def set_up_group_for_this_quorum(manager: Any) -> None:
    """Make torchft set the process group up for the quorum it is handling now.

    torchft 0.2.0 sets the group up only when the quorum's id differs from
    ``Manager._quorum_id`` (the id of the last set-up); ``-1`` is its "none yet". Called from
    ``tap_quorums``'s hook, between the client's answer and that comparison. No public call
    forces a set-up. If it changes, a quorum with a repeated id keeps a stale group.
    """
    _require(manager, MANAGER, "_quorum_id")
    manager._quorum_id = -1


def quorum_rank(pg: Any) -> int:
    """This island's rank in the quorum's group ``pg`` (a torchft ``ProcessGroupWrapper``).

    torchft 0.2.0's wrapper answers ``rank()`` for a placeholder (always 0); only its ``parent``
    (the torch group it set up, a public property with an undocumented meaning) knows the
    island's place. If it changes, every island would take share 0 of the quantized mean.
    """
    _require(pg, GROUP, "parent")
    return int(pg.parent.rank())


_GROUP_FIELDS = (
    "_replica_id",
    "_rank",
    "_quorum_id",
    "_group_rank",
    "_group_world_size",
    "_global_ranks",
)


def record_group_args(
    pg: Any,
    *,
    replica_id: str,
    rank: int,
    quorum_id: int | None,
    group_rank: int | None,
    group_world_size: int | None,
    global_ranks: list[int] | None,
) -> None:
    """Record ``configure``'s arguments on ``pg`` as ``ProcessGroupWrapper.configure`` does.

    ``QuorumGroup`` replaces torchft 0.2.0's ``configure`` (to keep its store connection), so
    it must leave the fields that ``ProcessGroupGloo._create_pg`` (the group's name and global
    ranks) and ``abort`` (its error log) read: ``_replica_id``, ``_rank``, ``_quorum_id``,
    ``_group_rank``, ``_group_world_size``, ``_global_ranks``. No public setter exists. If they
    change, the group is set up with torchft's defaults and its errors are logged without ids.
    """
    for name in _GROUP_FIELDS:
        _require(pg, GROUP, name)
    pg._replica_id, pg._quorum_id = replica_id, quorum_id
    pg._group_rank, pg._group_world_size = group_rank, group_world_size
    pg._rank, pg._global_ranks = rank, global_ranks


def create_gloo_group(
    pg: Any,
    store: dist.Store,
    rank: int,
    world_size: int,
    *,
    connect_timeout: datetime.timedelta,
    collective_timeout: datetime.timedelta,
) -> dist.ProcessGroup:
    """torchft's gloo group over ``store``, its connects bounded by ``connect_timeout``.

    Calls ``ProcessGroupWrapper._create_pg``, torchft 0.2.0's set-up without its store client
    (the public ``configure`` opens a new store connection each time, which ``QuorumGroup``
    avoids). ``_create_pg`` gives gloo the wrapper's timeout, set here with the public
    ``set_timeout``; ``collective_timeout`` is set back afterwards, raised or not. If
    ``_create_pg`` changes, no quorum's group can be set up.
    """
    _require(pg, GROUP, "_create_pg")
    pg.set_timeout(connect_timeout)
    try:
        group: dist.ProcessGroup = pg._create_pg(store, rank, world_size)
    finally:
        pg.set_timeout(collective_timeout)
    return group


def set_collective_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Bound ``group``'s later gloo collectives by ``timeout`` (its connects had less).

    torch's private ``ProcessGroup._get_backend`` and ``ProcessGroupGloo._set_default_timeout``:
    gloo takes one timeout at construction, for its connects and collectives alike, and no
    public call changes it afterwards. If they change, collectives keep the short connect
    timeout and a slow but live round fails.
    """
    _require(group, "torch.distributed.ProcessGroup", "_get_backend")
    backend = group._get_backend(torch.device("cpu"))
    _require(backend, "torch.distributed.ProcessGroupGloo", "_set_default_timeout")
    backend._set_default_timeout(timeout)


def install_group(pg: Any, group: dist.ProcessGroup) -> None:
    """Make ``group`` the torch group under torchft's wrapper ``pg`` (``ProcessGroupWrapper._pg``).

    What the end of torchft 0.2.0's ``configure`` does; ``parent`` has no setter. If it
    changes, the wrapper's collectives run on no group (torchft asserts it was initialized).
    """
    _require(pg, GROUP, "_pg")
    pg._pg = group
