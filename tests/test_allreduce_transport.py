"""The bucketed all-reduce transport over real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_swarm.transport import AllReduceTransport, ring_allreduce_bytes
from tests.dist_utils import run_ranks
from tests.transport_rounds import average

SIZES = [3, 7, 1, 12, 5]  # with a 5-element bucket: partial buckets and tensors spanning three


def _rank_tensors(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(SIZES)}


def _average_worker(rank: int, world: int, out: str, bucket_numel: int) -> None:
    transport = AllReduceTransport(None, num_islands=world, bucket_numel=bucket_numel)
    tensors = _rank_tensors(rank)
    stats = average(transport, tensors, round_index=0)
    torch.save({"tensors": tensors, "sent": stats.bytes_sent}, Path(out) / f"{rank}.pt")


def test_bucketed_average_matches_mean_for_partial_and_oversized_buckets(tmp_path: Path) -> None:
    world = 3
    run_ranks(_average_worker, world, str(tmp_path), 5)
    expected = {
        name: torch.stack([_rank_tensors(r)[name] for r in range(world)]).mean(0)
        for name in _rank_tensors(0)
    }
    payload = sum(SIZES) * 4
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for result in results:
        for name, value in expected.items():
            torch.testing.assert_close(result["tensors"][name], value, rtol=0, atol=1e-6)
            # every rank holds the very same mean
            assert torch.equal(result["tensors"][name], results[0]["tensors"][name])
    # buckets are 5 elements (20 bytes): the ring formula applied bucket by bucket
    bucket_bytes = [20] * (sum(SIZES) // 5) + ([sum(SIZES) % 5 * 4] if sum(SIZES) % 5 else [])
    assert sum(bucket_bytes) == payload
    assert results[0]["sent"] == sum(ring_allreduce_bytes(b, world) for b in bucket_bytes)


def test_single_island_is_identity_and_moves_nothing() -> None:
    transport = AllReduceTransport(None, num_islands=1, bucket_numel=4)
    tensors = {"a": torch.tensor([1.0, 2.0])}
    stats = average(transport, tensors, round_index=0)
    assert torch.equal(tensors["a"], torch.tensor([1.0, 2.0]))
    assert stats.bytes_sent == stats.bytes_received == 0


def test_ring_bytes_formula() -> None:
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 4) == 1500


def _paired_worker(rank: int, world: int, out: Path) -> None:
    from lightning_swarm.algorithm.codecs import codec_for
    from lightning_swarm.transport import ReduceScatterTransport
    from lightning_swarm.transport.base import RoundRequest
    from lightning_swarm.transport.errors import LayoutMismatchError

    # Rank 1 holds another slice of "w" (its layout's fingerprint differs): refused on both.
    names = {"w": torch.Size([3, 4])}
    coded = {"island_index": rank, "codec": codec_for("int8", 32)}
    for cls, extra in ((AllReduceTransport, {}), (ReduceScatterTransport, coded)):
        transport = cls(None, num_islands=world, bucket_numel=64, **extra)
        transport.open(RoundRequest(0, True, names, layout=7))  # the same slices: fine
        transport.agree()
        try:
            transport.open(RoundRequest(1, True, names, layout=7 + rank * 2**40))
        except LayoutMismatchError as err:
            (out / f"{cls.__name__}.{rank}.txt").write_text(str(err))


def test_ranks_paired_by_a_round_with_other_slices_are_refused_on_both(tmp_path: Path) -> None:
    run_ranks(_paired_worker, 2, tmp_path, timeout_s=60)
    for name in ("AllReduceTransport", "ReduceScatterTransport"):
        for rank in (0, 1):
            message = (tmp_path / f"{name}.{rank}.txt").read_text()
            assert message.startswith("island(s) [1] hold other slices of this round's"), message
            assert "Launch every island with the same model and the same layout" in message
