"""Codecs: round-trip error within the documented per-block bound, int4 packing, bad input."""

from __future__ import annotations

import pytest
import torch

from lightning_swarm.algorithm.codecs import (
    _QMAX,
    CODECS,
    NO_CODEC,
    Codec,
    _as_blocks,
    with_error_feedback,
)


def error_bound(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on ``|x - roundtrip(x)|``: 0 for ``none``, half a bfloat16 step
    (round to nearest even), or the block's ``absmax / (2 * qmax)`` plus float32 rounding."""
    if codec.name == NO_CODEC:
        return torch.zeros_like(x)
    if codec.name == "bf16":
        return torch.clamp(x.abs() * 2.0**-8, min=2.0**-134)
    blocks = _as_blocks(x, codec.block_size)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    step = absmax / (2 * _QMAX[codec.name]) + absmax * 2.0**-21 + 2.0**-149
    return step.expand_as(blocks).reshape(-1)[: x.numel()].contiguous()


def _sample(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Blocks of very different magnitudes, so a shared scale would break the per-block bound.
    scale = torch.logspace(-6, 3, steps=numel)[torch.randperm(numel, generator=g)]
    return torch.randn(numel, generator=g) * scale


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("block_size", [1, 7, 64, 128])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1001])
def test_roundtrip_within_bound(name: str, block_size: int, numel: int) -> None:
    codec = Codec(name, block_size)
    x = _sample(numel, seed=numel + block_size)
    encoded = codec.encode(x)
    y = codec.decode(encoded)
    assert y.dtype == torch.float32 and y.shape == x.shape
    err = (x - y).abs()
    assert bool((err <= error_bound(codec, x)).all()), float((err - error_bound(codec, x)).max())
    assert encoded.nbytes == codec.encoded_nbytes(numel)


def test_int_bounds_are_half_a_step_per_block() -> None:
    # Block 0 spans [-1, 1]; block 1 is 1000x larger. Its error may be 1000x larger, block 0's
    # may not: the bound is per block, not per tensor.
    x = torch.cat([torch.linspace(-1, 1, 64), 1000 * torch.linspace(-1, 1, 64)])
    for name, qmax in (("int8", 127), ("int4", 7)):
        err = (x - Codec(name, 64).roundtrip(x)).abs()
        step0, step1 = 1 / (2 * qmax), 1000 / (2 * qmax)
        assert float(err[:64].max()) <= step0 * (1 + 1e-5)
        assert float(err[64:].max()) <= step1 * (1 + 1e-5)
        assert float(err[64:].max()) > step0  # the large block really is coarser
        # absmax elements are exact
        assert float(err[0]) < 1e-6 and float(err[-1]) < 1e-3


def test_bf16_bound() -> None:
    x = _sample(4096)
    err = (x - Codec("bf16").roundtrip(x)).abs()
    assert bool((err <= x.abs() * 2.0**-8).all())
    assert float((err / x.abs()).max()) > 2.0**-10  # the bound is not vacuous


def test_int_codes_are_exact_for_representable_values() -> None:
    codes = torch.arange(-7, 8, dtype=torch.float32)
    x = torch.cat([codes, codes.new_zeros(1)]) * 0.25
    assert torch.equal(Codec("int4", 16).roundtrip(x), x)


@pytest.mark.parametrize("numel", [1, 2, 3, 127, 128, 129])
def test_int4_packs_two_per_byte(numel: int) -> None:
    codec = Codec("int4", 4)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    encoded = codec.encode(x)
    assert encoded.data.dtype == torch.uint8
    assert encoded.data.numel() == (numel + 1) // 2
    assert encoded.scales.numel() == -(-numel // 4)
    # Low nibble holds the earlier element: re-derive the codes by hand.
    codes = torch.round(x / encoded.scales.repeat_interleave(4)[:numel] * 7).to(torch.int64) + 8
    assert int(encoded.data[0]) & 0x0F == int(codes[0])
    if numel >= 2:
        assert int(encoded.data[0]) >> 4 == int(codes[1])
    else:
        assert int(encoded.data[0]) >> 4 == 8  # padding nibble decodes to zero
    assert codec.decode(encoded).numel() == numel


@pytest.mark.parametrize("name", CODECS)
def test_zeros_decode_to_exact_zeros(name: str) -> None:
    x = torch.zeros(200)
    x[150] = 3.0  # one non-zero block beside all-zero ones
    y = Codec(name, 64).roundtrip(x)
    assert torch.equal(y[:128], torch.zeros(128))
    assert float(y[150]) == pytest.approx(3.0, rel=1e-6)


def test_subnormal_block_stays_finite() -> None:
    x = torch.tensor([1e-45, -1e-40, 3e-39, 0.0])
    for name in CODECS:
        y = Codec(name, 4).roundtrip(x)
        assert bool(torch.isfinite(y).all())
        assert bool(((x - y).abs() <= error_bound(Codec(name, 4), x)).all())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(name: str, bad: float) -> None:
    x = torch.ones(10)
    x[3] = bad
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\).*pseudo-gradient diverged"):
        Codec(name).encode(x)


