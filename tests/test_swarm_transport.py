"""The swarm transport over real gloo process groups (forked ranks on CPU), and its options."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_swarm import SwarmConfigError, SwarmStrategy
from lightning_swarm.algorithm import robust
from lightning_swarm.config import SwarmConfig, SwarmTransportConfig
from lightning_swarm.outer import OuterSync
from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.aggregator.spool import Spool
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.errors import SpoolError, SwarmRoundError
from lightning_swarm.transport.payload import PayloadMap
from tests.dist_utils import run_ranks as _run
from tests.helpers import QUIET, Recorder, TinyRegressor, load_ranks, regression_data
from tests.transport_rounds import average

# What every rank sends to (and receives from) each other island besides payloads, float64 /
# int64 fields: the round's terms (CRC, chunk, 2 stream lengths, description length, 4 rule
# fields, one weight per island), its verdict row (status, finite and sum of squares per
# island) and its success flag.
CONTROL_BYTES = lambda world: (world - 1) * 8 * ((10 + world) + (1 + 2 * world) + 1)  # noqa: E731


def _num_accepted(transport: SwarmAggregator) -> int:
    assert transport.last_round is not None
    return len(transport.last_round.accepted)


def _contribution(island: int, round_index: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_index + island)
    return {
        "w": torch.randn(70, 30, generator=g),  # 8400 bytes: several chunks, none full at the end
        "b": torch.randn(33, generator=g),
        "s": torch.randn((), generator=g),
    }


def _reference(rule: str, world: int, round_index: int, **kw: Any) -> dict[str, torch.Tensor]:
    per_island = [_contribution(i, round_index) for i in range(world)]
    return {k: robust.aggregate(rule, [c[k] for c in per_island], **kw) for k in per_island[0]}


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _capture_log() -> _Messages:
    handler = _Messages()
    logging.getLogger("lightning_swarm.transport.aggregator").addHandler(handler)
    return handler


# -- exact results ---------------------------------------------------------------------------
def _exact_worker(rank: int, world: int, spool_dir: str) -> None:
    common = {"num_islands": world, "island_index": rank, "spool_dir": spool_dir}
    weights = [float(i + 1) for i in range(world)]
    cases = {
        "offload": (SwarmAggregator(None, chunk_bytes=1000, **common), "mean", {}),
        "memory": (
            SwarmAggregator(None, offload=False, chunk_bytes=1000, **common),
            "mean",
            {},
        ),
        "median": (
            SwarmAggregator(None, aggregation="median", chunk_bytes=600, **common),
            "median",
            {},
        ),
        "trimmed": (
            SwarmAggregator(None, aggregation="trimmed_mean", trim_ratio=0.25, **common),
            "trimmed_mean",
            {"trim_ratio": 0.25},
        ),
        "weighted": (
            SwarmAggregator(
                None, aggregation="weighted_mean", island_weights=weights, chunk_bytes=999, **common
            ),
            "weighted_mean",
            {"weights": weights},
        ),
    }
    payload = PayloadMap.from_tensors(_contribution(0, 0))
    for r in range(world):  # every island aggregates once
        for name, (transport, rule, kw) in cases.items():
            tensors = _contribution(rank, r)
            stats = average(transport, tensors, round_index=r)
            expected = _reference(rule, world, r, **kw)
            for key in tensors:
                assert torch.equal(tensors[key], expected[key]), f"{name} round {r} {key}"
            assert stats.applied and _num_accepted(transport) == world
            assert transport.last_round is not None and transport.last_round.aggregator == r
            # the owner takes in n - 1 payloads and sends n - 1 results; a peer one of each
            moved = payload.data_bytes * ((world - 1) if rank == r else 1)
            assert stats.bytes_received == stats.bytes_sent == moved + CONTROL_BYTES(world)
            assert transport.spool_bytes() == 0, "a round's files outlived its aggregation"
        # the reference median / trimmed mean also agree with numpy's
        stacked = np.stack([_contribution(i, r)["w"].numpy() for i in range(world)])
        tensors = _contribution(rank, r)
        average(cases["median"][0], tensors, round_index=r)
        np.testing.assert_allclose(tensors["w"].numpy(), np.median(stacked, 0), rtol=1e-6)
        allreduce = AllReduceTransport(None, num_islands=world, bucket_numel=333)
        tensors = _contribution(rank, r)
        average(allreduce, tensors, round_index=r)
        mean = _reference("mean", world, r)
        assert all(torch.allclose(tensors[k], mean[k], atol=1e-6) for k in tensors)
    offload = cases["offload"][0]
    file_bytes = len(payload.safetensors_header({"round": "0", "island": "1"})) + payload.data_bytes
    assert offload.spool is not None
    assert offload.spool.peak_disk_bytes == (world - 1) * file_bytes
    assert offload.spool is not None
    root = offload.spool.root
    for transport, _, _ in cases.values():
        transport.close()
    assert not root.exists()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_result_equals_in_memory_reference_exactly(tmp_path: Path, world: int) -> None:
    _run(_exact_worker, world, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


# -- validation ------------------------------------------------------------------------------
def _poison(tensors: dict[str, torch.Tensor], rank: int, bad: dict[int, str]) -> None:
    if bad.get(rank) == "nan":
        tensors["w"][3, 4] = float("nan")
    elif bad.get(rank) == "inf":
        tensors["s"].fill_(float("inf"))
    elif bad.get(rank) == "big":
        tensors["b"].mul_(1e4)


def _validation_worker(rank: int, world: int, spool_dir: str) -> None:
    messages = _capture_log()
    transport = SwarmAggregator(
        None,
        num_islands=world,
        island_index=rank,
        spool_dir=spool_dir,
        max_norm=500.0,
        min_contributions=2,
        chunk_bytes=512,
    )
    # round 0, aggregator 0: islands 1 (NaN) and 2 (norm) are left out; the mean divides by 2
    tensors = _contribution(rank, 0)
    _poison(tensors, rank, {1: "nan", 2: "big"})
    stats = average(transport, tensors, round_index=0)
    kept = [_contribution(0, 0), _contribution(3, 0)]
    for k in tensors:
        assert torch.equal(tensors[k], robust.mean([c[k] for c in kept])), k
    assert stats.applied and _num_accepted(transport) == 2
    if rank == 0:
        report = transport.last_round
        assert report is not None and report.accepted == [0, 3]
        assert report.rejected[1] == "non-finite values (NaN or Inf) in tensor 'w'"
        assert "exceeds max_norm=500" in report.rejected[2]
        assert any("contribution of island 1 rejected" in m for m in messages.lines)
    if rank == 1:
        assert any("rejected this island's contribution (non-finite" in m for m in messages.lines)
    # round 1, aggregator 1: three islands bad -> 1 accepted < min_contributions=2: skipped
    tensors = _contribution(rank, 1)
    _poison(tensors, rank, {0: "inf", 2: "nan", 3: "big"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = average(transport, tensors, round_index=1)
    assert not stats.applied and _num_accepted(transport) == 1
    text = [str(w.message) for w in caught]
    assert any(
        "skipped: 1 of 4 contributions were accepted, fewer than min_contributions=2" in t
        and "anchors are unchanged" in t
        for t in text
    ), text
    # round 2, aggregator 2: island 3's layout differs; it raises, the others average without it
    tensors = _contribution(rank, 2)
    if rank == 3:
        tensors["extra"] = torch.zeros(3)
        with pytest.raises(SwarmConfigError, match="layout .* differs from the aggregator's"):
            average(transport, tensors, round_index=2)  # a SwarmError and a ValueError
    else:
        average(transport, tensors, round_index=2)
        expected = [_contribution(i, 2) for i in range(3)]
        assert all(torch.equal(tensors[k], robust.mean([c[k] for c in expected])) for k in tensors)
    if rank == 2:
        assert "payload layout differs: names differ" in transport.last_round.rejected[3]  # type: ignore[union-attr]
    # round 3, aggregator 3: island 1 holds other slices of the same names and shapes (its
    # layout's fingerprint differs): it raises, the others average without it.
    tensors = _contribution(rank, 3)
    if rank == 1:
        with pytest.raises(SwarmConfigError, match="layout .* differs from the aggregator's"):
            average(transport, tensors, round_index=3, layout=2)
    else:
        average(transport, tensors, round_index=3, layout=1)
        expected = [_contribution(i, 3) for i in (0, 2, 3)]
        assert all(torch.equal(tensors[k], robust.mean([c[k] for c in expected])) for k in tensors)
    if rank == 3:
        assert "payload layout differs" in transport.last_round.rejected[1]  # type: ignore[union-attr]
    transport.close()


def test_invalid_contributions_are_left_out_or_skip_the_round(tmp_path: Path) -> None:
    _run(_validation_worker, 4, str(tmp_path))


def _owner_terms_worker(rank: int, world: int, spool_dir: str) -> None:
    # Island 1 runs other options: with the rotating aggregator the owner's rule and chunk size
    # rule each round, as they always did, on every rank alike.
    options: dict[str, Any] = {"chunk_bytes": 300, "max_norm": 1e-9} if rank == 1 else {}
    transport = SwarmAggregator(
        None, num_islands=world, island_index=rank, spool_dir=spool_dir, **options
    )
    tensors = _contribution(rank, 0)
    stats = average(transport, tensors, round_index=0)  # owner 0: no bound, 4 MiB chunks
    assert stats.applied and _num_accepted(transport) == world
    reference = _reference("mean", world, 0)
    assert all(torch.equal(tensors[k], reference[k]) for k in tensors)
    tensors = _contribution(rank, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = average(transport, tensors, round_index=1)  # owner 1: every island is too big
    assert not stats.applied and _num_accepted(transport) == 0
    assert any("0 of 2 contributions were accepted" in str(w.message) for w in caught)
    assert all(torch.equal(tensors[k], _contribution(rank, 1)[k]) for k in tensors)
    transport.close()


def test_the_owners_options_rule_its_round(tmp_path: Path) -> None:
    _run(_owner_terms_worker, 2, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _anchors_worker(rank: int, world: int, spool_dir: str) -> None:
    transport = SwarmAggregator(
        None, num_islands=world, island_index=rank, spool_dir=spool_dir, min_contributions=2
    )
    param = torch.nn.Parameter(torch.arange(6.0))
    outer = OuterSync(
        {"p": param},
        outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
        transport=transport,
        sync_every=1,
    )
    with torch.no_grad():
        param.add_(float("nan") if rank == 1 else 1.0)  # island 1 diverged
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = outer.on_inner_step()
    assert report is not None and not report.applied
    assert torch.equal(outer.anchors["p"], torch.arange(6.0)), "a skipped round moved anchors"
    transport.close()


def test_skipped_round_leaves_anchors_unchanged(tmp_path: Path) -> None:
    _run(_anchors_worker, 2, str(tmp_path))


# -- spool failures --------------------------------------------------------------------------
class _TruncatingSpool(Spool):
    """Plays a disk that loses the end of a file between its write and its read."""

    def reader(self, round_id: int, island: int, layout: PayloadMap, **kw: Any) -> Any:
        path = self.path(round_id, island)
        os.truncate(path, path.stat().st_size - 8)
        return super().reader(round_id, island, layout, **kw)


def _failures_worker(rank: int, world: int, spool_dir: str) -> None:
    calls = {"n": 0}

    def disk_fills_up(fd: int, data: memoryview, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 4:
            raise OSError(28, "No space left on device")
        return os.pwrite(fd, data, offset)

    spool = None  # the default one, except on the two aggregators that meet trouble
    if rank == 0:
        spool = Spool(spool_dir, write_at=disk_fills_up)
    elif rank == 2:
        spool = _TruncatingSpool(spool_dir)
    transport = SwarmAggregator(
        None,
        num_islands=world,
        island_index=rank,
        spool=spool,
        spool_dir=spool_dir,
        chunk_bytes=1024,
    )
    assert transport.spool is not None
    expected = {
        0: r"round 0 failed on this aggregator \(island 0\): out of disk space \(ENOSPC\)",
        2: r"round 2 failed on this aggregator \(island 2\): spool file .* is truncated",
    }
    for r in (0, 2):
        tensors = _contribution(rank, r)
        before = {k: v.clone() for k, v in tensors.items()}
        message = expected[r] if rank == r else rf"failed on the aggregator \(island {r}\)"
        with pytest.raises(SwarmRoundError, match=message):
            average(transport, tensors, round_index=r)
        assert all(torch.equal(tensors[k], before[k]) for k in tensors), "tensors were touched"
        assert transport.spool.files() == [], "a failed round left spool files"
        # the failure was clean: the next round (another aggregator) works and is exact
        tensors = _contribution(rank, r + 1)
        average(transport, tensors, round_index=r + 1)
        reference = _reference("mean", world, r + 1)
        assert all(torch.equal(tensors[k], reference[k]) for k in tensors)
    transport.close()


def test_spool_failures_fail_the_round_cleanly_on_every_rank(tmp_path: Path) -> None:
    _run(_failures_worker, 4, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


# -- errors on the aggregator ----------------------------------------------------------------
def _zero_weights_worker(rank: int, world: int, spool_dir: str) -> None:
    transport = SwarmAggregator(
        None,
        num_islands=world,
        island_index=rank,
        spool_dir=spool_dir,
        aggregation="weighted_mean",
        island_weights=[0.0, 1.0],
    )
    tensors = _contribution(rank, 0)
    _poison(tensors, rank, {1: "nan"})  # only island 0, of weight 0, is accepted
    before = {k: v.clone() for k, v in tensors.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = average(transport, tensors, round_index=0)
    assert not stats.applied and _num_accepted(transport) == 1
    text = [str(w.message) for w in caught]
    assert any(
        "swarm round 0 skipped: the accepted islands [0] have island_weights summing to 0" in t
        and "anchors are unchanged" in t
        for t in text
    ), text
    assert all(torch.allclose(tensors[k], before[k], 0, 0, equal_nan=True) for k in tensors)
    assert transport.last_round is not None and transport.last_round.outcome == "skipped"
    # the next round (island 1 aggregates, both accepted) applies the weighted mean
    tensors = _contribution(rank, 1)
    assert average(transport, tensors, round_index=1).applied
    reference = _reference("weighted_mean", world, 1, weights=[0.0, 1.0])
    assert all(torch.equal(tensors[k], reference[k]) for k in tensors)
    transport.close()


def test_zero_weight_of_the_accepted_islands_skips_the_round(tmp_path: Path) -> None:
    _run(_zero_weights_worker, 2, str(tmp_path), timeout_s=20)
    assert list(tmp_path.iterdir()) == []


def _broken_rule(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("injected aggregation bug")


def _aggregator_error_worker(rank: int, world: int, spool_dir: str) -> None:
    import lightning_swarm.transport.aggregator.terms as aggregator_module

    if rank == 0:  # a forked child: the patch dies with it
        aggregator_module.aggregate = _broken_rule
    transport = SwarmAggregator(None, num_islands=world, island_index=rank, spool_dir=spool_dir)
    assert transport.spool is not None
    tensors = _contribution(rank, 0)
    if rank == 0:
        with pytest.raises(RuntimeError, match="injected aggregation bug"):
            average(transport, tensors, round_index=0)
    else:
        with pytest.raises(
            SwarmRoundError,
            match=r"round 0 failed on the aggregator \(island 0\): it raised an error while "
            r"validating or aggregating; read island 0's log",
        ):
            average(transport, tensors, round_index=0)
    assert transport.last_round is not None and transport.last_round.outcome == "error"
    assert transport.spool.files() == [], "a failed round left spool files"
    # the failure was clean: the next round (island 1 aggregates) works and is exact
    tensors = _contribution(rank, 1)
    average(transport, tensors, round_index=1)
    reference = _reference("mean", world, 1)
    assert all(torch.equal(tensors[k], reference[k]) for k in tensors)
    transport.close()


@pytest.mark.timeout(90)
def test_unexpected_error_on_the_aggregator_raises_on_every_rank(tmp_path: Path) -> None:
    # A 20 s process-group timeout: a peer left waiting for the status fails fast, not in 30 min.
    _run(_aggregator_error_worker, 2, str(tmp_path), timeout_s=20)
    assert list(tmp_path.iterdir()) == []


# -- options ---------------------------------------------------------------------------------
def test_transport_options_are_checked(tmp_path: Path) -> None:
    common: dict[str, Any] = {"num_islands": 3, "island_index": 0, "offload": False}
    with pytest.raises(ValueError, match=r"min_contributions=4 must lie in 1..3"):
        SwarmAggregator(None, min_contributions=4, **common)
    with pytest.raises(ValueError, match="needs island_weights with one weight per island"):
        SwarmAggregator(None, aggregation="weighted_mean", island_weights=[1.0], **common)
    with pytest.raises(ValueError, match="aggregation='vote' is not known"):
        SwarmAggregator(None, aggregation="vote", **common)
    with pytest.raises(
        ValueError, match=r"owners must be one of \['rotating', 'sharded'\], got 'x'"
    ):
        SwarmAggregator(None, owners="x", **common)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SpoolError, match="cannot create the spool under spool_dir"):
        SwarmAggregator(None, num_islands=2, island_index=0, spool_dir=str(blocker))


def test_swarm_config_validates_and_converts_dicts() -> None:
    config = SwarmConfig(transport="swarm", swarm={"offload": False, "chunk_mb": 0.5})
    assert isinstance(config.swarm, SwarmTransportConfig)
    assert config.swarm.chunk_bytes == 2**19 and not config.swarm.offload
    bad: list[tuple[dict[str, Any], str]] = [
        ({"aggregation": "mode"}, "swarm.aggregation='mode' is not known"),
        ({"trim_ratio": 0.5}, r"swarm.trim_ratio must lie in \[0, 0.5\)"),
        ({"min_contributions": 0}, "swarm.min_contributions must be a positive integer"),
        ({"max_norm": -1.0}, "swarm.max_norm must be a positive number or null"),
        ({"chunk_mb": 0}, r"swarm.chunk_mb=0 is below the floor of 0.25 MiB.*chunk_mb=4"),
        ({"chunk_mb": 1e-9}, r"swarm.chunk_mb=1e-09 is below the floor of 0.25 MiB"),
        ({"chunk_mb": float("inf")}, "swarm.chunk_mb must be a finite number of MiB"),
        ({"cleanup_timeout_s": float("nan")}, "swarm.cleanup_timeout_s must be a positive"),
        ({"offload": "yes"}, "swarm.offload must be true or false"),
        ({"aggregation": "weighted_mean"}, "needs swarm.island_weights"),
        ({"island_weights": [1.0, -2.0]}, "swarm.island_weights must be a list of finite"),
        ({"island_weights": [0, 0]}, "do not all equal 0"),
        ({"island_weights": 5}, r"swarm.island_weights must be a list .* got 5; e.g. \[2, 1\]"),
        ({"spool_dir": 123}, r"swarm.spool_dir must be a directory path .* got 123"),
        ({"spool": "/tmp"}, r"swarm has unknown keys \['spool'\]"),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            SwarmConfig(transport="swarm", swarm=options)
    with pytest.raises(
        TypeError, match="swarm must be a dict such as .* or an instance of SwarmTransportConfig"
    ):
        SwarmConfig(transport="swarm", swarm=3)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="island_weights has no effect unless"):
        SwarmTransportConfig(island_weights=[1.0, 2.0])
    home = SwarmTransportConfig(spool_dir="~/spool").spool_dir
    assert home == os.path.join(os.path.expanduser("~"), "spool") and "~" not in str(home)


def test_swarm_options_with_allreduce_warn() -> None:
    with pytest.warns(
        UserWarning, match="swarm transport options have no effect with transport='allreduce'"
    ):
        SwarmStrategy(swarm={"offload": False})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*swarm transport options.*")
        SwarmStrategy()  # defaults: nothing to warn about
        SwarmStrategy(transport="swarm", swarm={"offload": False})


# -- through Lightning -----------------------------------------------------------------------
def _fit(tmp_path: Path, name: str, **strategy_kw: Any) -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    strategy = SwarmStrategy(
        sync_every=3,
        island_size=2,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        start_method="fork",
        **strategy_kw,
    )
    pl.seed_everything(11)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=9,
        callbacks=[Recorder(str(out))],
        **QUIET,
    )
    trainer.fit(TinyRegressor(), regression_data())
    return load_ranks(out, 4)


def test_offload_on_and_off_train_identically_through_lightning(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    runs = {
        "offload": _fit(tmp_path, "on", transport="swarm", swarm={"spool_dir": str(spool_dir)}),
        "memory": _fit(tmp_path, "off", transport="swarm", swarm={"offload": False}),
        "allreduce": _fit(tmp_path, "allreduce"),
    }
    for ranks in runs.values():
        assert all(r["outer_steps"] == [3] for r in ranks)
        assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)
    on, off = runs["offload"], runs["memory"]
    for step_on, step_off in zip(on[0]["steps"], off[0]["steps"], strict=True):
        assert torch.equal(step_on["params"], step_off["params"])
        assert torch.equal(step_on["anchors"][0], step_off["anchors"][0])
    assert torch.allclose(on[0]["final"], runs["allreduce"][0]["final"], atol=1e-6)
    assert not torch.equal(on[0]["steps"][0]["anchors"][0], on[0]["final"])
    assert list(spool_dir.iterdir()) == [], "teardown must remove every rank's spool root"
