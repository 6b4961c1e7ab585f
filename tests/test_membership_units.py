"""The membership layer's pure parts: the heal wire format, layouts, options, the lighthouse CLI."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_swarm.algorithm.model_layout import (
    describe_difference,
    fingerprint,
    model_layout,
)
from lightning_swarm.config import ROUND_TIMEOUT_FLOOR_S, SwarmConfig
from lightning_swarm.membership import check_membership
from lightning_swarm.membership.config import ElasticConfig, elastic_options
from lightning_swarm.membership.lighthouse import parse_args
from lightning_swarm.membership.state_wire import decode_tree, encode_tree
from lightning_swarm.transport.link import LinkRate, LinkTimeouts
from tests.transport_rounds import NamedRound


def test_outer_state_round_trips_bitwise_without_pickle() -> None:
    anchors = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16)}
    opt = torch.optim.Adam(list(anchors.values())[:1], lr=1e-3, betas=(0.9, 0.95))
    anchors["w"].grad = torch.randn(3, 4)
    opt.step()
    tree = {"outer": [{"anchors": anchors, "outer_optimizer": opt.state_dict(), "inner_steps": 9}]}
    header, tensors = encode_tree(tree)
    json.loads(header)  # the header is plain JSON
    received = [t.clone() for t in tensors]  # what recv fills in
    back = decode_tree(header, received)["outer"][0]
    assert back["inner_steps"] == 9
    for name, t in anchors.items():
        assert back["anchors"][name].dtype == t.dtype and back["anchors"][name].equal(t)
    state = back["outer_optimizer"]
    assert state["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples
    assert state["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    torch.optim.Adam([anchors["w"]]).load_state_dict(state)  # a valid optimizer state


def test_bad_heal_payloads_are_refused() -> None:
    header, _ = encode_tree({"x": torch.ones(2)})
    with pytest.raises(ValueError, match="names 1 tensors, 0 arrived"):
        decode_tree(header, [])
    with pytest.raises(ValueError, match="arrived with 4 B"):
        decode_tree(header, [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_tree(b"\x80garbage", [])
    with pytest.raises(ValueError, match="unknown node kind"):
        decode_tree(b'{"P": "os.system"}', [])
    with pytest.raises(TypeError, match="only tensors, numbers, strings"):
        encode_tree({"f": object()})


def test_layout_differences_are_named() -> None:
    small = model_layout({"a": torch.zeros(2, 3), "b": torch.zeros(3)})
    other = model_layout({"a": torch.zeros(2, 4), "c": torch.zeros(3)})
    assert fingerprint(small) != fingerprint(other)
    assert fingerprint(small) == fingerprint(dict(reversed(small.items())))
    text = describe_difference(small, other)
    assert "a is (2, 3) float32 here but (2, 4) float32 in the swarm" in text
    assert "b exists only here" in text and "c exists only in the swarm" in text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lighthouse": ""}, "needs lighthouse="),
        ({"island_id": ""}, "island_id must be a non-empty name"),
        ({"island_id": "a:b"}, "without ':'"),
        ({"min_islands": 0}, "min_islands must be >= 1"),
        ({"min_islands": 1.5}, "min_islands must be an integer"),
        ({"quorum_timeout_s": 0}, "quorum_timeout_s must be a positive number"),
        (
            {"round_timeout_s": "5"},
            r"round_timeout_s must be a positive number of seconds \(or None",
        ),
    ],
)
def test_elastic_options_are_checked(options: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"lighthouse": "http://h:1", "island_id": "a"}
    with pytest.raises(ValueError, match=message):
        ElasticConfig(**{**base, **options})  # type: ignore[arg-type]


def test_a_lighthouse_without_a_scheme_is_refused_naming_the_url_to_give() -> None:
    # torchft's client never connects to "host:port" (measured: "failed to connect to
    # localhost:P within timeout" with the lighthouse up), so it is refused at construction.
    from lightning_swarm import SwarmStrategy

    options = {"membership": "torchft", "lighthouse": "localhost:29510", "island_id": "a"}
    with pytest.raises(ValueError) as caught:
        SwarmStrategy(**options)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "lighthouse='localhost:29510' has no scheme, and torchft connects only to a URL "
        "(without one it reports a running lighthouse unreachable); give "
        "lighthouse='http://localhost:29510' (the address `swarm-lighthouse` prints)."
    )
    accepted = ElasticConfig(lighthouse="http://localhost:29510", island_id="a")
    assert accepted.lighthouse == "http://localhost:29510"


def test_membership_names_and_lighthouse_arguments() -> None:
    assert check_membership("torchft") == "torchft"
    with pytest.raises(ValueError, match=r"membership must be one of \['static', 'torchft'\]"):
        check_membership("elastic")
    args = parse_args(["--min-islands", "3", "--port", "0"])
    assert (args.min_islands, args.port) == (3, 0)
    with pytest.raises(SystemExit):
        parse_args(["--min-islands", "0"])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lighthouse": "http://127.0.0.1:1"}, "lighthouse='http://127.0.0.1:1'"),
        ({"island_id": "a"}, "island_id='a'"),
    ],
)
def test_torchft_options_without_torchft_membership_are_refused(
    options: dict[str, str], named: str
) -> None:
    """A launch that names a lighthouse or an island but keeps membership='static' would train
    alone, silently; it is refused, naming the option and `membership`."""
    config = SwarmConfig(**options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="membership='torchft'") as caught:
        elastic_options(config)
    assert named in str(caught.value) and "membership='static'" in str(caught.value)
    from lightning_swarm import SwarmStrategy

    with pytest.raises(ValueError, match=re.escape(named)):
        SwarmStrategy(**options)  # type: ignore[arg-type]


def test_settings_that_must_agree_and_their_differences_in_words() -> None:
    from lightning_swarm.membership.round_header import (
        describe_settings_difference,
        encode_settings,
        swarm_settings,
    )

    def settings(lr: float, **options: object) -> dict[str, object]:
        optimizer = torch.optim.SGD([torch.zeros(1)], lr=lr, momentum=0.9, nesterov=True)
        return swarm_settings(SwarmConfig(**options), optimizer)  # type: ignore[arg-type]

    ours = settings(0.7, sync_every=8, merge_alpha=0.5)
    assert ours["outer_optimizer"] == "torch.optim.sgd.SGD"
    assert (ours["outer_optimizer.lr"], ours["outer_optimizer.nesterov"]) == (0.7, True)
    assert encode_settings(ours) == encode_settings(dict(reversed(ours.items())))
    theirs = settings(0.1, sync_every=4, merge_alpha=0.5, quantize="int8", error_feedback=True)
    text = describe_settings_difference(theirs, ours)
    assert "sync_every is 4 here but 8 in the swarm" in text
    assert "outer_optimizer.lr is 0.1 here but 0.7 in the swarm" in text
    assert "quantize is 'int8' here but 'none' in the swarm" in text
    assert "error_feedback is True here but False in the swarm" in text
    assert "merge_alpha" not in text  # only what differs


def test_the_round_header_verdicts() -> None:
    from lightning_swarm.membership.errors import (
        DivergedIslandError,
        DuplicateIslandError,
        ModelMismatchError,
        SettingsMismatchError,
    )
    from lightning_swarm.membership.round_header import HeaderRow, abandons, refusal

    def judge(rows: list[HeaderRow], mine: HeaderRow) -> object:
        error = refusal(rows, mine, "x", {}, {})
        return type(error) if error is not None else abandons(rows, mine)

    def row(island: int, **changes: int) -> HeaderRow:
        values = dict(island=island, model=7, healing=0, joined_ns=island, nonce=island)
        values.update(finite=1, settings=5, settings_len=10)
        return HeaderRow(**{**values, **changes})

    a, b = row(1), row(2)
    assert judge([a, b], a) is False  # go
    assert HeaderRow.of(b.tensor()) == b
    joiner = row(3, healing=1, settings=6)  # the island in the swarm is the reference
    assert judge([joiner, a], joiner) is SettingsMismatchError
    assert judge([joiner, a], a) is True  # abandon
    other_model = row(3, healing=1, model=8)
    assert judge([a, other_model], other_model) is ModelMismatchError
    twin = row(1, joined_ns=9, nonce=9)  # started later with a's island_id
    assert judge([a, twin], twin) is DuplicateIslandError
    assert judge([a, twin], a) is True
    diverged = row(2, finite=0)
    assert judge([a, diverged], diverged) is DivergedIslandError
    assert judge([a, diverged], a) is True


def test_quorums_that_leave_live_islands_out_warn_once() -> None:
    """A member missing from a round and back with the same nonce was alive all along; two
    such returns warn once, naming the lighthouse's join timeout; a restart (new nonce) and a
    single return (a suspended island coming back) do not."""
    from lightning_swarm.membership.quorum import QuorumWatch
    from lightning_swarm.membership.round_header import HeaderRow

    def rows(*members: tuple[int, int]) -> list[HeaderRow]:
        return [HeaderRow(i, 7, 0, 0, nonce, 1, 5, 10) for i, nonce in members]

    watch = QuorumWatch("a")
    a, b, c, c_restarted = (1, 1), (2, 2), (3, 3), (3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for members in ([a, b, c], [a, b], [a, b, c_restarted], [a, b], [a, b, c]):
            watch.see(rows(*members))  # c came back once with its old nonce: no warning yet
    assert watch.returns == 1
    watch.see(rows(a, b))
    with pytest.warns(UserWarning, match="join timeout is shorter than a round") as caught:
        watch.see(rows(a, b, c))
    assert "--join-timeout-ms" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.see(rows(a, b))
        watch.see(rows(a, b, c))  # once only


def _fan_out_on_a_side_group(rank: int, world: int, out: Path) -> None:
    """An island whose own group is not gloo (NCCL on GPUs; forced here on CPU) fans out over a
    gloo group created beside it: rank 0's outcome, averaged tensors and healed state arrive."""
    import torch.distributed as dist

    from lightning_swarm.membership.fanout import IslandFanout, RoundOutcome

    fanout = IslandFanout(dist.group.WORLD, side_group=True)
    assert fanout.group is not dist.group.WORLD and fanout.is_leader == (rank == 0)
    tensors = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank + 10))]
    healed = {"outer": [{"anchors": {"w": torch.arange(4.0)}, "outer_steps": 7}]}
    mine = RoundOutcome(committed=True, participants=3, healed=healed if rank == 0 else None)
    shared = fanout.lead_round(lambda: mine, tensors)
    fanout.close()
    assert (shared.committed, shared.participants) == (True, 3)
    assert tensors[0].eq(0.0).all() and tensors[1].eq(10.0).all()  # rank 0's values
    assert shared.healed is not None
    assert shared.healed["outer"][0]["anchors"]["w"].equal(torch.arange(4.0))
    (out / f"rank{rank}").write_text("ok")


