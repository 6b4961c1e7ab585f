"""The bucket-level transport contract (``transport.base``): the native transports' ``start``
against their ``average``, and ``WholePayload`` over an average-only transport."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.transport import AllReduceTransport, ReduceScatterTransport, RoundStats
from lightning_swarm.transport.base import Bucket, BucketTransport, WholePayload, bucket_transport
from lightning_swarm.transport.buckets import numel_of, plan_buckets
from lightning_swarm.transport.errors import NonFinitePseudoGradientError


class Halving:
    """An average-only transport that records its call and halves every tensor."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, tuple[int, ...]]]] = []

    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        self.calls.append((round_index, {n: tuple(t.shape) for n, t in tensors.items()}))
        for t in tensors.values():
            t.mul_(0.5)
        return RoundStats(bytes_sent=7, applied=round_index != 3)

    def close(self) -> None:
        pass


def _tensors() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(9, generator=gen)}


def test_native_transports_implement_the_contract_and_average_only_ones_get_the_adapter() -> None:
    codec = codec_for("int8", 4)
    assert codec is not None
    native = [
        AllReduceTransport(None, num_islands=1, bucket_numel=8),
        ReduceScatterTransport(None, num_islands=1, island_index=0, codec=codec, bucket_numel=8),
    ]
    for transport in native:
        assert isinstance(transport, BucketTransport) and transport.pipelined
        assert bucket_transport(transport) is transport
    adapted = bucket_transport(Halving())
    assert isinstance(adapted, WholePayload) and not adapted.pipelined
    assert native[1].block_size == 4 and native[0].block_size == 1


def test_coded_buckets_by_runs_equal_the_whole_tensor_average_bitwise() -> None:
    codec = codec_for("int8", 4)
    assert codec is not None
    transport = ReduceScatterTransport(
        None, num_islands=1, island_index=0, codec=codec, bucket_numel=8
    )
    reference = {n: t.clone() for n, t in _tensors().items()}
    transport.average(reference, round_index=0)
    tensors = _tensors()
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    plan = plan_buckets([t.numel() for t in tensors.values()], 8, codec.block_size)
    transport.open(round_index=0, finite=True, names={n: t.shape for n, t in tensors.items()})
    offset = 0
    for bucket in plan:
        runs = tuple(p.length for p in bucket)
        assert transport.start(Bucket(flat[offset : offset + numel_of(bucket)], runs)).wait() == 0
        offset += numel_of(bucket)
    assert transport.agree().applied
    expected = torch.cat([t.reshape(-1) for t in reference.values()])
    assert torch.equal(flat, expected) and not torch.equal(flat, _tensors()["a"].new_zeros(24))
    with pytest.raises(NonFinitePseudoGradientError, match=r"island\(s\) \[0\]"):
        transport.open(round_index=1, finite=False, names={})


def test_whole_payload_averages_every_bucket_in_one_named_call_at_the_first_wait() -> None:
    inner = Halving()
    adapter = WholePayload(inner)
    flat = torch.arange(24, dtype=torch.float32)
    adapter.open(round_index=3, finite=False, names={"a": torch.Size([3, 5]), "b": torch.Size([9])})
    handles = [adapter.start(Bucket(flat[i : i + 8], (8,))) for i in (0, 8, 16)]
    assert inner.calls == []  # nothing moves until a wait
    assert [h.wait() for h in handles] == [0, 0, 0]
    assert inner.calls == [(3, {"a": (3, 5), "b": (9,)})]  # one call, the plain names
    assert torch.equal(flat, torch.arange(24, dtype=torch.float32) * 0.5)
    stats = adapter.agree()
    assert stats.bytes_sent == 7 and not stats.applied  # the transport's own verdict


def test_whole_payload_runs_a_round_with_no_bucket_at_agree() -> None:
    inner = Halving()
    adapter = WholePayload(inner)
    adapter.open(round_index=0, finite=True, names={})
    assert adapter.agree().applied
    assert inner.calls == [(0, {})]  # a rank with an empty share still takes part


def test_whole_payload_refuses_buckets_that_are_not_back_to_back() -> None:
    adapter = WholePayload(Halving())
    adapter.open(round_index=0, finite=True, names={"a": torch.Size([8])})
    adapter.start(Bucket(torch.zeros(4), (4,)))
    adapter.start(Bucket(torch.zeros(4), (4,)))
    with pytest.raises(ValueError, match="back to back in one buffer"):
        adapter.agree()
