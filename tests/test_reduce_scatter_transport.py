"""ReduceScatterTransport: share planning, and real gloo runs with 1 to 4 islands."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_swarm.algorithm.codecs import Codec, with_error_feedback
from lightning_swarm.transport.base import Transport
from lightning_swarm.transport.buckets import Piece, plan_buckets, plan_shares
from lightning_swarm.transport.reduce_scatter import (
    ReduceScatterTransport,
    decode_flat,
    encode_pieces,
)
from tests.dist_utils import run_ranks
from tests.test_codecs import error_bound
from tests.transport_rounds import average

# Shapes chosen so buckets are under-filled, tensors span several buckets, blocks end
# mid-bucket, a tensor has fewer blocks than there are islands and one is empty.
SHAPES = {"emb": (37, 11), "w": (300,), "b": (5,), "empty": (0,), "big": (1000,)}
BUCKET_NUMEL = 256
BLOCK_SIZE = 32
CODED = ("bf16", "int8", "int4")


def _inputs(island: int, round_index: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * island + round_index)
    return {
        name: torch.randn(shape, generator=g) * (10.0 ** (i - 2))
        for i, (name, shape) in enumerate(SHAPES.items())
    }


def _reference(codec: Codec, xs: list[torch.Tensor]) -> torch.Tensor:
    """decode(encode(mean_i decode(encode(x_i)))) of whole flat tensors, island order."""
    total = codec.roundtrip(xs[0])
    for x in xs[1:]:
        total = total + codec.roundtrip(x)
    return codec.roundtrip(total / len(xs))


# -- planning ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_islands", [1, 2, 3, 4, 7, 40])
def test_shares_cover_the_bucket_in_order_on_block_boundaries(num_islands: int) -> None:
    numels = [407, 300, 5, 0, 1000]
    for bucket in plan_buckets(numels, BUCKET_NUMEL, BLOCK_SIZE):
        shares = plan_shares(bucket, num_islands, BLOCK_SIZE)
        assert len(shares) == num_islands
        flat = [(p.tensor_index, p.start + k) for p in bucket for k in range(p.length)]
        joined = [(p.tensor_index, p.start + k) for s in shares for p in s for k in range(p.length)]
        assert joined == flat  # every element once, in the bucket's order
        blocks = [sum(-(-p.length // BLOCK_SIZE) for p in s) for s in shares]
        assert max(blocks) - min(blocks) <= 1
        assert all(p.start % BLOCK_SIZE == 0 and p.length > 0 for s in shares for p in s)


def test_shares_by_hand() -> None:
    # 3 blocks of tensor 0 (the last one partial), 2 of tensor 1: 5 blocks over 2 and 3 islands
    bucket = [Piece(0, 64, 70), Piece(1, 0, 64)]
    assert plan_shares(bucket, 2, 32) == [
        [Piece(0, 64, 64)],
        [Piece(0, 128, 6), Piece(1, 0, 64)],
    ]
    assert plan_shares(bucket, 3, 32) == [
        [Piece(0, 64, 32)],
        [Piece(0, 96, 38)],  # two blocks of one tensor: one piece
        [Piece(1, 0, 64)],
    ]
    # fewer blocks than islands: the first islands own nothing
    assert plan_shares([Piece(2, 0, 5)], 3, 32) == [[], [], [Piece(2, 0, 5)]]


def test_bad_inputs_name_the_fix() -> None:
    with pytest.raises(ValueError, match="num_islands must be >= 1, got 0"):
        plan_shares([Piece(0, 0, 4)], 0, 32)
    with pytest.raises(ValueError, match="island_index=2 is outside the peer group of 2"):
        ReduceScatterTransport(
            None, num_islands=2, island_index=2, codec=Codec("int8"), bucket_numel=1024
        )
    with pytest.raises(ValueError, match="smaller than one codec block.*raise bucket_mb"):
        ReduceScatterTransport(
            None, num_islands=2, island_index=0, codec=Codec("int8", 64), bucket_numel=32
        )
    with pytest.raises(ValueError, match="num_islands must be >= 1, got 0"):
        ReduceScatterTransport(
            None, num_islands=0, island_index=0, codec=Codec("int8"), bucket_numel=1024
        )
    codec = Codec("int8", 32)
    payload = encode_pieces(codec, [torch.ones(40)], [Piece(0, 0, 40)], torch.device("cpu"))
    with pytest.raises(ValueError, match="islands disagree on the layout"):
        decode_flat(codec, payload, [Piece(0, 0, 32)])


@pytest.mark.parametrize("name", CODED)
def test_single_island_is_the_reference(name: str) -> None:
    codec = Codec(name, BLOCK_SIZE)
    transport = ReduceScatterTransport(
        None, num_islands=1, island_index=0, codec=codec, bucket_numel=BUCKET_NUMEL
    )
    assert isinstance(transport, Transport)
    tensors = _inputs(0)
    expected = {n: _reference(codec, [t.reshape(-1)]) for n, t in tensors.items()}
    stats = average(transport, tensors, round_index=0)
    assert stats.bytes_sent == stats.bytes_received == 0 and stats.applied
    for n, t in tensors.items():
        assert torch.equal(t.reshape(-1), expected[n]), n


# -- real exchanges over gloo -----------------------------------------------------------------
def _worker(rank: int, world: int, out_dir: str) -> None:
    results: dict[str, object] = {}
    for name in CODED:
        codec = Codec(name, BLOCK_SIZE)
        transport = ReduceScatterTransport(
            None, num_islands=world, island_index=rank, codec=codec, bucket_numel=BUCKET_NUMEL
        )
        tensors = _inputs(rank)
        stats = average(transport, tensors, round_index=0)
        results[name] = {"tensors": tensors, "sent": stats.bytes_sent, "recv": stats.bytes_received}
        # one bucket of 4 int8 blocks: the hand-derived bytes of ``test_bytes_by_hand``
        one = {"x": torch.arange(128, dtype=torch.float32) + rank}
        results[name + "_one"] = average(transport, one, round_index=1).bytes_sent
    # error feedback over two rounds: the residual is this island's own encoding loss
    codec = Codec("int4", BLOCK_SIZE)
    transport = ReduceScatterTransport(
        None, num_islands=world, island_index=rank, codec=codec, bucket_numel=BUCKET_NUMEL
    )
    residual = None
    for r in range(2):
        to_send, residual = with_error_feedback(_inputs(rank, r)["big"], residual, codec)
        average(transport, {"big": to_send}, round_index=r)
        results[f"ef{r}"] = {"avg": to_send, "residual": residual}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_islands_agree_bitwise_within_the_bound(world: int, tmp_path: Path) -> None:
    run_ranks(_worker, world, str(tmp_path), timeout_s=60)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    inputs = [_inputs(r) for r in range(world)]
    for name in CODED:
        codec = Codec(name, BLOCK_SIZE)
        for rank in range(world):
            got = results[rank][name]
            for n, t in got["tensors"].items():  # every island applies the same bytes
                assert torch.equal(t, results[0][name]["tensors"][n]), (name, rank, n)
            assert got["sent"] == got["recv"] > 0
        for n in SHAPES:
            xs = [inp[n].reshape(-1) for inp in inputs]
            got_t = results[0][name]["tensors"][n].reshape(-1)
            # buckets and shares do not change a bit: whole-tensor codec round trips agree
            assert torch.equal(got_t, _reference(codec, xs)), (name, n)
            exact = torch.stack(xs).mean(dim=0)
            decoded_mean = torch.stack([codec.roundtrip(x) for x in xs]).mean(dim=0)
            bound = torch.stack([error_bound(codec, x) for x in xs]).mean(dim=0)
            bound = bound + error_bound(codec, decoded_mean)
            assert bool(((got_t - exact).abs() <= bound + 1e-6 * exact.abs()).all()), (name, n)
            if exact.numel():
                assert not torch.equal(got_t, exact)  # quantization really happened
    _check_error_feedback(results, world)
    if world == 3:
        # 128 int8 elements in blocks of 32: shares of 1, 1 and 2 blocks (36, 36 and 72 bytes).
        # Island 0 sends 36 + 72 out and its 36-byte mean twice: 180; island 2 sends 36 + 36
        # and its 72-byte mean twice: 216.
        assert [r["int8_one"] for r in results] == [180, 180, 216]


def _check_error_feedback(results: list[dict], world: int) -> None:
    codec = Codec("int4", BLOCK_SIZE)
    residuals: list[torch.Tensor | None] = [None] * world
    for r in range(2):
        sent = []
        for rank in range(world):
            x = _inputs(rank, r)["big"]
            to_send = x if residuals[rank] is None else x + residuals[rank]
            sent.append(to_send)
            expected_residual = to_send - codec.roundtrip(to_send)
            got = results[rank][f"ef{r}"]
            assert torch.equal(got["residual"], expected_residual), (r, rank)
            assert torch.equal(got["avg"], results[0][f"ef{r}"]["avg"]), (r, rank)
            residuals[rank] = expected_residual
        assert torch.equal(results[0][f"ef{r}"]["avg"], _reference(codec, sent)), r


def _bytes_worker(rank: int, world: int, out_dir: str) -> None:
    out = {}
    for name in ("int8", "int4"):
        codec = Codec(name, 128)
        transport = ReduceScatterTransport(
            None, num_islands=world, island_index=rank, codec=codec, bucket_numel=2**14
        )
        tensors = {"w": torch.randn(3 * 2**14 + 1000), "b": torch.randn(77)}
        out[name] = average(transport, tensors, round_index=0).bytes_sent
    torch.save(out, Path(out_dir) / f"{world}-{rank}.pt")


def test_bytes_per_rank_are_flat_in_islands(tmp_path: Path) -> None:
    """A rank moves about 2 (n - 1) / n encoded payloads, not n - 1 (the gather)."""
    sent: dict[tuple[str, int], list[int]] = {}
    for world in (2, 3, 4):
        run_ranks(_bytes_worker, world, str(tmp_path), timeout_s=60)
        for rank in range(world):
            for name, value in torch.load(tmp_path / f"{world}-{rank}.pt").items():
                sent.setdefault((name, world), []).append(value)
    for name in ("int8", "int4"):
        codec = Codec(name, 128)
        payload = codec.encoded_nbytes(3 * 2**14 + 1000) + codec.encoded_nbytes(77)
        for world in (2, 3, 4):
            ideal = 2 * (world - 1) / world * payload
            # uneven shares: each of 5 buckets may be off by one block on this rank's share
            slack = 5 * (world - 1) * codec.encoded_nbytes(128)
            for value in sent[(name, world)]:
                assert abs(value - ideal) <= slack, (name, world, value, ideal)
        growth = max(sent[(name, 4)]) / min(sent[(name, 2)])
        assert growth <= 1.6, (name, growth)  # the gather would grow 3x
        assert max(sent[(name, 4)]) <= 0.45 * 4 * (3 * 2**14 + 1077)  # of the float32 payload