def test_the_fan_out_runs_on_a_gloo_group_beside_the_islands_own(tmp_path: Path) -> None:
    from tests.dist_utils import run_ranks

    run_ranks(_fan_out_on_a_side_group, 2, tmp_path, timeout_s=30)
    assert {p.name for p in tmp_path.iterdir()} == {"rank0", "rank1"}


class _NoExchange(NamedRound):
    """A transport that leaves the pseudo-gradients as they are (one island)."""


def test_a_heal_keeps_the_islands_own_progress_since_its_anchors() -> None:
    """Healed in the middle of a run (it missed a commit: a freeze, a failed vote), an island
    adopts the swarm's anchors and keeps its own progress on top: local <- new + (local - old).
    Otherwise a round abandoned after the heal leaves it with stale weights under new anchors,
    and its next pseudo-gradient would carry the swarm's whole advance."""
    import functools

    from lightning_swarm.outer import OuterSync

    def outer_sync(value: float) -> OuterSync:
        params = {"w": torch.nn.Parameter(torch.full((3,), value))}
        sgd = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        return OuterSync(params, outer_optimizer=sgd, transport=_NoExchange(), sync_every=2)

    island, swarm = outer_sync(1.0), outer_sync(5.0)
    with torch.no_grad():
        island.params["w"].add_(torch.tensor([0.5, -0.25, 0.0]))  # its progress since anchors
    from lightning_swarm.transport.base import RoundStats

    island.install_heal(RoundStats(heal=swarm.peer_offer()))
    assert island.anchors["w"].equal(torch.full((3,), 5.0))
    assert island.params["w"].detach().equal(torch.tensor([5.5, 4.75, 5.0]))


