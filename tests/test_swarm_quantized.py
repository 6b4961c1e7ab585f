"""Quantized payloads on the swarm transport: exact results over gloo (forked ranks on CPU),
validation of decoded values, bytes on the wire, and a Streaming DiLoCo run through Lightning."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_swarm import SwarmStrategy
from lightning_swarm.algorithm import robust
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.transport.aggregator.contributions import CodedPayload, encode_marked
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.payload import PayloadMap
from tests.dist_utils import run_ranks as _run
from tests.helpers import QUIET, Recorder, TinyRegressor, load_ranks, regression_data
from tests.transport_rounds import average

BLOCK = 16
# Besides payloads, to and from each other island: the round's terms (9 + n float64), its
# verdict row (1 + 2n) and its success flag (1): as in test_swarm_transport.py.
CONTROL_BYTES = lambda world: (world - 1) * 8 * ((10 + world) + (1 + 2 * world) + 1)  # noqa: E731


def _num_accepted(transport: SwarmAggregator) -> int:
    assert transport.last_round is not None
    return len(transport.last_round.accepted)


def _contribution(island: int, round_index: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_index + island)
    return {
        "w": torch.randn(70, 30, generator=g),  # 2100 elements: many blocks and chunks
        "b": torch.randn(33, generator=g) * 1e-3,  # odd count: int4's last byte is half used
        "s": torch.randn((), generator=g),
    }


def _quantized_mean(
    codec: Codec, world: int, round_index: int, rule: str = "mean"
) -> dict[str, torch.Tensor]:
    """The in-memory reference: the rule over islands of decode(encode(x_i)), island order."""
    per_island = [_contribution(i, round_index) for i in range(world)]
    return {
        k: robust.aggregate(
            rule, [codec.roundtrip(c[k].reshape(-1)).view_as(c[k]) for c in per_island]
        )
        for k in per_island[0]
    }


# -- exact results ---------------------------------------------------------------------------
def _exact_worker(rank: int, world: int, spool_dir: str) -> None:
    layout = PayloadMap.from_tensors(_contribution(0, 0))
    for name in ("bf16", "int8", "int4"):
        codec = Codec(name, BLOCK)
        wire = CodedPayload(layout, codec).wire
        common: dict[str, Any] = {"num_islands": world, "island_index": rank, "codec": codec}
        offload = SwarmAggregator(None, spool_dir=spool_dir, chunk_bytes=1000, **common)
        memory = SwarmAggregator(None, offload=False, chunk_bytes=333, **common)
        median = SwarmAggregator(None, aggregation="median", spool_dir=spool_dir, **common)
        for r in range(world):  # every island aggregates once
            tensors = _contribution(rank, r)
            average(median, tensors, round_index=r)
            expected = _quantized_mean(codec, world, r, "median")
            assert all(torch.equal(tensors[k], expected[k]) for k in tensors), f"{name} median"
            expected = _quantized_mean(codec, world, r)
            # the encoded payload is what travels towards the aggregator, float32 comes back
            upload, download = wire.data_bytes, layout.data_bytes
            for transport in (offload, memory):
                tensors = _contribution(rank, r)
                stats = average(transport, tensors, round_index=r)
                for k in tensors:
                    assert torch.equal(tensors[k], expected[k]), f"{name} {transport} round {r} {k}"
                assert stats.applied
                assert isinstance(transport, SwarmAggregator) and _num_accepted(transport) == world
                control = CONTROL_BYTES(world)
                if rank == r:
                    assert (stats.bytes_sent, stats.bytes_received) == (
                        (world - 1) * download + control,
                        (world - 1) * upload + control,
                    )
                else:
                    assert (stats.bytes_sent, stats.bytes_received) == (
                        upload + control,
                        download + control,
                    )
            assert offload.spool_bytes() == 0, "a round's files outlived its aggregation"
        # by hand for numels 2100, 33, 1 with 16-element blocks (int4: half a byte, rounded up)
        hand = {"bf16": 2 * 2134, "int8": 2134 + 4 * (132 + 3 + 1), "int4": 1051 + 17 + 4 * 136}
        assert wire.data_bytes == hand[name] and layout.data_bytes == 4 * 2134
        header = wire.safetensors_header({"round": "0", "island": "1"})
        assert offload.spool is not None
        assert offload.spool.peak_disk_bytes == (world - 1) * (len(header) + wire.data_bytes)
        for transport in (offload, memory, median):
            transport.close()


@pytest.mark.parametrize("world", [2, 3])
def test_quantized_swarm_equals_the_quantized_reference_exactly(tmp_path: Path, world: int) -> None:
    _run(_exact_worker, world, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_one_island_gets_its_own_round_trip() -> None:
    codec = Codec("int4", BLOCK)
    transport = SwarmAggregator(None, num_islands=1, island_index=0, codec=codec)
    tensors = _contribution(0, 0)
    average(transport, tensors, round_index=0)
    assert all(torch.equal(v, _quantized_mean(codec, 1, 0)[k]) for k, v in tensors.items())
    transport.close()


# -- validation of decoded values ------------------------------------------------------------
def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def _validation_worker(rank: int, world: int, spool_dir: str) -> None:
    codec = Codec("int4", BLOCK)
    own = _contribution(0, 0)
    for t in own.values():
        t.mul_(10.0)
    decoded = {k: codec.roundtrip(v.reshape(-1)).view_as(v) for k, v in own.items()}
    raw_norm, decoded_norm = _norm(own), _norm(decoded)
    assert abs(raw_norm - decoded_norm) > 1e-3 * raw_norm  # int4 changes the norm measurably
    # Between the two norms: whether island 0 counts tells which values were checked.
    max_norm = (raw_norm + decoded_norm) / 2
    transport = SwarmAggregator(
        None,
        num_islands=world,
        island_index=rank,
        spool_dir=spool_dir,
        codec=codec,
        max_norm=max_norm,
        chunk_bytes=512,
    )
    tensors = own if rank == 0 else _contribution(rank, 0)
    if rank == 1:
        tensors["w"][3, 4] = float("nan")  # cannot be encoded: marked, decodes to NaN
    assert average(transport, tensors, round_index=0).applied
    own_counts = decoded_norm <= max_norm
    kept = ([decoded] if own_counts else []) + [
        {k: codec.roundtrip(v.reshape(-1)).view_as(v) for k, v in _contribution(2, 0).items()}
    ]
    for k in tensors:
        assert torch.equal(tensors[k], robust.mean([c[k] for c in kept])), k
    assert _num_accepted(transport) == len(kept)
    if rank == 0:
        report = transport.last_round
        assert report is not None and report.accepted == ([0, 2] if own_counts else [2])
        assert report.rejected[1] == "non-finite values (NaN or Inf) in tensor 'w'"
        if not own_counts:
            assert f"exceeds max_norm={max_norm:g}" in report.rejected[0]
    # round 1 (aggregator 1): island 2 was configured with another codec; it alone fails
    if rank == 2:
        other = SwarmAggregator(
            None, num_islands=world, island_index=rank, offload=False, codec=Codec("int8", BLOCK)
        )
        with pytest.raises(ValueError, match="the same quantize and quantize_block_size"):
            average(other, _contribution(rank, 1), round_index=1)
    else:
        tensors = _contribution(rank, 1)
        assert average(transport, tensors, round_index=1).applied and _num_accepted(transport) == 2
    if rank == 1:
        report = transport.last_round
        assert report is not None and report.rejected[2] == (
            "payload layout differs: tensor 'w#data' is [2100] torch.int8, expected [1050] "
            "torch.uint8"
        )
    transport.close()


def test_validation_sees_decoded_values(tmp_path: Path) -> None:
    _run(_validation_worker, 3, str(tmp_path))


def test_marked_encoding_decodes_non_finite_values_as_nan() -> None:
    x = torch.linspace(-1.0, 1.0, 40)
    x[5], x[37] = float("inf"), float("nan")
    for name in ("none", "bf16", "int8", "int4"):
        codec = Codec(name, BLOCK)
        out = codec.decode(encode_marked(codec, x))
        bad = torch.zeros(40, dtype=torch.bool)
        if name in ("int8", "int4"):  # the whole block of a bad element
            bad[0:16] = bad[32:40] = True
        else:
            bad[5] = bad[37] = True
        assert bool(out[bad].isnan().all()) and bool(out[~bad].isfinite().all()), name
        finite = x.clone()
        finite[5] = finite[37] = 0.0
        assert torch.equal(codec.decode(encode_marked(codec, finite)), codec.roundtrip(finite))
    big = torch.tensor([1.0, 3.5e38])  # finite in float32, beyond bfloat16's range
    assert bool(Codec("bf16").decode(encode_marked(Codec("bf16"), big))[1].isnan())


def test_quantized_swarm_needs_float32() -> None:
    layout = PayloadMap.from_tensors({"h": torch.zeros(4, dtype=torch.float16)})
    with pytest.raises(ValueError, match="quantize='int8' encodes float32 pseudo-gradients"):
        CodedPayload(layout, Codec("int8"))


# -- through Lightning -----------------------------------------------------------------------
STREAMING: dict[str, Any] = {
    "sync_every": 4,
    "num_fragments": 2,
    "sync_delay": 1,
    "quantize_block_size": BLOCK,
    "sync_at_end": False,  # the islands must still differ when fit ends
}


def _fit(tmp_path: Path, name: str, **strategy_kw: Any) -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    strategy = SwarmStrategy(
        island_size=1,
        outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        start_method="fork",
        **STREAMING,
        **strategy_kw,
    )
    pl.seed_everything(5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=8,
        callbacks=[Recorder(str(out))],
        **QUIET,
    )
    trainer.fit(TinyRegressor(), regression_data())
    return load_ranks(out, 2)


def test_streaming_int4_with_error_feedback_over_the_swarm_transport(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    swarm = {"spool_dir": str(spool_dir)}
    quantized = {"quantize": "int4", "error_feedback": True}
    runs = {
        "swarm_int4": _fit(tmp_path, "swarm_int4", transport="swarm", swarm=swarm, **quantized),
        "allreduce_int4": _fit(tmp_path, "allreduce_int4", **quantized),
        "swarm_fp32": _fit(tmp_path, "swarm_fp32", transport="swarm", swarm=swarm),
    }
    for ranks in runs.values():
        assert all(r["outer_steps"] == [3] for r in ranks)  # applied at steps 3, 5, 7
        for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
            assert torch.equal(a["anchors"][0], b["anchors"][0]), "anchors differ across ranks"
        assert not torch.equal(ranks[0]["final"], ranks[1]["final"])  # islands train apart
    swarm_int4, allreduce_int4 = runs["swarm_int4"], runs["allreduce_int4"]
    # Same codec, same error feedback: identical until the first applied round (step 3). There
    # the swarm applies mean_i decode(encode(x_i)) in float32, the all-reduce transport's
    # reduce-scatter that mean encoded once more: within int4's bound of it (absmax / 14), and
    # the outer step scales both alike.
    swarm_steps, allreduce_steps = swarm_int4[0]["steps"], allreduce_int4[0]["steps"]
    for a, b in zip(swarm_steps[:2], allreduce_steps[:2], strict=True):
        assert torch.equal(a["anchors"][0], b["anchors"][0])
        assert torch.equal(a["params"], b["params"])
    before, swarm3 = swarm_steps[1]["anchors"][0], swarm_steps[2]["anchors"][0]
    allreduce3 = allreduce_steps[2]["anchors"][0]
    assert not torch.equal(swarm3, allreduce3)
    update = (before - swarm3).abs().max()
    assert float((swarm3 - allreduce3).abs().max()) <= float(update) / 14 * (1 + 1e-5)
    first, last = swarm_int4[0]["steps"][0]["anchors"][0], swarm_int4[0]["steps"][-1]["anchors"][0]
    assert not torch.equal(first, last)
    assert not torch.equal(last, runs["swarm_fp32"][0]["steps"][-1]["anchors"][0])
    moved = {
        name: sum(r["totals"]["bytes_sent"] + r["totals"]["bytes_received"] for r in ranks)
        for name, ranks in runs.items()
    }
    assert moved["swarm_int4"] < moved["swarm_fp32"], moved
    assert list(spool_dir.iterdir()) == [], "teardown must remove every rank's spool root"
