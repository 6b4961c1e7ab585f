"""The bucket-level transport contract (``transport.base.Transport``): the native transports'
``start`` against a whole-tensor round, and the aggregator, which serves the contract whole."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.transport import (
    AllReduceTransport,
    ReduceScatterTransport,
    SwarmAggregator,
)
from lightning_swarm.transport.base import Bucket, RoundRequest, Transport
from lightning_swarm.transport.buckets import numel_of, plan_buckets
from lightning_swarm.transport.errors import NonFinitePseudoGradientError
from tests.transport_rounds import average


def _tensors() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(9, generator=gen)}


def test_every_transport_implements_the_contract() -> None:
    codec = codec_for("int8", 4)
    assert codec is not None
    native = [
        AllReduceTransport(None, num_islands=1, bucket_numel=8),
        ReduceScatterTransport(None, num_islands=1, island_index=0, codec=codec, bucket_numel=8),
    ]
    for transport in native:
        assert isinstance(transport, Transport) and transport.pipelined
    assert native[1].block_size == 4 and native[0].block_size == 1
    aggregator = SwarmAggregator(None, num_islands=1, island_index=0, codec=codec)
    assert isinstance(aggregator, Transport) and not aggregator.pipelined
    assert aggregator.block_size == 4


def test_coded_buckets_by_runs_equal_one_bucket_per_tensor_bitwise() -> None:
    """Buckets of 8 cut tensor "a" (15 elements) into runs; each run is encoded on its own
    tensor's blocks, so the result equals encoding each tensor whole, bit for bit."""
    codec = codec_for("int8", 4)
    assert codec is not None
    transport = ReduceScatterTransport(
        None, num_islands=1, island_index=0, codec=codec, bucket_numel=8
    )
    whole = ReduceScatterTransport(
        None, num_islands=1, island_index=0, codec=codec, bucket_numel=64
    )
    reference = {n: t.clone() for n, t in _tensors().items()}
    average(whole, reference, round_index=0)
    tensors = _tensors()
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    plan = plan_buckets([t.numel() for t in tensors.values()], 8, codec.block_size)
    assert len(plan) > 2
    transport.open(RoundRequest(0, True, {n: t.shape for n, t in tensors.items()}))
    offset = 0
    for bucket in plan:
        runs = tuple(p.length for p in bucket)
        assert transport.start(Bucket(flat[offset : offset + numel_of(bucket)], runs)).wait() == 0
        offset += numel_of(bucket)
    assert transport.agree().applied
    expected = torch.cat([t.reshape(-1) for t in reference.values()])
    assert torch.equal(flat, expected) and not torch.equal(flat, _tensors()["a"].new_zeros(24))
    with pytest.raises(NonFinitePseudoGradientError, match=r"island\(s\) \[0\]"):
        transport.open(RoundRequest(1, False, {}))


def test_the_aggregator_runs_its_round_once_over_every_bucket_at_the_first_wait() -> None:
    aggregator = SwarmAggregator(None, num_islands=1, island_index=0)
    flat = torch.arange(24, dtype=torch.float32)
    names = {"a": torch.Size([3, 5]), "b": torch.Size([9])}
    aggregator.open(RoundRequest(3, True, names))
    handles = [aggregator.start(Bucket(flat[i : i + 8], (8,))) for i in (0, 8, 16)]
    assert aggregator.last_round is None  # nothing moves until a wait
    assert [h.wait() for h in handles] == [0, 0, 0]
    assert aggregator.last_round is not None and aggregator.last_round.round_index == 3
    assert aggregator.agree().applied
    assert torch.equal(flat, torch.arange(24, dtype=torch.float32))  # one island: itself


def test_the_aggregator_refuses_buckets_that_are_not_back_to_back() -> None:
    aggregator = SwarmAggregator(None, num_islands=1, island_index=0)
    aggregator.open(RoundRequest(0, True, {"a": torch.Size([8])}))
    aggregator.start(Bucket(torch.zeros(4), (4,)))
    aggregator.start(Bucket(torch.zeros(4), (4,)))
    with pytest.raises(ValueError, match="back to back in one buffer"):
        aggregator.agree()