def test_every_quorum_sets_a_group_up_under_a_prefix_of_its_own() -> None:
    """A restarted lighthouse hands out the id and members of an earlier quorum again: the
    group is set up anew for every quorum (the decision must not rest on what one island still
    holds), and the store prefix differs once any member committed since."""
    from types import SimpleNamespace

    from lightning_swarm.membership.quorum import QuorumIdentity
    from lightning_swarm.membership.torchft_private import count_commit_failure

    handed_out: list[SimpleNamespace] = []

    class Client:
        def _quorum(self, **_: object) -> SimpleNamespace:
            return handed_out.pop(0)

    manager = SimpleNamespace(_client=Client(), _quorum_id=7, _commit_failures=0)
    identity = QuorumIdentity(manager)

    def quorum(quorum_id: int, members: list[str], max_step: int) -> str:
        handed_out.append(
            SimpleNamespace(quorum_id=quorum_id, replica_ids=members, max_step=max_step)
        )
        manager._quorum_id = quorum_id  # what torchft keeps from the group it set up last
        manager._client._quorum()
        assert manager._quorum_id == -1, "torchft must set the group up for this quorum"
        return identity.store_prefix("host:1")

    first = quorum(1, ["a", "b", "c"], 10)
    assert first.startswith("host:1/")
    after_a_commit = quorum(1, ["a", "b", "c"], 11)  # the first lighthouse, one round later
    other_members = quorum(1, ["a", "b"], 11)
    restarted = quorum(1, ["a", "b", "c"], 11)  # a new lighthouse counts ids from 1 again
    assert len({first, after_a_commit, other_members}) == 3
    assert restarted == after_a_commit  # the same name on every member; set up anew all the same
    count_commit_failure(manager)
    assert manager._commit_failures == 1  # the next request reports it: the lighthouse bumps the id