def test_bf16_overflow_raises() -> None:
    x = torch.tensor([3.4e38])
    with pytest.raises(ValueError, match="beyond bfloat16's largest finite.*int8"):
        Codec("bf16").encode(x)


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match=r"quantize='int2' is not a codec; choose one of"):
        Codec("int2")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        Codec("int8", 0)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        Codec("int8", 64.0)  # type: ignore[arg-type]


def test_bad_input_type_raises() -> None:
    with pytest.raises(TypeError, match=r"flat float32 tensors.*reshape\(-1\)\.float\(\)"):
        Codec("int8").encode(torch.ones(2, 3))
    with pytest.raises(TypeError, match="flat float32 tensors"):
        Codec("int8").encode(torch.ones(3, dtype=torch.float64))


def test_decode_with_other_codec_raises() -> None:
    encoded = Codec("int8", 64).encode(torch.ones(10))
    with pytest.raises(ValueError, match="every island must use the same quantize and block_size"):
        Codec("int8", 128).decode(encoded)


@pytest.mark.parametrize("name", CODECS)
def test_bytes_roundtrip(name: str) -> None:
    codec = Codec(name, 16)
    x = _sample(37)
    encoded = codec.encode(x)
    raw = codec.to_bytes(encoded)
    assert raw.dtype == torch.uint8 and raw.numel() == codec.encoded_nbytes(37)
    assert torch.equal(codec.decode(codec.from_bytes(raw, 37)), codec.decode(encoded))
    with pytest.raises(ValueError, match="islands disagree on the layout"):
        codec.from_bytes(raw[:-1], 37)


def test_slices_at_block_boundaries_quantize_like_the_whole() -> None:
    codec = Codec("int4", 8)
    x = _sample(50)
    whole = codec.roundtrip(x)
    parts = torch.cat([codec.roundtrip(x[:16]), codec.roundtrip(x[16:40]), codec.roundtrip(x[40:])])
    assert torch.equal(whole, parts)


def test_encoded_sizes() -> None:
    assert Codec("none").encoded_nbytes(1000) == 4000
    assert Codec("bf16").encoded_nbytes(1000) == 2000
    assert Codec("int8", 128).encoded_nbytes(1000) == 1000 + 4 * 8
    assert Codec("int4", 128).encoded_nbytes(1001) == 501 + 4 * 8
    with pytest.raises(ValueError, match="numel must be >= 0"):
        Codec("int4").encoded_nbytes(-1)


def test_error_feedback_carries_the_residual() -> None:
    codec = Codec("int4", 32)
    g = torch.Generator().manual_seed(1)
    signal = torch.randn(256, generator=g) * 0.01
    residual = None
    sent_total = torch.zeros(256)
    rounds = 50
    for _ in range(rounds):
        to_send, residual = with_error_feedback(signal, residual, codec)
        sent_total += codec.roundtrip(to_send)
    # With feedback, what arrived over all rounds differs from the truth by one residual only.
    assert torch.allclose(sent_total + residual, signal * rounds, atol=1e-5)
    no_feedback = codec.roundtrip(signal) * rounds
    assert float((no_feedback - signal * rounds).abs().max()) > 5 * float(residual.abs().max())


def test_error_feedback_with_none_codec_is_exact() -> None:
    x = torch.randn(10)
    to_send, residual = with_error_feedback(x, None, Codec("none"))
    assert torch.equal(to_send, x) and torch.equal(residual, torch.zeros(10))
    assert to_send is not x


def test_codec_for_turns_the_none_option_into_no_codec() -> None:
    from lightning_swarm.algorithm.codecs import codec_for

    assert codec_for("none", 64) is None
    assert codec_for("int8", 64) == Codec("int8", 64)
    with pytest.raises(ValueError, match="quantize='int3' is not a codec"):
        codec_for("int3")
