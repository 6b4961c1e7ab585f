"""QuantizedTransport: bucket planning, and real gloo runs with 1, 2 and 3 islands."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_swarm.algorithm.codecs import CODECS, Codec
from lightning_swarm.transport.base import Transport
from lightning_swarm.transport.quantized import Piece, QuantizedTransport, plan_coded_buckets

# Shapes chosen so buckets are under-filled, tensors span several buckets and blocks end mid-bucket.
SHAPES = {"emb": (37, 11), "w": (300,), "b": (5,), "empty": (0,), "big": (1000,)}
BUCKET_NUMEL = 256
BLOCK_SIZE = 32


def _inputs(island: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + island)
    return {
        name: torch.randn(shape, generator=g) * (10.0 ** (i - 2))
        for i, (name, shape) in enumerate(SHAPES.items())
    }


def test_plan_buckets_covers_every_element_once() -> None:
    numels = [407, 300, 5, 0, 1000]
    buckets = plan_coded_buckets(numels, BUCKET_NUMEL, BLOCK_SIZE)
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for bucket in buckets:
        assert 0 < sum(p.length for p in bucket) <= BUCKET_NUMEL
        for p in bucket:
            assert p.start % BLOCK_SIZE == 0
            seen[p.tensor_index][p.start : p.start + p.length] += 1
    assert all(bool((s == 1).all()) for s in seen)
    # 407 elements: one full bucket, then 151 left; 300 starts beside it at a block boundary
    assert buckets[0] == [Piece(0, 0, 256)]
    assert buckets[1][0] == Piece(0, 256, 151) and buckets[1][1] == Piece(1, 0, 96)


def test_plan_buckets_rejects_bucket_below_block() -> None:
    with pytest.raises(ValueError, match="smaller than one codec block.*raise bucket_mb"):
        plan_coded_buckets([10], 16, 32)
    with pytest.raises(ValueError, match="smaller than one codec block"):
        QuantizedTransport(None, num_islands=2, codec=Codec("int8", 64), bucket_numel=32)


def test_single_island_is_the_codec_roundtrip() -> None:
    transport = QuantizedTransport(
        None, num_islands=1, codec=Codec("int4", BLOCK_SIZE), bucket_numel=BUCKET_NUMEL
    )
    assert isinstance(transport, Transport)
    tensors = _inputs(0)
    expected = {n: Codec("int4", BLOCK_SIZE).roundtrip(t.reshape(-1)) for n, t in tensors.items()}
    stats = transport.average(tensors, round_index=0)
    assert stats.bytes_sent == stats.bytes_received == 0 and stats.applied
    for name, t in tensors.items():
        assert torch.equal(t.reshape(-1), expected[name])


def test_rejects_non_float32() -> None:
    transport = QuantizedTransport(None, num_islands=1, codec=Codec("int8"), bucket_numel=1024)
    with pytest.raises(ValueError, match="contiguous float32 tensors only; 'x' is torch.float64"):
        transport.average({"x": torch.ones(3, dtype=torch.float64)}, round_index=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        results = {}
        for name in CODECS:
            transport = QuantizedTransport(
                None,
                num_islands=world_size,
                codec=Codec(name, BLOCK_SIZE),
                bucket_numel=BUCKET_NUMEL,
            )
            tensors = _inputs(rank)
            stats = transport.average(tensors, round_index=0)
            results[name] = {
                "tensors": tensors,
                "sent": stats.bytes_sent,
                "received": stats.bytes_received,
            }
            transport.close()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_islands_agree_and_stay_within_bound(world_size: int, tmp_path: Path) -> None:
    mp.start_processes(
        _worker,
        args=(world_size, _free_port(), str(tmp_path)),
        nprocs=world_size,
        start_method="spawn",
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    inputs = [_inputs(r) for r in range(world_size)]
    for name in CODECS:
        codec = Codec(name, BLOCK_SIZE)
        payload = sum(codec.encoded_nbytes(t.numel()) for t in inputs[0].values())
        for rank in range(world_size):
            got = results[rank][name]
            # every rank ends with the bitwise identical mean
            for tensor_name, t in got["tensors"].items():
                assert torch.equal(t, results[0][name]["tensors"][tensor_name]), (name, rank)
            assert got["sent"] == got["received"] == (world_size - 1) * payload
        for tensor_name in SHAPES:
            flat = [inp[tensor_name].reshape(-1) for inp in inputs]
            exact = torch.stack(flat).mean(dim=0)
            bound = torch.stack([codec.error_bound(x) for x in flat]).mean(dim=0)
            got_t = results[0][name]["tensors"][tensor_name].reshape(-1)
            # bucketing does not change the arithmetic: decode in island order, sum, divide
            assert torch.equal(got_t, _expected_mean(codec, inputs, tensor_name)), name
            # mean of per-island errors, each within its block bound (+ float32 summation slack)
            assert bool(((got_t - exact).abs() <= bound + 1e-6 * exact.abs()).all()), name
            if name != "none" and exact.numel():
                assert not torch.equal(got_t, exact)  # quantization really happened
    # block 32: 0.5 + 4/32 bytes per element against 4
    assert results[0]["int4"]["sent"] * 6 < results[0]["none"]["sent"]


def _expected_mean(codec: Codec, inputs: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    total = codec.roundtrip(inputs[0][name].reshape(-1))
    for inp in inputs[1:]:
        total += codec.roundtrip(inp[name].reshape(-1))
    return total / len(inputs)
