"""Streaming DiLoCo under torchft, unit level: abandoned fragment rounds, adopted rounds.

No lighthouse here: scripted transports stand in for ``TorchftMembership`` (whose rounds
report ``applied=False`` when abandoned, and whose ``open`` may have the island adopt the
swarm's round, with a heal in the verdict).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import astuple
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.membership.round_header import HeaderRow, opening_of
from lightning_swarm.outer import OuterSync, StreamingOptions
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.transport.base import (
    Bucket,
    Done,
    Handle,
    Opening,
    RoundPlace,
    RoundRequest,
    RoundStats,
)
from tests.transport_rounds import NamedRound

SGD = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
CODEC = Codec("int8", block_size=4)


class Scripted(NamedRound):
    """Rounds applied or abandoned in the order given; the 'mean' is 0.75 x (another island)."""

    def __init__(self, applied: list[bool]) -> None:
        self.applied = list(applied)
        self.calls: list[list[str]] = []
        self.last: dict[str, Tensor] = {}  # the last round's mean, as the islands apply it

    def average_named(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        self.calls.append(list(tensors))
        for t in tensors.values():
            t.mul_(0.75)
        self.last = {name: t.clone() for name, t in tensors.items()}
        return RoundStats(applied=self.applied.pop(0))

    def close(self) -> None:
        pass


class Adopting:
    """An elastic round in which this island adopts the swarm's round ``place``: it receives
    ``mean`` (the swarm's averaged fragment, in bucket order) and the heal ``offer``."""

    pipelined = False
    block_size = 1
    bucket_numel = 1 << 20
    heals = True
    every_rank_in_round = False

    def __init__(self, place: RoundPlace, mean: Tensor, heal: dict[str, Any]) -> None:
        self.place, self.mean, self.heal = place, mean, heal
        self.offers: list[Any] = []
        self._at = 0

    def open(self, request: RoundRequest) -> Opening:
        self.offers.append(request.offer)
        return Opening(adopt=self.place)

    def start(self, bucket: Bucket) -> Handle:
        assert bucket.flat.eq(0).all(), "an adopting island contributes zeros"
        bucket.flat.copy_(self.mean[self._at : self._at + bucket.flat.numel()])
        self._at += bucket.flat.numel()
        return Done()

    def agree(self) -> RoundStats:
        return RoundStats(applied=True, heal=self.heal)

    def close(self) -> None:
        pass


def _params(seed: int) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"0.weight": (5, 3), "0.bias": (5,), "1.weight": (2, 5), "1.bias": (2,)}
    return {n: torch.nn.Parameter(torch.randn(*s, generator=g)) for n, s in shapes.items()}


