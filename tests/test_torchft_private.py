"""One test per private name of torchft that ``membership/torchft_private.py`` uses.

Each test names its attribute and checks, on the installed torchft, that it exists and behaves
as the module assumes, so a torchft upgrade fails here, by name. No Manager is constructed
(one leaves torchft's threads running for good): the Manager's methods run on a bare instance
that holds only the fields they read, and groups are set up over an in-memory store.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import inspect
import logging
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchft.coordination
from torchft.manager import Manager, WorldSizeMode
from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper

from lightning_swarm.membership.errors import TorchftVersionError
from lightning_swarm.membership.torchft_private import (
    CLASS_NAMES,
    TORCHFT_VERSION,
    check_torchft,
    count_commit_failure,
    create_gloo_group,
    forget_failed_quorum,
    install_group,
    quorum_rank,
    record_group_args,
    set_up_group_for_this_quorum,
    tap_quorums,
)
from lightning_swarm.transport.link import set_backend_timeout

SECONDS = datetime.timedelta(seconds=1)


def _set_in_init(name: str) -> bool:
    """Whether ``Manager.__init__`` gives every Manager the attribute ``name``."""
    source = inspect.getsource(Manager.__init__)
    return f"self.{name} =" in source or f"self.{name}:" in source


class _Recorder:
    """Stands in for the client, the checkpoint transport, the group and the logger."""

    def __init__(self, quorums: list[SimpleNamespace]) -> None:
        self.quorums = quorums
        self.asked: list[dict[str, Any]] = []
        self.configured: list[int | None] = []

    def _quorum(self, **kwargs: Any) -> SimpleNamespace:
        self.asked.append(kwargs)
        return self.quorums.pop(0)

    def metadata(self) -> str:
        return ""

    def configure(self, *args: Any) -> None:
        self.configured.append(args[4])  # the quorum id

    def info(self, msg: str) -> None:
        pass

    warn = exception = info


def _quorum(quorum_id: int) -> SimpleNamespace:
    return SimpleNamespace(
        quorum_id=quorum_id,
        replica_rank=0,
        replica_world_size=1,
        recover_src_manager_address="",
        store_address="host:1",
        max_step=4,
        max_replica_rank=0,
        max_world_size=1,
        heal=False,
        replica_ids=["a:1"],
    )


def _bare_manager(recorder: _Recorder) -> Manager:
    """A Manager that holds only what ``_async_quorum`` reads up to its group set-up."""
    manager = Manager.__new__(Manager)
    fields = {
        "_client": recorder,
        "_checkpoint_transport": recorder,
        "_pg": recorder,
        "_logger": recorder,
        "quorum_logger": logging.getLogger("test_torchft_private"),
        "_group_rank": 0,
        "_group_world_size": 1,
        "_step": 4,
        "_init_sync": True,
        "_commit_failures": 0,
        "_use_async_quorum": True,
        "_replica_world_size_mode": WorldSizeMode.DYNAMIC,
        "_min_replica_size": 1,
        "_quorum_id": -1,
        "_replica_id": "a",
        "_original_fr_dump_temp_file": None,
    }
    for name, value in fields.items():
        setattr(manager, name, value)
    return manager


def _run_quorum(manager: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass of torchft's quorum thread, run here (without renaming this thread)."""
    monkeypatch.setattr(torch.multiprocessing, "_set_thread_name", lambda _: None)
    manager._async_quorum(
        allow_heal=False, shrink_only=False, quorum_timeout=SECONDS, curr_device=-1
    )


@pytest.mark.parametrize(("module", "cls", "name"), CLASS_NAMES)
def test_every_class_level_private_name_exists(module: str, cls: str, name: str) -> None:
    owner = getattr(__import__(module, fromlist=[cls]), cls)
    assert hasattr(owner, name), f"{module}.{cls}.{name} is gone: update torchft_private.py"


