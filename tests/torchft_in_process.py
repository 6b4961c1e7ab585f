"""Checks of ``TorchftMembership`` inside one process, each run in a fresh interpreter by
``tests/test_membership_torchft.py`` (``python -m tests.torchft_in_process CHECK TMP_DIR``).

A torchft Manager leaves torchft's timeout and watchdog threads running in its process for
good, so these checks stay out of the test session's own process, which later forks ranks.
Exit status 0 when the check holds; an assertion error (with its message) otherwise.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_swarm.algorithm.model_layout import model_layout
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.errors import (
    LighthouseUnreachableError,
    MembershipError,
    QuorumTimeoutError,
)
from lightning_swarm.membership.torchft_quorum import TorchftMembership
from lightning_swarm.transport.base import Bucket, RoundRequest, RoundStats
from tests.dist_utils import free_port
from tests.elastic_utils import lighthouse, start_lighthouse


def _membership(address: str, **options: float | None) -> TorchftMembership:
    params = {"w": torch.zeros(3)}
    config = ElasticConfig(lighthouse=address, island_id="solo", **options)  # type: ignore[arg-type]
    return TorchftMembership(config, layout=model_layout(params))


def _round(membership: TorchftMembership, round_index: int) -> RoundStats:
    """One round of a 3-element zero tensor, as the round engine drives it."""
    flat = torch.zeros(3)
    membership.open(RoundRequest(round_index, True, {"w": flat.shape}))
    membership.start(Bucket(flat, (3,))).wait()
    return membership.agree()


def lighthouse_down(tmp: Path) -> None:
    """No lighthouse at the address: named within the connect timeout."""
    start = time.monotonic()
    with pytest.raises(LighthouseUnreachableError, match="could not reach the lighthouse at"):
        _membership(f"http://127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    assert time.monotonic() - start < 10


def too_few_islands(tmp: Path) -> None:
    """One island where the lighthouse wants two: QuorumTimeoutError after the timeout."""
    with lighthouse(min_islands=2) as address:
        membership = _membership(address, quorum_timeout_s=1.0)
        try:
            with pytest.raises(QuorumTimeoutError, match="quorum_timeout_s=1.0"):
                _round(membership, 0)
        finally:
            membership.close()


def lighthouse_gone(tmp: Path) -> None:
    """The lighthouse dies and stays dead: the island stops after quorum_timeout_s with an
    error that names the lighthouse, not a shortage of islands."""
    port = free_port()
    server = start_lighthouse(port, tmp / "lighthouse.log", min_islands=1)
    address = f"http://127.0.0.1:{port}"
    membership = _membership(address, min_islands=1, quorum_timeout_s=2.0)
    try:
        assert _round(membership, 0) is not None
        server.kill()
        server.wait()
        with pytest.raises(MembershipError) as caught:
            _round(membership, 1)
    finally:
        membership.close()
        if server.poll() is None:
            server.kill()
            server.wait()
    message = str(caught.value)
    assert type(caught.value).__name__ == "LighthouseLostError", message
    assert f"the lighthouse at {address} stopped answering" in message
    assert "quorum_timeout_s=2.0" in message and "restart it on the same address" in message


def group_per_quorum(tmp: Path) -> None:
    """``QuorumGroup``: every quorum's group is set up on one kept connection to its store and
    works, with the round timeout for its collectives; a set-up whose store is gone raises and
    drops the connection."""
    import datetime

    import torch.distributed as dist

    from lightning_swarm.membership.torchft_manager import QuorumGroup

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    setups: list[str] = []
    group = QuorumGroup(
        datetime.timedelta(seconds=2),
        prefix=lambda store_addr: f"{store_addr}/q{len(setups)}",
        on_setup=lambda: setups.append("pg_setup"),
    )
    kept = []
    for quorum_id in (1, 2, 3):
        group.configure(f"{address}/torchft/{quorum_id}/0", "solo", 0, 1, quorum_id, 0, 1)
        value = torch.ones(2)
        group.allreduce([value], dist.AllreduceOptions()).wait()
        assert value.tolist() == [1.0, 1.0]
        kept.append(group._stores[address])
        # Its collectives wait the whole round timeout (the connects got a fifth of it).
        backend = group.parent._get_backend(torch.device("cpu"))
        assert backend.options._timeout == datetime.timedelta(seconds=2)
    assert setups == ["pg_setup"] * 3
    assert kept[0] is kept[1] is kept[2], "one store connection for every set-up"
    gone = f"127.0.0.1:{free_port()}"
    with pytest.raises(Exception):  # noqa: B017 - torch's connect error, whatever its class
        group.configure(f"{gone}/torchft/4/0", "solo", 0, 1, 4, 0, 1)
    assert gone not in group._stores and address in group._stores


def derived_round_timeout(tmp: Path) -> None:
    """``round_timeout_s`` unset: a round's payload sets the bound of its group's collectives,
    its commit vote and a heal (4x its time at 10 Mbit/s before any rate is measured, over
    the 60 s floor); set: that value everywhere. A round alone measures no rate."""
    _bounded_round(None, expected=80.0, heal_s=1280.0)
    _bounded_round(7.0, expected=7.0, heal_s=7.0)


def _bounded_round(explicit: float | None, *, expected: float, heal_s: float) -> None:
    """One solo round of 25 MB of float32 (80 s at the assumed 10 Mbit/s, 4x over): the bound
    its group, its vote and a 400 MB heal got."""
    import datetime

    numel = 6_250_000
    with lighthouse(min_islands=1) as address:
        membership = _membership(address, min_islands=1, round_timeout_s=explicit)
        votes: list[datetime.timedelta | None] = []
        vote = membership._manager.should_commit

        def recorded(timeout: datetime.timedelta | None = None) -> bool:
            votes.append(timeout)
            return bool(vote(timeout=timeout))

        membership._manager.should_commit = recorded
        try:
            flat = torch.ones(numel)
            membership.open(RoundRequest(0, True, {"w": flat.shape}))
            backend = membership._pg.parent._get_backend(torch.device("cpu"))
            assert backend.options._timeout == datetime.timedelta(seconds=expected), (
                backend.options._timeout
            )
            membership.start(Bucket(flat, (numel,))).wait()
            assert membership.agree() is not None
            assert votes == [datetime.timedelta(seconds=expected)], votes
            assert membership.round_timeout_s == expected
            assert membership._link.rate_bps is None  # its bytes crossed no link
            heal = membership.heal_transport.timeout_for
            assert heal is not None
            assert heal(400_000_000) == datetime.timedelta(seconds=heal_s)
        finally:
            membership.close()


CHECKS: dict[str, Callable[[Path], None]] = {
    "lighthouse_down": lighthouse_down,
    "too_few_islands": too_few_islands,
    "lighthouse_gone": lighthouse_gone,
    "group_per_quorum": group_per_quorum,
    "derived_round_timeout": derived_round_timeout,
}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](Path(sys.argv[2]))
