"""The sharded swarm transport: shard planning, bitwise equality with the rotating aggregator
(rules, codecs, rejections), bytes flat in islands, and clean failures."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_swarm import SwarmStrategy
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport import (
    RoundStats,
    SwarmAggregator,
    SwarmTransportConfig,
    build_transport,
)
from lightning_swarm.transport.aggregator.exchange import PartFold, folds
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.aggregator.terms import plan_parts
from lightning_swarm.transport.buckets import Piece
from lightning_swarm.transport.errors import SwarmRoundError
from lightning_swarm.transport.payload import PayloadMap
from tests.dist_utils import run_ranks
from tests.helpers import QUIET, Recorder, TinyRegressor, load_ranks, regression_data
from tests.transport_rounds import average

SHAPES = {"a": (37, 11), "b": (5,), "empty": (0,), "c": (1000,)}
PAYLOAD_BYTES = 4 * (37 * 11 + 5 + 1000)


def _contribution(island: int, round_index: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * island + round_index)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


# -- planning ---------------------------------------------------------------------------------
def test_parts_cover_the_payload_on_alignment_units() -> None:
    layout = PayloadMap.from_tensors(_contribution(0, 0))
    parts = plan_parts(layout, 3, 32)
    # 1412 elements: 13 + 1 + 0 + 32 units of 32 = 46 units over 3 islands: 15, 15, 16
    assert [sum(p.length for p in s.pieces) for s in parts] == [407 + 5 + 32, 480, 488]
    assert parts[0].pieces == (Piece(0, 0, 407), Piece(1, 0, 5), Piece(3, 0, 32))
    assert parts[2].pieces == (Piece(3, 512, 488),)
    assert [spec.name for spec in parts[0].layout.specs] == ["a[0:407]", "b[0:5]", "c[0:32]"]
    assert all(p.start % 32 == 0 for s in parts for p in s.pieces)
    tensors = list(_contribution(0, 0).values())
    joined = torch.cat([v for s in parts for v in s.views(tensors)])
    assert torch.equal(joined, torch.cat([t.reshape(-1) for t in tensors]))
    with pytest.raises(ValueError, match="align must be >= 1, got 0"):
        plan_parts(layout, 2, 0)


def test_option_is_validated_and_built() -> None:
    with pytest.raises(
        ValueError, match=r"swarm.aggregator must be one of \['rotating', 'sharded'\], got 'x'"
    ):
        SwarmTransportConfig(aggregator="x")
    common: dict[str, Any] = {"group": None, "num_islands": 1, "island_index": 0, "codec": None}
    common |= {"device": torch.device("cpu"), "bucket_numel": 1024}
    built = build_transport("swarm", swarm=SwarmTransportConfig(aggregator="sharded"), **common)
    assert isinstance(built, SwarmAggregator) and built.owners == "sharded"
    rotating = build_transport("swarm", swarm=SwarmTransportConfig(), **common)
    assert isinstance(rotating, SwarmAggregator) and rotating.owners == "rotating"
    built.close()
    rotating.close()


# -- the mean summed as it arrives ----------------------------------------------------------
def test_fold_sums_in_island_order_chunk_by_chunk() -> None:
    layout = PayloadMap.from_tensors({"x": torch.zeros(5), "y": torch.zeros(4)})
    assert folds(layout, "mean", None, 8) and folds(layout, "weighted_mean", None, 8)
    assert not folds(layout, "median", None, 8), "median needs every value per element"
    assert not folds(layout, "mean", 1.0, 8), "max_norm needs each island's norm"
    assert not folds(layout, "mean", None, 6), "a chunk must hold whole floats"
    assert not folds(PayloadMap.from_tensors({"h": torch.zeros(2, dtype=torch.float64)}),
                     "mean", None, 8)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    # 9 floats in chunks of 2 (8 bytes): one chunk spans "x" and "y"; values that make float
    # addition order visible
    flat = [torch.randn(9, generator=g) * 10.0 ** (3 * i) for i in range(3)]
    own = [flat[1][:5].clone(), flat[1][5:].clone()]
    for weights in (None, [0.5, 3.0, 1.5]):
        fold = PartFold(layout, own, 1, 3, 8, weights)
        for k in range(5):
            fold.add(k, {i: flat[i][2 * k : 2 * k + 2].view(torch.uint8) for i in (0, 2)})
        assert fold.finish()
        w = weights or [1.0, 1.0, 1.0]
        if weights is None:
            expected = (flat[0].clone().add_(flat[1]).add_(flat[2])).div_(3)
        else:
            expected = flat[0].mul(w[0]).add_(flat[1].mul(w[1])).add_(flat[2].mul(w[2]))
            expected.div_(sum(w))
        assert torch.equal(fold.acc, expected)
        reverse = flat[2].mul(w[2]).add_(flat[1].mul(w[1])).add_(flat[0].mul(w[0])).div_(sum(w))
        assert not torch.equal(reverse, expected), "the data must make the order visible"
        out = [torch.empty(5), torch.empty(4)]
        fold.write_into(out)
        assert torch.equal(torch.cat(out), expected)
        assert torch.equal(own[0], flat[1][:5]), "own contribution was written before the end"
    flat[2][7] = float("inf")
    fold = PartFold(layout, own, 1, 3, 8, None)
    for k in range(5):
        fold.add(k, {i: flat[i][2 * k : 2 * k + 2].view(torch.uint8) for i in (0, 2)})
    assert not fold.finish(), "an inf in one island's chunk must make the sum non-finite"


# -- equal to the rotating aggregator ---------------------------------------------------------
CASES: list[dict[str, Any]] = [
    {"aggregation": "mean"},
    {"aggregation": "median", "codec": Codec("int4", 32)},
    {"aggregation": "trimmed_mean", "trim_ratio": 0.25, "codec": Codec("int8", 32)},
    {"aggregation": "weighted_mean", "island_weights": [3.0, 1.0, 2.0, 0.5]},
    {"aggregation": "mean", "offload": False, "codec": Codec("bf16")},
    # island 1's norm is above 60 only over the whole payload (each shard's is below)
    {"aggregation": "mean", "max_norm": 60.0, "scale": {1: 1.8}},
    {"aggregation": "median", "nan": 2},  # a NaN in one shard rejects island 2 everywhere
    # the mean is summed as it arrives; a NaN makes it judge again through the spool
    {"aggregation": "mean", "nan": 1},
    {"aggregation": "weighted_mean", "island_weights": [0.0, 2.0, 1.0, 4.0], "nan": 0},
    {"aggregation": "mean", "chunk_bytes": 1001},  # chunks that split a float: spooled
    # one float64 tensor: only the last island's shard holds it, yet every island spools
    {"aggregation": "mean", "float64": True},
]


def _summed_on_arrival(case: dict[str, Any]) -> bool:
    plain = not any(k in case for k in ("codec", "max_norm", "nan", "chunk_bytes", "float64"))
    return plain and case["aggregation"] in ("mean", "weighted_mean")


def _inputs(rank: int, r: int, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    tensors = _contribution(rank, r)
    for t in tensors.values():
        t.mul_(case.get("scale", {}).get(rank, 1.0))
    if case.get("nan") == rank:
        tensors["c"][900] = float("nan")
    if case.get("float64"):
        g = torch.Generator().manual_seed(100 * rank + r)
        tensors["d"] = torch.randn(300, generator=g, dtype=torch.float64)
    return tensors


def _own_round(transport: Any, tensors: dict[str, torch.Tensor], *, round_index: int) -> RoundStats:
    return transport._average(tensors, round_index=round_index)  # type: ignore[no-any-return]


def _equal_worker(rank: int, world: int, spool_dir: str, out: str) -> None:
    sent = {}
    for index, case in enumerate(CASES):
        kw = {k: v for k, v in case.items() if k not in ("scale", "nan", "float64")}
        if "island_weights" in kw:
            kw["island_weights"] = kw["island_weights"][:world]
        kw |= {"num_islands": world, "island_index": rank}
        kw.setdefault("chunk_bytes", 1000)
        rotating = SwarmAggregator(None, spool_dir=spool_dir, **kw)
        sharded = SwarmAggregator(None, owners="sharded", spool_dir=spool_dir, **kw)
        for r in range(2):
            a, b = _inputs(rank, r, case), _inputs(rank, r, case)
            # A float64 payload is the aggregator's own round's (the contract moves float32).
            run = _own_round if case.get("float64") else average
            run(rotating, a, round_index=r)
            stats = run(sharded, b, round_index=r)
            for k in a:
                assert torch.equal(a[k], b[k]), (index, r, k)
            assert sharded.last_round is not None and rotating.last_round is not None
            assert sharded.last_round.accepted == rotating.last_round.accepted, index
            assert sharded.spool_bytes() == 0, "a round's files outlived it"
            sent[index] = stats.bytes_sent
        # a summed mean never touches the disk; any other round spools its shard
        spooled = sharded.spool is not None and sharded.spool.peak_disk_bytes > 0
        assert spooled == (case.get("offload", True) and not _summed_on_arrival(case)), index
        rotating.close()
        sharded.close()
    torch.save(sent, Path(out) / f"{rank}.pt")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_equals_rotating_bitwise(world: int, tmp_path: Path) -> None:
    spool, out = tmp_path / "spool", tmp_path / "out"
    spool.mkdir()
    out.mkdir()
    run_ranks(_equal_worker, world, str(spool), str(out), timeout_s=60)
    assert list(spool.iterdir()) == []
    if world == 4:
        sent = [torch.load(out / f"{r}.pt")[0] for r in range(world)]  # float32 mean
        # 2 (n - 1) / n of the payload (+ the tiny verdict messages), where the rotating
        # aggregator sends (n - 1) payloads
        for value in sent:
            assert 1.5 * PAYLOAD_BYTES <= value <= 1.5 * PAYLOAD_BYTES + 4 * 32 + 400, value


# -- failures ---------------------------------------------------------------------------------
def _failure_worker(rank: int, world: int, spool_dir: str) -> None:
    calls = {"n": 0}

    def disk_fills_up(fd: int, data: memoryview, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(28, "No space left on device")
        return os.pwrite(fd, data, offset)

    spool = Spool(spool_dir, write_at=disk_fills_up) if rank == 1 else None
    transport = SwarmAggregator(
        None,
        owners="sharded",
        num_islands=world,
        island_index=rank,
        spool=spool,
        spool_dir=spool_dir,
        chunk_bytes=256,
        aggregation="median",  # a mean would be summed as it arrives, with no spool
    )
    assert transport.spool is not None
    tensors = _contribution(rank, 0)
    before = {k: v.clone() for k, v in tensors.items()}
    with pytest.raises(SwarmRoundError, match=r"round 0: the spool failed on island\(s\) \[1\]"):
        average(transport, tensors, round_index=0)
    assert all(torch.equal(tensors[k], before[k]) for k in tensors), "tensors were touched"
    assert transport.last_round is not None
    assert transport.last_round.outcome == "spool_failed"
    assert transport.spool.files() == [], "a failed round left spool files"
    # a layout that differs on one island: every island raises, naming it
    odd = _contribution(rank, 1)
    if rank == 2:
        odd["b"] = torch.zeros(6)
    with pytest.raises(ValueError, match=r"layout .* of island\(s\) \[2\] differs from island 0"):
        average(transport, odd, round_index=1)
    # so do islands whose rules differ: one would sum the mean, the other spool it
    rules = SwarmAggregator(
        None,
        owners="sharded",
        num_islands=world,
        island_index=rank,
        spool_dir=spool_dir,
        aggregation="median" if rank == 1 else "mean",
    )
    with pytest.raises(ValueError, match=r"swarm options of island\(s\) \[1\] differs"):
        average(rules, _contribution(rank, 3), round_index=3)
    rules.close()
    # too few accepted contributions: skipped on every island, with the same warning
    skipped = SwarmAggregator(
        None,
        owners="sharded",
        num_islands=world,
        island_index=rank,
        spool_dir=spool_dir,
        min_contributions=3,
    )
    nan = _contribution(rank, 2)
    if rank == 0:
        nan["a"][0, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match="2 of 3 contributions were accepted"):
        assert not average(skipped, nan, round_index=2).applied
    skipped.close()
    transport.close()


def test_failures_raise_on_every_island_and_leave_no_files(tmp_path: Path) -> None:
    run_ranks(_failure_worker, 3, str(tmp_path), timeout_s=60)
    assert list(tmp_path.iterdir()) == []


def _broken_rule(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("injected aggregation bug")


class _BrokenFold(PartFold):
    def add(self, k: int, chunks: Mapping[int, torch.Tensor]) -> None:
        _broken_rule()


def _aggregation_error_worker(rank: int, world: int, spool_dir: str, aggregation: str) -> None:
    import lightning_swarm.transport.aggregator.swarm_round as round_module
    import lightning_swarm.transport.aggregator.terms as terms_module

    if rank == 0:  # a forked child: the patch dies with it
        if aggregation == "mean":  # summed as the chunks arrive
            round_module.PartFold = _BrokenFold  # type: ignore[misc]
        else:
            terms_module.aggregate = _broken_rule  # type: ignore[assignment]
    transport = SwarmAggregator(
        None,
        owners="sharded",
        num_islands=world,
        island_index=rank,
        spool_dir=spool_dir,
        aggregation=aggregation,
    )
    assert transport.spool is not None
    tensors = _contribution(rank, 0)
    before = {k: v.clone() for k, v in tensors.items()}
    if rank == 0:
        with pytest.raises(RuntimeError, match="injected aggregation bug"):
            average(transport, tensors, round_index=0)
    else:
        with pytest.raises(
            SwarmRoundError, match=r"round 0: aggregation failed on island\(s\) \[0\]"
        ):
            average(transport, tensors, round_index=0)
    if aggregation == "mean":  # the sum is written out only once every island agreed
        assert all(torch.equal(tensors[k], before[k]) for k in tensors), "tensors were touched"
    assert transport.last_round is not None
    assert transport.last_round.outcome == "error"
    assert transport.spool.files() == [], "a failed round left spool files"
    transport.close()


@pytest.mark.parametrize("aggregation", ["mean", "median"])
def test_an_aggregation_error_raises_on_every_island(tmp_path: Path, aggregation: str) -> None:
    run_ranks(_aggregation_error_worker, 2, str(tmp_path), aggregation, timeout_s=30)
    assert list(tmp_path.iterdir()) == []


# -- through Lightning ------------------------------------------------------------------------
def _fit(out: Path, **swarm: Any) -> list[dict[str, Any]]:
    out.mkdir()
    strategy = SwarmStrategy(
        sync_every=2,
        island_size=1,
        transport="swarm",
        quantize="int8",
        quantize_block_size=16,
        error_feedback=True,
        swarm={"spool_dir": str(out / "spool"), **swarm},
        sync_at_end=False,
        start_method="fork",
    )
    pl.seed_everything(5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        callbacks=[Recorder(str(out))],
        **QUIET,
    )
    trainer.fit(TinyRegressor(), regression_data())
    return load_ranks(out, 2)


def test_strategy_with_the_sharded_aggregator_trains_as_the_rotating_one(tmp_path: Path) -> None:
    rotating = _fit(tmp_path / "rotating")
    sharded = _fit(tmp_path / "sharded", aggregator="sharded")
    assert all(r["outer_steps"] == [3] for r in sharded)
    for a, b in zip(rotating[0]["steps"], sharded[0]["steps"], strict=True):
        assert torch.equal(a["anchors"][0], b["anchors"][0])
        assert torch.equal(a["params"], b["params"])
    for a, b in zip(sharded[0]["steps"], sharded[1]["steps"], strict=True):
        assert torch.equal(a["anchors"][0], b["anchors"][0]), "islands disagree"
    first, last = sharded[0]["steps"][0]["anchors"][0], sharded[0]["steps"][-1]["anchors"][0]
    assert not torch.equal(first, last)
    assert list((tmp_path / "sharded" / "spool").iterdir()) == []
    # the option reached the transport: every round, each island sends half of its encoded
    # payload and half of the float32 result, where the rotating aggregator sends all of it
    sent = [r["totals"]["bytes_sent"] for r in sharded]
    # (shards differ by at most one 16-element block: 84 bytes a round, 3 rounds)
    assert abs(sent[0] - sent[1]) <= 3 * 84 and sent[0] != rotating[0]["totals"]["bytes_sent"]