def test_manager_quorum_future_re_raises_until_forgotten() -> None:
    """``Manager._quorum_future``: a failed quorum is raised again by the next start_quorum;
    ``forget_failed_quorum`` lets the next request go out."""
    assert _set_in_init("_quorum_future")
    manager = Manager.__new__(Manager)
    failed: concurrent.futures.Future[None] = concurrent.futures.Future()
    failed.set_exception(TimeoutError("the first request"))
    manager._quorum_future = failed
    with pytest.raises(TimeoutError, match="the first request"):
        manager.start_quorum()
    forget_failed_quorum(manager)
    submitted: list[object] = []
    manager._executor = SimpleNamespace(submit=lambda fn, **_: submitted.append(fn))  # type: ignore[assignment]
    manager._use_async_quorum, manager._quorum_timeout = True, SECONDS
    manager.start_quorum()
    assert len(submitted) == 1, "start_quorum must ask anew once the future is forgotten"


def test_manager_client_quorum_is_seen_before_torchft_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Manager._client`` and ``ManagerClient._quorum``: the Manager's quorum thread asks its
    client's ``_quorum``, so a tap in ``_client`` sees each quorum before the group set-up."""
    assert _set_in_init("_client")
    assert callable(getattr(torchft.coordination.ManagerClient, "_quorum", None))
    recorder = _Recorder([_quorum(3)])
    manager = _bare_manager(recorder)
    seen: list[tuple[int, list[int | None]]] = []
    tap_quorums(manager, lambda q: seen.append((q.quorum_id, list(recorder.configured))))
    _run_quorum(manager, monkeypatch)
    assert seen == [(3, [])], "the tap must see the quorum before torchft sets the group up"
    assert recorder.configured == [3]


def test_manager_quorum_id_minus_one_sets_the_group_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Manager._quorum_id``: torchft sets the group up only for a quorum id other than the
    last one; resetting it to -1 sets a repeated id's group up anew."""
    assert _set_in_init("_quorum_id")
    recorder = _Recorder([_quorum(3), _quorum(3), _quorum(3)])
    manager = _bare_manager(recorder)
    _run_quorum(manager, monkeypatch)
    _run_quorum(manager, monkeypatch)
    assert recorder.configured == [3], "torchft keeps the group of a repeated quorum id"
    set_up_group_for_this_quorum(manager)
    _run_quorum(manager, monkeypatch)
    assert recorder.configured == [3, 3]


def test_manager_commit_failures_reach_the_next_quorum_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Manager._commit_failures``: the count goes out with the next quorum request."""
    assert _set_in_init("_commit_failures")
    recorder = _Recorder([_quorum(3)])
    manager = _bare_manager(recorder)
    count_commit_failure(manager)
    count_commit_failure(manager)
    _run_quorum(manager, monkeypatch)
    assert recorder.asked[0]["commit_failures"] == 2


def _recorded_wrapper() -> ProcessGroupGloo:
    pg = ProcessGroupGloo(timeout=SECONDS)
    record_group_args(
        pg,
        replica_id="a",
        rank=0,
        quorum_id=5,
        group_rank=1,
        group_world_size=2,
        global_ranks=[3],
    )
    return pg


def test_wrapper_group_fields_are_what_create_pg_reads() -> None:
    """``ProcessGroupWrapper._replica_id``, ``_rank``, ``_quorum_id``, ``_group_rank``,
    ``_group_world_size``, ``_global_ranks``: ``_create_pg`` names the group and its global
    ranks from them."""
    pg = _recorded_wrapper()
    assert (pg._replica_id, pg._rank) == ("a", 0)
    group = create_gloo_group(
        pg, dist.HashStore(), 0, 1, connect_timeout=SECONDS, collective_timeout=SECONDS
    )
    options = group._get_backend(torch.device("cpu")).options
    assert options.group_name == "torchft_quorum_5_rank_1"
    assert options.global_ranks_in_group == [3]


def test_wrapper_create_pg_gets_the_connect_timeout_only_while_it_runs() -> None:
    """``ProcessGroupWrapper._create_pg``: builds the gloo group with the wrapper's timeout
    (set by the public ``set_timeout``), which is set back to the collectives' afterwards."""
    pg = _recorded_wrapper()
    connect, collective = datetime.timedelta(seconds=2), datetime.timedelta(seconds=9)
    group = create_gloo_group(
        pg, dist.HashStore(), 0, 1, connect_timeout=connect, collective_timeout=collective
    )
    assert group._get_backend(torch.device("cpu")).options._timeout == connect
    assert pg._timeout == collective