def _step(params: Mapping[str, torch.nn.Parameter], step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(params.values()):
            p.add_(torch.full_like(p, 0.01 * (i + 1) * step) + 0.003 * p)


def _sync(transport: Any, worker: SyncWorker, seed: int = 0) -> OuterSync:
    params = _params(seed)
    return OuterSync(
        params,
        outer_optimizer=SGD,
        transport=transport,
        sync_every=4,
        streaming=StreamingOptions(
            fragments=[["0.weight", "0.bias"], ["1.weight", "1.bias"]],
            sync_delay=1,
            codec=CODEC,
            error_feedback=True,
            worker=worker,
        ),
    )


def test_an_abandoned_fragment_round_leaves_its_anchors_and_residuals_as_they_were() -> None:
    """2 fragments, sync_delay 1 (rounds on the worker), int8 with error feedback; rounds go
    fragment 1, 0, 1, 0, 1 (fragment 1 is offset by sync_every / 2) and the fourth, fragment
    0's second, is abandoned. It leaves fragment 0's anchors and residuals bitwise as they
    were before it; the rounds around it moved them."""
    worker = SyncWorker()
    try:
        transport = Scripted([True, True, True, False, True])
        outer = _sync(transport, worker)
        frag0 = ["0.weight", "0.bias"]
        step = 0
        snapshots: dict[str, dict[str, Tensor]] = {}
        while len(transport.calls) < 5 or outer.in_flight is not None:
            step += 1
            _step(outer.params, step)
            if len(transport.calls) == 3 and outer.in_flight is None:  # before round 4's send
                snapshots["anchors"] = {n: outer.anchors[n].clone() for n in frag0}
                snapshots["residuals"] = {n: outer.residuals[n].clone() for n in frag0}
            outer.on_inner_step()
        assert [names[0] for names in transport.calls] == ["1.weight", "0.weight"] * 2 + [
            "1.weight"
        ]
        assert outer.fragment_rounds == [1, 3]
        for name in frag0:
            assert outer.anchors[name].equal(snapshots["anchors"][name]), name
            assert outer.residuals[name].equal(snapshots["residuals"][name]), name
            assert outer.residuals[name].abs().sum() > 0  # a residual that could have moved
    finally:
        worker.close()


def test_an_adopted_round_gives_the_healed_island_the_swarms_anchors_bitwise() -> None:
    """An island healed in the swarm's fragment 1 round (its own round was fragment 0): the
    engine installs the live island's state, takes the swarm's clock and applies the same
    averaged fragment 1, in one apply on the training thread; its anchors then equal the live
    island's bit for bit, its own residuals are kept, and its progress since its old anchors
    stays on top."""
    worker = SyncWorker()
    try:
        swarm = Scripted([True] * 3)
        live = _sync(swarm, worker, seed=0)
        for step in range(1, 7):  # fragment 1 at 2 (applied at 3), 0 at 4 (5), 1 sent at 6
            _step(live.params, step)
            live.on_inner_step()
        assert live.in_flight == 1
        peer_state = live.peer_offer()  # what torchft sends during that round
        _step(live.params, 7)
        live_report = live.on_inner_step()  # the live island applies fragment 1 at step 7
        assert live_report is not None and live_report.applied
        mean = dict(swarm.last)
        assert list(mean) == ["1.weight", "1.bias"]
        flat_mean = torch.cat([t.reshape(-1) for t in mean.values()])
        transport = Adopting(RoundPlace(1, 6, 7), flat_mean, peer_state)
        island = _sync(transport, worker, seed=1)
        island.residuals = {"0.bias": torch.full((5,), 0.125)}
        own = {n: island.params[n].detach() - island.anchors[n] for n in island.params}
        report = island.engine.round(0)
        assert set(transport.offers[0]["anchors"]) == set(island.params)  # its own, for a peer
        assert report.applied and report.fragment == 1 and report.healed
        assert report.pseudo_grad_norm == live_report.pseudo_grad_norm > 0
        assert island.inner_steps == 7 and island.outer_steps == live.outer_steps
        for name in live.anchors:
            assert island.anchors[name].equal(live.anchors[name]), name
        assert island.residuals["0.bias"].equal(torch.full((5,), 0.125))
        for name in ("0.weight", "0.bias"):  # not in the round: new anchors + own progress
            expected = live.anchors[name] + own[name]
            assert island.params[name].detach().equal(expected), name
    finally:
        worker.close()


def test_a_member_being_healed_adopts_the_swarms_round_and_only_a_fragment_split_abandons() -> None:
    def row(nonce: int, place: RoundPlace, healing: bool = False) -> HeaderRow:
        return HeaderRow(1, 7, int(healing), 0, nonce, 1, 5, 10, *astuple(place))

    swarm, other = RoundPlace(1, 6, 7), RoundPlace(0, 4, 5)
    live, joiner = row(1, swarm), row(2, other, healing=True)
    healing = opening_of([live, joiner], joiner)
    assert healing.adopt == swarm and not healing.abandon
    kept = opening_of([live, joiner], live)
    assert kept.adopt is None and not kept.abandon
    split = opening_of([live, row(2, other)], row(2, other))
    assert split.adopt == swarm and split.abandon
    drift = opening_of([live, row(2, RoundPlace(1, 5, 6))], row(2, RoundPlace(1, 5, 6)))
    assert drift.adopt is None and not drift.abandon  # same fragment: both average it


def test_streaming_options_are_accepted_with_torchft_and_the_swarm_transport_refused() -> None:
    """Fragments, sync_delay, merge_alpha and quantization with error feedback build an
    elastic config (they were refused before); the swarm transport is refused by name."""
    import pytest

    from lightning_swarm.config import SwarmConfig
    from lightning_swarm.membership import elastic_options

    torchft = {"membership": "torchft", "lighthouse": "http://h:1", "island_id": "a"}
    streaming = SwarmConfig(
        **torchft,  # type: ignore[arg-type]
        num_fragments=2,
        sync_delay=1,
        merge_alpha=0.5,
        quantize="int4",
        error_feedback=True,
    )
    options = elastic_options(streaming)
    assert options is not None and options.island_id == "a"
    swarm = SwarmConfig(**torchft, transport="swarm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="transport='swarm'") as caught:
        elastic_options(swarm)
    assert "transport='allreduce'" in str(caught.value)


def test_a_join_applies_a_round_in_flight_restored_from_a_checkpoint_first() -> None:
    """A checkpoint written with sync_delay > 0 between a round's send and its apply holds
    that round (its averaged result); an elastic island resumed from it applies the round
    before its first elastic round (it refused to start before: a round in flight)."""
    worker = SyncWorker()
    try:
        saved = _sync(Scripted([True] * 3), worker)
        for step in range(1, 3):  # fragment 1 sent after step 2, in flight
            _step(saved.params, step)
            saved.on_inner_step()
        assert saved.in_flight == 1
        state = saved.state_dict()  # waits for the exchange; holds its mean
        resumed = _sync(Scripted([True]), worker)
        resumed.load_state_dict(state)
        assert resumed.in_flight == 1
        report = resumed.join()
        assert resumed.fragment_rounds == [1, 1]  # the restored round, then the join's
        assert report.applied and resumed.in_flight is None
        _step(saved.params, 3)
        saved.on_inner_step()  # the uninterrupted island applies it at step 3
        for name in ("1.weight", "1.bias"):
            assert resumed.anchors[name].equal(saved.anchors[name]), name
    finally:
        worker.close()


class _Quorum:
    """Two islands' torchft process group in one process (one thread per island): just the
    ``alltoall_base`` the quantized mean uses, with a barrier where gloo would wait."""

    def __init__(self) -> None:
        import threading

        self.barrier = threading.Barrier(2)
        self.deposits: dict[int, list[Tensor]] = {}

    def member(self, rank: int) -> Any:
        quorum = self

        class Parent:
            def rank(self) -> int:
                return rank

        class Work:
            def wait(self) -> None:
                pass

        class Member:
            parent = Parent()

            def size(self) -> int:
                return 2

            def alltoall_base(
                self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], _: Any
            ) -> Work:
                quorum.deposits[rank] = list(inp.split(in_splits))
                quorum.barrier.wait()
                out.copy_(torch.cat([quorum.deposits[src][rank] for src in (0, 1)]))
                quorum.barrier.wait()  # both read before the next exchange overwrites
                return Work()

        return Member()


class _Manager:
    def __init__(self, participating: bool) -> None:
        self.participating = participating
        self.errors: list[Exception] = []

    def num_participants(self) -> int:
        return 1  # the island being healed is not counted

    def is_participating(self) -> bool:
        return self.participating

    def report_error(self, err: Exception) -> None:
        self.errors.append(err)


def test_the_quantized_quorum_mean_leaves_the_healed_island_out_and_agrees_bitwise() -> None:
    """Island 0 contributes x, island 1 is being healed (its tensors are its own pseudo-
    gradient, which must not count): both get decode(encode(decode(encode(x)) / 1)) bit for
    bit, and the bytes of a reduce-scatter of the encoded payload."""
    import threading

    from lightning_swarm.membership.torchft_quorum import coded_quorum_mean
    from lightning_swarm.transport.buckets import plan_buckets, plan_shares
    from lightning_swarm.transport.reduce_scatter import reduce_scatter_bytes

    codec = Codec("int8", block_size=4)
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(10, generator=g), torch.randn(3, 2, generator=g)]
    own = [torch.randn(10, generator=g), torch.randn(3, 2, generator=g)]  # the healed one's
    tensors = {0: [t.clone() for t in x], 1: [t.clone() for t in own]}
    managers = {0: _Manager(True), 1: _Manager(False)}
    quorum, moved = _Quorum(), {}

    def island(rank: int) -> None:
        flats = [t.view(-1) for t in tensors[rank]]
        member, moved[rank] = quorum.member(rank), 0
        for bucket in plan_buckets([f.numel() for f in flats], 8, codec.block_size):
            runs = [flats[p.tensor_index][p.start : p.stop] for p in bucket]
            moved[rank] += coded_quorum_mean(managers[rank], member, runs, codec)

    threads = [threading.Thread(target=island, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not managers[0].errors and not managers[1].errors
    for got0, got1, want in zip(tensors[0], tensors[1], x, strict=True):
        expected = codec.roundtrip(codec.roundtrip(want.view(-1))).view(want.shape)
        assert got0.equal(got1)
        assert got0.equal(expected)
    buckets = plan_buckets([10, 6], 8, codec.block_size)
    sizes = [
        [sum(codec.encoded_nbytes(p.length) for p in s) for s in plan_shares(b, 2, 4)]
        for b in buckets
    ]
    assert moved[0] == sum(reduce_scatter_bytes(s, 0) for s in sizes) > 0
    assert moved[1] == sum(reduce_scatter_bytes(s, 1) for s in sizes)