class _HalvingManager:
    """A quorum of two islands whose other island sends zeros: the mean halves each bucket."""

    def __init__(self, errored: bool) -> None:
        self.buckets: list[list[float]] = []
        self._errored = errored

    def allreduce(self, bucket: torch.Tensor) -> _HalvingManager:
        self.buckets.append(bucket.tolist())
        bucket.div_(2)
        return self

    def wait(self) -> None:
        pass

    def errored(self) -> bool:
        return self._errored


@pytest.mark.parametrize("errored", [False, True])
def test_the_quorum_mean_of_a_bucket_counts_ring_bytes(errored: bool) -> None:
    """``TorchftMembership.start``'s mean: one ``Manager.allreduce`` per bucket, in place; a
    ring over 2 islands sends half of a 16-byte bucket twice; a failed exchange counts 0."""
    from types import SimpleNamespace

    from lightning_swarm.membership.torchft_quorum import TorchftMembership

    manager = _HalvingManager(errored)
    link = LinkRate(num_islands=2)
    member = SimpleNamespace(
        codec=None,
        _manager=manager,
        _pg=SimpleNamespace(size=lambda: 2),
        last_round_bytes=0,
        _link=link,
    )
    flat = torch.tensor([5.0, 10.0, 20.0, 30.0])
    link.begin(0, {"w": flat.shape})
    link.started()
    TorchftMembership._allreduce(member, [flat])  # type: ignore[arg-type]
    link.finished()
    assert manager.buckets == [[5.0, 10.0, 20.0, 30.0]]
    assert torch.equal(flat, torch.tensor([2.5, 5.0, 10.0, 15.0]))
    assert member.last_round_bytes == (0 if errored else 16)
    # The bucket's arrival times the round; a failed exchange measures nothing.
    assert (link.rate_bps is None) if errored else (link.rate_bps is not None and link.rate_bps > 0)


def test_an_elastic_rounds_timeout_grows_with_its_payload_and_falls_with_the_measured_rate() -> (
    None
):
    """``round_timeout_s`` unset: 4x the payload's time at this rank's last measured rate
    (10 Mbit/s before any), at least 60 s; set: used as it is, whatever the payload."""
    base: dict[str, Any] = {"lighthouse": "http://h:1", "island_id": "a"}
    derived = ElasticConfig(**base).timeouts
    assert derived == LinkTimeouts("round_timeout_s", ROUND_TIMEOUT_FLOOR_S, None)
    assert derived.base_s == ROUND_TIMEOUT_FLOOR_S == 60.0
    # A small payload keeps the floor.
    assert derived.for_round(1_000_000, 12.5e6) == 60.0
    # A 1.2 GB fp32 round at 100 Mbit/s (12.5 MB/s) needs 96 s: 384 s, past the floor.
    assert derived.for_round(1_200_000_000, 12.5e6) == pytest.approx(384)
    assert derived.for_round(2_400_000_000, 12.5e6) == pytest.approx(768)  # twice the payload
    assert derived.for_round(1_200_000_000, 25e6) == pytest.approx(192)  # twice the rate
    assert derived.for_round(1_200_000_000, None) == pytest.approx(3840)  # 10 Mbit/s assumed
    explicit = ElasticConfig(**base, round_timeout_s=7).timeouts
    assert explicit.base_s == 7.0
    assert explicit.for_round(1_200_000_000, 1.0) == explicit.for_round(10, None) == 7.0
    # The strategy's option reaches the membership as it is.
    torchft = {**base, "membership": "torchft"}
    assert SwarmConfig().round_timeout_s is None
    assert elastic_options(SwarmConfig(**torchft)).round_timeout_s is None  # type: ignore[union-attr]
    options = elastic_options(SwarmConfig(**torchft, round_timeout_s=7))
    assert options is not None and options.round_timeout_s == 7


@pytest.mark.parametrize("value", [0, -5, float("inf"), "60", True])
def test_round_timeout_s_must_be_positive_seconds_or_none(value: object) -> None:
    with pytest.raises(ValueError) as caught:
        SwarmConfig(round_timeout_s=value)  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"round_timeout_s={value!r} must be a finite number of seconds above 0, e.g. "
        "round_timeout_s=300, or None to derive it from each round's payload and the measured "
        "link rate."
    )