def test_torch_gloo_default_timeout_can_be_raised_after_set_up() -> None:
    """torch's ``ProcessGroup._get_backend`` and ``ProcessGroupGloo._set_default_timeout``
    (``transport/link.py``'s ``set_backend_timeout``, tested there too), on torchft's group:
    the collectives' timeout replaces the connect timeout gloo was built with."""
    group = create_gloo_group(
        _recorded_wrapper(),
        dist.HashStore(),
        0,
        1,
        connect_timeout=SECONDS,
        collective_timeout=SECONDS,
    )
    set_backend_timeout(group, datetime.timedelta(seconds=7), torch.device("cpu"))
    backend = group._get_backend(torch.device("cpu"))
    assert backend.options._timeout == datetime.timedelta(seconds=7)


def test_wrapper_pg_is_the_parent_the_collectives_run_on() -> None:
    """``ProcessGroupWrapper._pg``: ``install_group`` makes a set-up group the wrapper's
    ``parent``, and the wrapper's collectives run on it."""
    pg = _recorded_wrapper()
    group = create_gloo_group(
        pg, dist.HashStore(), 0, 1, connect_timeout=SECONDS, collective_timeout=SECONDS
    )
    install_group(pg, group)
    assert pg.parent is group
    value = torch.full((2,), 3.0)
    pg.allreduce([value], dist.AllreduceOptions()).wait()
    assert value.tolist() == [3.0, 3.0] and pg.size() == 1


def test_wrapper_parent_knows_the_rank_the_wrapper_does_not() -> None:
    """``ProcessGroupWrapper.parent``: the wrapper's own ``rank()`` is a placeholder's (0);
    ``quorum_rank`` reads the island's place from the parent."""
    pg = ProcessGroupGloo(timeout=SECONDS)
    install_group(pg, SimpleNamespace(rank=lambda: 3))  # type: ignore[arg-type]
    assert isinstance(inspect.getattr_static(ProcessGroupWrapper, "parent"), property)
    assert pg.rank() == 0
    assert quorum_rank(pg) == 3


def _assert_names(err: TorchftVersionError, attribute: str) -> None:
    message = str(err)
    assert attribute in message, message
    assert f"installed torchft {version('torchft')} " in message, message
    assert f"written for torchft {TORCHFT_VERSION}" in message, message
    assert f"Install torchft=={TORCHFT_VERSION}" in message, message
    assert "or update that module" in message and "torchft_private.py" in message, message


def test_a_missing_class_attribute_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(ProcessGroupWrapper, "parent")
    with pytest.raises(TorchftVersionError) as caught:
        check_torchft()
    _assert_names(caught.value, "torchft.process_group.ProcessGroupWrapper.parent")


@pytest.mark.parametrize(
    ("use", "attribute"),
    [
        (forget_failed_quorum, "torchft.manager.Manager._quorum_future"),
        (count_commit_failure, "torchft.manager.Manager._commit_failures"),
        (set_up_group_for_this_quorum, "torchft.manager.Manager._quorum_id"),
        (lambda m: tap_quorums(m, print), "torchft.manager.Manager._client"),
        (lambda pg: install_group(pg, pg), "ProcessGroupWrapper._pg"),
        (quorum_rank, "ProcessGroupWrapper.parent"),
    ],
)
def test_a_missing_instance_attribute_is_named_not_written(use: Any, attribute: str) -> None:
    """A renamed attribute would take the write silently: it is refused, by name."""
    renamed = SimpleNamespace()
    with pytest.raises(TorchftVersionError) as caught:
        use(renamed)
    _assert_names(caught.value, attribute)
    assert not vars(renamed), "nothing may be written to an object that lacks the name"


def test_a_client_without_quorum_is_named() -> None:
    manager = SimpleNamespace(_client=SimpleNamespace())
    with pytest.raises(TorchftVersionError) as caught:
        tap_quorums(manager, print)
    _assert_names(caught.value, "torchft.coordination.ManagerClient._quorum")


def test_the_installed_torchft_has_every_class_level_name() -> None:
    check_torchft()
