"""Typed, self-validating configuration of the swarm strategy.

``SwarmConfig`` is the single source of truth for every strategy option other than the outer
optimizer factory (a callable, not data). ``SwarmStrategy`` builds one from its keyword
arguments, and the Hydra schema in ``lightning_swarm.cli`` mirrors its fields, so YAML keys equal
the field names here. Validation runs in ``__post_init__``: a bad value raises ``ValueError``
naming the option and the fix before any process group or tensor exists.

Imports neither torch.distributed nor lightning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.algorithm.fragments import LAYOUTS, FragmentSchedule
from lightning_swarm.algorithm.robust import AGGREGATIONS

TRANSPORTS = ("allreduce", "swarm")

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
class SwarmTransportConfig:
    """Options of the swarm transport (``transport="swarm"``), under ``swarm:`` in YAML.

    Attributes:
        offload: spool peers' pseudo-gradients to disk on the aggregator (``True``) or hold
            them in memory (``False``); results are identical.
        spool_dir: where each rank creates its run's spool directory; ``None`` = TMPDIR. Point
            it at a local disk (not tmpfs) with room for about peers x payload bytes.
        aggregation: ``mean``, ``weighted_mean``, ``median`` or ``trimmed_mean``.
        trim_ratio: fraction of contributions dropped at EACH end per coordinate by
            ``trimmed_mean`` (in ``[0, 0.5)``).
        min_contributions: accepted contributions (the aggregator's own included) a round
            needs; with fewer the round is skipped and anchors stay unchanged.
        max_norm: reject a contribution whose L2 norm exceeds this; ``None`` = no bound.
        island_weights: one non-negative weight per island for ``weighted_mean``, e.g. each
            island's samples per inner step; rejected islands' weights drop out.
        chunk_mb: MiB per point-to-point message, and the block size of validation and
            aggregation (bounds the aggregator's extra memory to about peers x chunk).
        cleanup_timeout_s: how long spool cleanup waits for in-flight writes and reads.
    """

    offload: bool = True
    spool_dir: str | None = None
    aggregation: str = "mean"
    trim_ratio: float = 0.1
    min_contributions: int = 1
    max_norm: float | None = None
    island_weights: list[float] | None = None
    chunk_mb: float = 4.0
    cleanup_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.offload, bool):
            raise ValueError(f"swarm.offload must be true or false, got {self.offload!r}.")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"swarm.aggregation={self.aggregation!r} is not known; choose one of "
                f"{list(AGGREGATIONS)}."
            )
        if not _is_number(self.trim_ratio) or not 0.0 <= self.trim_ratio < 0.5:
            raise ValueError(
                f"swarm.trim_ratio must lie in [0, 0.5), got {self.trim_ratio!r}; e.g. 0.1."
            )
        _check_positive_int(
            "swarm.min_contributions", self.min_contributions, "1 applies any round"
        )
        if self.max_norm is not None and (not _is_number(self.max_norm) or self.max_norm <= 0):
            raise ValueError(
                f"swarm.max_norm must be a positive number or null, got {self.max_norm!r}."
            )
        for option in ("chunk_mb", "cleanup_timeout_s"):
            value = getattr(self, option)
            if not _is_number(value) or value <= 0:
                raise ValueError(f"swarm.{option} must be a positive number, got {value!r}.")
        self._check_weights()

    def _check_weights(self) -> None:
        weights = self.island_weights
        if self.aggregation == "weighted_mean" and weights is None:
            raise ValueError(
                "swarm.aggregation='weighted_mean' needs swarm.island_weights, one weight per "
                "island (e.g. [2, 1] when island 0 sees twice the samples of island 1)."
            )
        if weights is not None:
            weights = list(weights)
            if not weights or not all(_is_number(w) and w >= 0 for w in weights):
                raise ValueError(
                    f"swarm.island_weights must be non-negative numbers, got {weights!r}."
                )
            if sum(weights) <= 0:
                raise ValueError(f"swarm.island_weights must not all be 0, got {weights!r}.")
            self.island_weights = [float(w) for w in weights]
            if self.aggregation != "weighted_mean":
                warnings.warn(
                    "swarm.island_weights has no effect unless swarm.aggregation='weighted_mean'.",
                    UserWarning,
                    stacklevel=3,
                )

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * 2**20))


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
        swarm: options of the swarm transport (``SwarmTransportConfig``; a dict is accepted);
            setting them with ``transport="allreduce"`` has no effect and warns.
        num_fragments: Streaming DiLoCo's F: the trained parameters split into F fragments
            that sync on staggered schedules (fragment f at offset f x sync_every / F).
        fragment_layout: ``"strided"`` (layer i -> fragment i mod F), ``"sequential"`` or
            explicit lists of module names, one list per fragment (checked at setup).
        sync_delay: tau, inner steps between sending a fragment's pseudo-gradient and applying
            the averaged result; the exchange runs in a background thread meanwhile.
        merge_alpha: on arrival, ``local <- (1 - alpha) x global + alpha x local``.
        quantize: codec of the exchanged pseudo-gradients: none, bf16, int8 or int4.
        quantize_block_size: elements sharing one absmax scale (int8 / int4).
        error_feedback: carry each island's quantization error into its next round.
        membership: ``"static"`` (one torch.distributed world, every island in every round) or
            ``"torchft"`` (each launch is one island; islands meet through a lighthouse and
            may fail, restart and join; docs/elastic.md). Checked with the options below by
            ``lightning_swarm.membership.elastic_options``.
        lighthouse: torchft only: the lighthouse's address, e.g. ``http://host:29510``.
        island_id: torchft only: this island's name, unique among live islands.
        min_islands: torchft only: a round commits only with at least this many islands.
        quorum_timeout_s: torchft only: how long a round waits for enough islands.
        round_timeout_s: torchft only: bound on a round's collectives and commit gate.
    """

    sync_every: int = 100
    island_size: int = 1
    transport: str = "allreduce"
    anchor_device: str = "cpu"
    anchor_dtype: str | None = None
    bucket_mb: float = 32.0
    anchors: AnchorConfig = field(default_factory=AnchorConfig)
    swarm: SwarmTransportConfig = field(default_factory=SwarmTransportConfig)
    num_fragments: int = 1
    # A layout name or lists of module names; Any so the Hydra schema accepts both forms.
    fragment_layout: Any = "strided"
    sync_delay: int = 0
    merge_alpha: float = 0.0
    quantize: str = "none"
    quantize_block_size: int = 128
    error_feedback: bool = False
    membership: str = "static"
    lighthouse: str | None = None
    island_id: str | None = None
    min_islands: int = 2
    quorum_timeout_s: float = 60.0
    round_timeout_s: float = 60.0

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
        self.swarm = as_swarm_transport_config(self.swarm)
        if self.transport != "swarm" and self.swarm != SwarmTransportConfig():
            warnings.warn(
                f"swarm transport options have no effect with transport={self.transport!r}; "
                "set transport='swarm' to use them, or drop them.",
                UserWarning,
                stacklevel=3,
            )
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)):
            raise ValueError(f"bucket_mb must be a number of MiB, got {self.bucket_mb!r}.")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}; e.g. bucket_mb=32.")
        check_streaming(self)

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
    return _nested_config(AnchorConfig, value, option="anchors", example="{'mmap': False}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def as_swarm_transport_config(value: object) -> SwarmTransportConfig:
    """Accept a ``SwarmTransportConfig`` or a mapping of its fields (YAML / keyword dict)."""
    return _nested_config(SwarmTransportConfig, value, option="swarm", example="{'offload': False}")


_Nested = TypeVar("_Nested", AnchorConfig, SwarmTransportConfig)


def _nested_config(cls: type[_Nested], value: object, *, option: str, example: str) -> _Nested:
    """Build a nested option group from itself or a mapping, rejecting unknown keys by name."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping) or hasattr(value, "keys"):
        items = {str(k): v for k, v in dict(value).items()}  # type: ignore[call-overload]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(f"{option} has unknown keys {unknown}; known keys: {sorted(known)}.")
        return cls(**items)
    raise TypeError(
        f"{option} must be a dict such as {example} or an instance of {cls.__name__}, got "
        f"{type(value).__name__}."
    )


def check_streaming(config: SwarmConfig) -> None:
    """Validate the Streaming DiLoCo options (fragments, delay, merge, quantization).

    The schedule's own checks (divisibility, delay range, alpha range) run by building the
    ``FragmentSchedule``; whether an explicit layout covers every trained parameter is checked
    at setup, when the names are known.
    """
    _check_positive_int("num_fragments", config.num_fragments, "1 syncs the whole model at once")
    _check_positive_int(
        "quantize_block_size", config.quantize_block_size, "e.g. 128 elements per scale"
    )
    FragmentSchedule(
        sync_every=config.sync_every,
        num_fragments=config.num_fragments,
        sync_delay=config.sync_delay,
        merge_alpha=config.merge_alpha,
    )
    config.fragment_layout = _as_layout(config.fragment_layout, config.num_fragments)
    Codec(config.quantize, config.quantize_block_size)
    if not isinstance(config.error_feedback, bool):
        raise ValueError(f"error_feedback must be true or false, got {config.error_feedback!r}.")
    if config.error_feedback and config.quantize == "none":
        warnings.warn(
            "error_feedback has no effect with quantize='none' (nothing is lost to carry over); "
            "set quantize to bf16, int8 or int4, or drop error_feedback.",
            UserWarning,
            stacklevel=4,
        )


def _as_layout(layout: object, num_fragments: int) -> str | list[list[str]]:
    """A layout name, or explicit lists of module names as plain lists."""
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(
                f"fragment_layout={layout!r} is not known; use one of {list(LAYOUTS)} or a "
                "list of num_fragments lists of module names."
            )
        return layout
    try:
        groups = [[e] if isinstance(e, str) else list(e) for e in layout]  # type: ignore[attr-defined]
    except TypeError:
        groups = []
    if groups and all(isinstance(n, str) for g in groups for n in g):
        if len(groups) != num_fragments:
            raise ValueError(
                f"fragment_layout lists {len(groups)} fragment(s) but num_fragments="
                f"{num_fragments}; give exactly one list of module names per fragment."
            )
        return groups
    raise ValueError(
        f"fragment_layout must be 'strided', 'sequential' or a list of lists of module names "
        f"(one list per fragment), got {layout!r}; e.g. [['blocks.0', 'blocks.2'], ['blocks.1']]."
    )
