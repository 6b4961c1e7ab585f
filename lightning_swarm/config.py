"""Typed, self-validating configuration of the swarm strategy.

``SwarmConfig`` is the single source of truth for every strategy option other than the outer
optimizer factory (a callable, not data). ``SwarmStrategy`` builds one from its keyword
arguments, and the Hydra schema in ``lightning_swarm.cli`` mirrors its fields, so YAML keys equal
the field names here. Validation runs in ``__post_init__``: a bad value raises ``ValueError``
naming the option and the fix before any process group or tensor exists.

Imports neither torch.distributed nor lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TRANSPORTS = ("allreduce",)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, *, option: str) -> torch.dtype | None:
    """Turn ``"bfloat16"`` / ``torch.bfloat16`` / ``None`` into a floating torch dtype."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ValueError(f"{option} must be a floating dtype, got {value}.")
        return value
    key = str(value).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(
            f"{option}={value!r} is not a supported dtype; use one of "
            f"{sorted(set(_DTYPES))} or null for float32."
        )
    return _DTYPES[key]


@dataclass(kw_only=True)
class AnchorConfig:
    """How anchors are restored from a checkpoint.

    Attributes:
        mmap: map the saved anchors (``torch.load(mmap=True)``) so bytes a restart does not
            touch stay file-backed; ``False`` reads them eagerly into RAM. The environment
            variable ``LIGHTNING_SWARM_ANCHOR_MMAP=0`` also turns mapping off.
    """

    mmap: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.mmap, bool):
            raise ValueError(f"anchors.mmap must be true or false, got {self.mmap!r}.")


@dataclass(kw_only=True)
class SwarmConfig:
    """Options of ``SwarmStrategy`` that are plain data.

    Attributes:
        sync_every: H, inner optimizer steps between outer syncs (per optimizer).
        island_size: ranks per island; must divide the world size (checked at setup).
        transport: how pseudo-gradients are averaged across islands: ``"allreduce"``.
        anchor_device: where anchors and outer optimizer state live (``"cpu"`` by default,
            never silently on the accelerator).
        anchor_dtype: dtype of the stored anchors; ``None`` means float32.
        bucket_mb: size of one all-reduce bucket in MiB; bounds the transport's extra memory.
        anchors: how anchors are restored on resume (``AnchorConfig``; a dict is accepted).
    """

    sync_every: int = 100
    island_size: int = 1
    transport: str = "allreduce"
    anchor_device: str = "cpu"
    anchor_dtype: str | None = None
    bucket_mb: float = 32.0
    anchors: AnchorConfig = field(default_factory=AnchorConfig)

    def __post_init__(self) -> None:
        _check_positive_int("sync_every", self.sync_every, "e.g. sync_every=100 (DiLoCo's H)")
        _check_positive_int("island_size", self.island_size, "1 makes every rank an island")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport={self.transport!r} is not known; choose one of {list(TRANSPORTS)}."
            )
        try:
            torch.device(self.anchor_device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"anchor_device={self.anchor_device!r} is not a torch device; use 'cpu' "
                "(recommended) or an accelerator such as 'cuda'."
            ) from err
        parse_dtype(self.anchor_dtype, option="anchor_dtype")
        self.anchors = as_anchor_config(self.anchors)
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)):
            raise ValueError(f"bucket_mb must be a number of MiB, got {self.bucket_mb!r}.")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}; e.g. bucket_mb=32.")

    @property
    def anchor_torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.anchor_dtype, option="anchor_dtype") or torch.float32

    @property
    def bucket_numel(self) -> int:
        """Float32 elements in one transport bucket (at least one)."""
        return max(1, int(self.bucket_mb * 2**20) // 4)


def _check_positive_int(option: str, value: object, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option} must be a positive integer, got {value!r}; {hint}.")


def as_anchor_config(value: object) -> AnchorConfig:
    """Accept an ``AnchorConfig`` or a mapping of its fields (YAML / keyword dict)."""
    if isinstance(value, AnchorConfig):
        return value
    if isinstance(value, dict) or hasattr(value, "keys"):
        items = dict(value)  # type: ignore[call-overload]
        unknown = sorted(set(items) - {"mmap"})
        if unknown:
            raise ValueError(f"anchors has unknown keys {unknown}; the only key is 'mmap'.")
        return AnchorConfig(**items)
    raise TypeError(
        f"anchors must be an AnchorConfig or a dict such as {{'mmap': False}}, got "
        f"{type(value).__name__}."
    )
