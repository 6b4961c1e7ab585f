"""Timeouts that fit the link (issue 27, item 4): derived from the payload and the rate the last
round measured, unless set; a round that overruns says the rate, the payload, the timeout and
the option to raise."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_swarm import PeerLostError, RoundTimeoutError, SwarmConfig
from lightning_swarm.config import DEFAULT_TIMEOUT_S
from lightning_swarm.transport.allreduce import AllReduceTransport
from lightning_swarm.transport.base import Bucket, RoundRequest
from lightning_swarm.transport.link import (
    ASSUMED_RATE_BPS,
    FACTOR,
    LinkTimeouts,
    LinkWatch,
    set_backend_timeout,
    set_group_timeout,
)
from tests.dist_utils import run_ranks

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1000ms for recv"
GLOO_RESET = (
    "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8110: Connection reset by peer"
)


def test_the_derived_timeout_is_the_factor_times_the_payloads_time_and_never_under_the_floor() -> (
    None
):
    derived = LinkTimeouts("timeout_s", 60).for_round
    # 100 MB at 1 MB/s: 100 s of transfer, 400 s allowed.
    assert derived(100_000_000, 1e6) == pytest.approx(FACTOR * 100)
    # A small payload on a fast link keeps the option's default.
    assert derived(1_000_000, 1e8) == 60
    # A 1.2 GB fp32 round at 100 Mbit/s (12.5 MB/s) needs 96 s: 384 s, past the default 60 s.
    assert derived(1_200_000_000, 12.5e6) == pytest.approx(384)


def test_the_first_round_assumes_a_slow_link() -> None:
    payload = 3_500_000_000  # 3.5 GB: 2800 s at 10 Mbit/s
    derived = LinkTimeouts("timeout_s", DEFAULT_TIMEOUT_S).for_round
    assert derived(payload, None) == pytest.approx(FACTOR * payload / ASSUMED_RATE_BPS)
    assert derived(1000, None) == DEFAULT_TIMEOUT_S


def test_timeout_s_unset_means_derive_and_set_means_used_as_it_is() -> None:
    assert SwarmConfig().timeout_s is None
    assert SwarmConfig().group_timeout_s == DEFAULT_TIMEOUT_S
    assert SwarmConfig(timeout_s=5).group_timeout_s == 5
    # Without torch.distributed no group is changed; an explicit timeout is never replaced.
    watch = LinkWatch(None, num_islands=2, timeouts=LinkTimeouts("timeout_s", 60, 5.0))
    watch.rate_bps = 1.0  # a payload that would need 4e6 s
    watch.open(3, {"w": torch.Size([1000, 1000])})
    assert watch.timeout_s == 5.0 and watch.payload_bytes == 4_000_000


def test_an_overrun_names_the_measured_rate_the_payload_the_timeout_and_the_option() -> None:
    watch = LinkWatch(None, num_islands=2, timeouts=LinkTimeouts("timeout_s", 60, 90.0))
    watch.rate_bps = 2.5e6
    watch.open(7, {"w": torch.Size([250_000])})
    with pytest.raises(RoundTimeoutError) as caught, watch.explained():
        raise RuntimeError(GLOO_TIMEOUT)
    message = str(caught.value)
    assert "round 7: a collective of its 1,000,000-byte payload waited timeout_s=90 s" in message
    assert "(set explicitly)" in message
    assert "the last round measured 2.5 MB/s (20 Mbit/s)" in message
    assert "needs about 0.4 s" in message
    assert "Timed out waiting 1000ms" in message
    assert "set timeout_s above the payload's time at the link's rate" in message


def test_a_closed_connection_becomes_peer_lost_and_other_errors_pass() -> None:
    watch = LinkWatch(None, num_islands=3)
    watch.open(2, {"w": torch.Size([10])})
    with (
        pytest.raises(PeerLostError, match=r"round 2: one of islands \[0, 1, 2\]"),
        watch.explained(),
    ):
        raise RuntimeError(GLOO_RESET)
    with pytest.raises(RuntimeError, match="^something else$"), watch.explained():
        raise RuntimeError("something else")


def _derived_then_overrun(rank: int, world: int, out: Path, agree: bool) -> None:
    # A floor of 1 s: the first round's tiny payload and the measured rate both derive 1 s.
    transport = AllReduceTransport(
        None, num_islands=world, bucket_numel=1024, timeouts=LinkTimeouts("timeout_s", 1.0)
    )
    names = {"w": torch.Size([1000])}
    for round_index in range(2):
        if rank == 1 and round_index == 1:
            time.sleep(3)  # the peer that hangs
        flat = torch.ones(1000)
        try:
            transport.open(RoundRequest(round_index, True, names))
            transport.start(Bucket(flat, (1000,))).wait()
            if agree:  # the streamed engine ends a round at its last wait
                transport.agree()
        except Exception as err:
            if rank == 0:
                (out / "error.txt").write_text(f"{type(err).__name__}: {err}")
            return
        if rank == 0:
            (out / f"round{round_index}.txt").write_text(
                f"{transport.link.timeout_s} {transport.link.rate_bps}"
            )


@pytest.mark.parametrize("agree", [True, False])
def test_a_round_past_its_derived_timeout_raises_with_the_measured_rate(
    tmp_path: Path, agree: bool
) -> None:
    run_ranks(_derived_then_overrun, 2, tmp_path, agree, timeout_s=60)
    timeout, rate = (tmp_path / "round0.txt").read_text().split()
    assert float(timeout) == 1.0
    # Measured at agree; without one (a streamed round), at the next open.
    assert (rate != "None" and float(rate) > 0) if agree else rate == "None"
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith("RoundTimeoutError: rank 0, island 0, round 1: a collective of its "), (
        error
    )
    assert "4,000-byte payload waited timeout_s=1 s (derived: 4x the payload's time" in error
    assert "the last round measured" in error and "MB/s" in error


def test_the_strategys_transport_derives_unless_timeout_s_is_set() -> None:
    from lightning_swarm.outer.loop import transport_for

    def timeouts(config: SwarmConfig) -> LinkTimeouts | None:
        transport = transport_for(
            config, None, num_islands=2, island_index=0, device=torch.device("cpu")
        )
        return transport.link.timeouts  # type: ignore[attr-defined]

    assert timeouts(SwarmConfig()) == LinkTimeouts("timeout_s", DEFAULT_TIMEOUT_S, None)
    assert timeouts(SwarmConfig(timeout_s=7)) == LinkTimeouts("timeout_s", DEFAULT_TIMEOUT_S, 7)
    assert timeouts(SwarmConfig(quantize="int8")) == LinkTimeouts(
        "timeout_s", DEFAULT_TIMEOUT_S, None
    )


@pytest.fixture
def world_of_one() -> Iterator[dist.ProcessGroup]:
    """An in-process gloo world of one rank, built with a 5 s timeout."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=5)
    )
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_process_group_get_backend_gives_the_backend_its_timeout_lives_in(
    world_of_one: dist.ProcessGroup,
) -> None:
    """torch's private ``ProcessGroup._get_backend`` (``set_backend_timeout``): the group's
    gloo backend, which holds the timeout the group was built with."""
    backend = world_of_one._get_backend(torch.device("cpu"))
    assert isinstance(backend, dist.ProcessGroupGloo)
    assert _timeout(world_of_one) == datetime.timedelta(seconds=5)


def test_gloo_set_default_timeout_replaces_the_groups_timeout(
    world_of_one: dist.ProcessGroup,
) -> None:
    """torch's private ``ProcessGroupGloo._set_default_timeout``: what ``set_group_timeout``
    (the static transports) and elastic membership's groups set a round's timeout with."""
    set_backend_timeout(world_of_one, datetime.timedelta(seconds=7), torch.device("cpu"))
    assert _timeout(world_of_one) == datetime.timedelta(seconds=7)
    assert set_group_timeout(None, 9.0)
    assert _timeout(world_of_one) == datetime.timedelta(seconds=9)


def test_a_torch_without_the_setter_leaves_the_timeout_and_says_so(
    world_of_one: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(dist.ProcessGroupGloo, "_set_default_timeout")
    with pytest.raises(AttributeError, match="_set_default_timeout"):
        set_backend_timeout(world_of_one, datetime.timedelta(seconds=7), torch.device("cpu"))
    assert not set_group_timeout(world_of_one, 7.0)
    assert _timeout(world_of_one) == datetime.timedelta(seconds=5)
