"""Payload codecs: how a float32 pseudo-gradient is shrunk before it crosses a slow link.

``int8`` / ``int4`` keep one absmax scale per ``block_size`` elements from element 0, so a slice
starting on a block boundary quantizes as inside the whole tensor. Non-finite input raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_swarm.errors import SwarmConfigError

# The option value; in code, "no codec" is ``None`` (``codec_for``).
NO_CODEC: Literal["none"] = "none"
CodecName = Literal["none", "bf16", "int8", "int4"]
CODECS: tuple[str, ...] = get_args(CodecName)
assert CODECS[0] == NO_CODEC
_QMAX = {"int8": 127, "int4": 7}
_INT4_ZERO_CODE = 8
_DATA_DTYPE = {
    NO_CODEC: torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int4": torch.uint8,
}


@dataclass(frozen=True)
class Encoded:
    """One encoded flat tensor; ``data`` is float32, bfloat16, int8 or uint8 nibble pairs (int4),
    ``scales`` the float32 absmax per block (empty for none / bf16). Contiguous, on the input's
    device."""

    codec: str
    numel: int
    block_size: int
    data: Tensor
    scales: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the payload as it would travel."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales))


@dataclass(frozen=True)
class Codec:
    """A codec name (one of ``CODECS``) and its block size (elements per absmax scale),
    validated: ``ValueError`` for an unknown name or a block size that is not an int >= 1."""

    name: str = NO_CODEC
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise SwarmConfigError(
                f"quantize={self.name!r} is not a codec; choose one of {CODECS}."
            )
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise SwarmConfigError(
                f"block_size must be a positive integer, got {self.block_size!r}; e.g. 128."
            )
        if self.block_size < 1:
            raise SwarmConfigError(f"block_size must be >= 1, got {self.block_size}; e.g. 128.")

    def encode(self, x: Tensor) -> Encoded:
        """Encode a flat float32 tensor: ``TypeError`` for another shape or dtype,
        ``ValueError`` for NaN or inf."""
        _check_input(x, self.name)
        if self.name == NO_CODEC:
            data = x.contiguous().clone()
        elif self.name == "bf16":
            data = x.to(torch.bfloat16)
            if not bool(torch.isfinite(data).all()):
                raise ValueError(
                    "quantize='bf16' cannot represent values beyond bfloat16's largest finite "
                    f"value ({torch.finfo(torch.bfloat16).max:.4g}); the pseudo-gradient has "
                    "exploded: lower the inner learning rate, or use quantize='int8'."
                )
        else:
            return self._encode_blocks(x)
        empty = torch.empty(0, dtype=torch.float32, device=x.device)
        return Encoded(self.name, x.numel(), self.block_size, data, empty)

    def _encode_blocks(self, x: Tensor) -> Encoded:
        qmax = _QMAX[self.name]
        blocks = _as_blocks(x, self.block_size)
        absmax = blocks.abs().amax(dim=1)
        # An all-zero block divides by 1 instead of 0: its codes are 0 and decode to 0 exactly.
        divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        # x / absmax lies in [-1, 1] exactly (IEEE division is monotone): the clamp documents it.
        codes = torch.round(blocks / divisor[:, None] * qmax).clamp_(-qmax, qmax)
        codes = codes.reshape(-1)[: x.numel()]
        if self.name == "int8":
            data = codes.to(torch.int8)
        else:
            data = _pack_int4(codes.to(torch.int16) + _INT4_ZERO_CODE)
        return Encoded(self.name, x.numel(), self.block_size, data, absmax.contiguous())

    def decode(self, encoded: Encoded) -> Tensor:
        """Return a new float32 tensor of ``encoded.numel`` elements on the payload's device."""
        if encoded.codec != self.name or encoded.block_size != self.block_size:
            raise ValueError(
                f"payload was encoded with {encoded.codec}/block {encoded.block_size} but this "
                f"codec is {self.name}/block {self.block_size}; every island must use the same "
                "quantize and block_size."
            )
        if self.name in (NO_CODEC, "bf16"):
            return encoded.data.to(torch.float32)
        if self.name == "int8":
            codes = encoded.data.to(torch.float32)
        else:
            codes = _unpack_int4(encoded.data, encoded.numel).to(torch.float32) - _INT4_ZERO_CODE
        blocks = _as_blocks(codes, self.block_size)
        out = blocks / _QMAX[self.name] * encoded.scales[:, None]
        return out.reshape(-1)[: encoded.numel].contiguous()

    def to_bytes(self, encoded: Encoded) -> Tensor:
        """The payload as one flat uint8 tensor: the scale bytes, then the data bytes."""
        return torch.cat([_raw(encoded.scales), _raw(encoded.data)])

    def from_bytes(self, raw: Tensor, numel: int) -> Encoded:
        """Inverse of ``to_bytes`` for a payload of ``numel`` elements (``raw`` is not kept)."""
        if raw.dtype != torch.uint8 or raw.numel() != self.encoded_nbytes(numel):
            raise ValueError(
                f"expected {self.encoded_nbytes(numel)} uint8 bytes for {numel} elements with "
                f"{self.name}, got {raw.numel()} {raw.dtype}; islands disagree on the layout."
            )
        num_scales = self._num_scales(numel)
        # Copies: a slice at an odd byte offset cannot be reinterpreted as float32 in place.
        scales = raw[: 4 * num_scales].clone().view(torch.float32)
        data = raw[4 * num_scales :].clone().view(_DATA_DTYPE[self.name])
        return Encoded(self.name, numel, self.block_size, data, scales)

    def roundtrip(self, x: Tensor) -> Tensor:
        """What the other islands will see of ``x``."""
        return self.decode(self.encode(x))

    def encoded_nbytes(self, numel: int) -> int:
        """Payload bytes for ``numel`` elements, without encoding anything."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        data = {NO_CODEC: 4 * numel, "bf16": 2 * numel, "int8": numel}.get(self.name)
        return ((numel + 1) // 2 if data is None else data) + 4 * self._num_scales(numel)

    def _num_scales(self, numel: int) -> int:
        return 0 if self.name in (NO_CODEC, "bf16") else -(-numel // self.block_size)


def codec_for(name: str, block_size: int = 128) -> Codec | None:
    """The codec a ``quantize`` option names, validated; ``None`` for ``"none"`` (the one
    place that turns the name into "no codec": code below compares no names)."""
    codec = Codec(name, block_size)
    return None if codec.name == NO_CODEC else codec


def with_error_feedback(x: Tensor, residual: Tensor | None, codec: Codec) -> tuple[Tensor, Tensor]:
    """Error feedback for one tensor and one round: ``(to_send, new_residual)``, with
    ``to_send = x + residual`` (``None`` means zeros) and ``new_residual`` what encoding
    ``to_send`` loses, kept by the caller for the next round. The inputs are not modified."""
    to_send = x.clone() if residual is None else x + residual
    if codec.name == NO_CODEC:
        return to_send, torch.zeros_like(to_send)
    if not bool(torch.isfinite(to_send).all()):
        # A diverged island: encoding would raise on this rank alone while its peers wait in
        # the exchange. Send it as is (the transport reports it to every island at once) and
        # keep the old residual.
        return to_send, torch.zeros_like(to_send) if residual is None else residual.clone()
    new_residual = to_send - codec.roundtrip(to_send.reshape(-1)).view_as(to_send)
    return to_send, new_residual


def _check_input(x: Tensor, codec: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 1:
        raise TypeError(
            f"codec {codec!r} encodes flat float32 tensors, got dtype {x.dtype} with shape "
            f"{tuple(x.shape)}; pass tensor.reshape(-1).float()."
        )
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(
            f"codec {codec!r} got {bad} non-finite value(s) (NaN or inf) among {x.numel()}: the "
            "pseudo-gradient diverged on this island; check the loss for NaN, lower the inner "
            "learning rate or enable gradient clipping."
        )


def _raw(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _as_blocks(x: Tensor, block_size: int) -> Tensor:
    """``x`` zero-padded to whole blocks, viewed as (num_blocks, block_size)."""
    pad = (-x.numel()) % block_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.reshape(-1, block_size)


def _pack_int4(codes: Tensor) -> Tensor:
    """Codes in [0, 15], two per byte: element 2k in the low nibble; an odd count pads zero."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_full((1,), _INT4_ZERO_CODE)])
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def _unpack_int4(packed: Tensor, numel: int) -> Tensor:
    as_int = packed.to(torch.int16)
    return torch.stack([as_int & 0x0F, as_int >> 4], dim=1).reshape(-1)[:numel]
