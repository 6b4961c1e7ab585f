"""Typed, self-validating configuration of the swarm strategy.

``SwarmConfig`` declares every strategy option but the outer optimizer factory; the strategy's
keywords and the Hydra schema derive from it, so YAML keys equal its fields. ``__post_init__``
raises ``SwarmConfigError`` (a ``ValueError``) or ``SwarmConfigTypeError`` (a ``TypeError``),
naming the option and the fix, before any group or tensor exists. Imports neither
torch.distributed nor lightning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args

import torch

from lightning_swarm.algorithm.budget import check_budget
from lightning_swarm.algorithm.codecs import NO_CODEC, Codec, CodecName
from lightning_swarm.algorithm.fragments import (
    FragmentLayout,
    FragmentSchedule,
    as_layout,
    check_positive_int,
)
from lightning_swarm.errors import SwarmConfigError, SwarmConfigTypeError
from lightning_swarm.transport.config import (
    MIN_BUCKET_MB,
    TRANSPORTS,
    SwarmTransportConfig,
    TransportName,
    check_block_mb,
    check_bool,
    check_transport,
)

__all__ = [
    "ISLAND_PARALLEL",
    "ISLAND_SETTINGS",
    "RESUME_OPTIONS",
    "TRANSPORTS",
    "AnchorConfig",
    "SwarmConfig",
    "SwarmTransportConfig",
    "must_match",
    "parse_dtype",
]

IslandParallel = Literal["ddp", "fsdp"]
ISLAND_PARALLEL: tuple[str, ...] = get_args(IslandParallel)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def dtype_name(value: str | torch.dtype | None) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; a name or None passes through (checked later)."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def parse_dtype(value: str | torch.dtype | None, *, option: str) -> torch.dtype | None:
    """Turn ``"bfloat16"`` / ``torch.bfloat16`` / ``None`` into a floating torch dtype."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise SwarmConfigError(f"{option} must be a floating dtype, got {value}.")
        return value
    key = str(value).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise SwarmConfigError(
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
        verify: before a resume installs anything, check every swarm file against the checksum
            its checkpoint recorded (one chunked read per file) and scan anchors and island
            parameters for NaN/inf; ``False`` skips both (file sizes are still checked).
    """

    mmap: bool = True
    verify: bool = True

    def __post_init__(self) -> None:
        check_bool("anchors.mmap", self.mmap)
        check_bool("anchors.verify", self.verify)


MembershipName = Literal["static", "torchft"]

DEFAULT_TIMEOUT_S = 1800.0
"""Every process group's timeout when ``timeout_s`` is not set (torch's own default)."""
ROUND_TIMEOUT_FLOOR_S = 60.0
"""An elastic round's least timeout when ``round_timeout_s`` is not set, and the bound of what
does not grow with the payload (group set-ups, a heal's header)."""
FrozenParams = Literal["exclude", "sync"]

# Where an option must match (field metadata, so a new option is marked next to its
# declaration and nowhere else): "resume" compares it between a checkpoint and the resuming run,
# "islands" between the islands of an elastic swarm. ``must_match`` lists each site's fields.
MustMatchSite = Literal["resume", "islands"]
_MUST_MATCH = "must_match"


def _must_match(*sites: MustMatchSite) -> dict[str, tuple[MustMatchSite, ...]]:
    """Field metadata marking an option as one that must match at ``sites``."""
    return {_MUST_MATCH: sites}


@dataclass(kw_only=True)
class SwarmConfig:
    """Options of ``SwarmStrategy`` that are plain data.

    Each field's default here is the only one: the Hydra schema and ``conf/strategy/*.yaml``
    state only what a preset changes. Field metadata marks the options that must match between
    a checkpoint and the resuming run (``"resume"``) or between the islands of an elastic swarm
    (``"islands"``); ``must_match`` lists them.

    Attributes:
        sync_every: H, inner optimizer steps between outer syncs (per optimizer).
        sync_every_s: rounds on a time budget instead (docs/speeds.md): each island trains
            for this many seconds of its own wall time after it left the last round, then joins
            the next round (at most one inner step late), and the round's mean weighs each
            island by the inner steps it took. The fit ends at the first round where some
            island reached ``Trainer(max_steps)``. ``None`` (default): every ``sync_every``
            steps. Needs one fragment and ``sync_delay=0`` (checked by
            ``check_budget_options``).
        island_size: ranks per island; must divide the world size (checked at setup).
        transport: how pseudo-gradients are averaged across islands: ``"allreduce"`` (a
            bucketed all-reduce over the peer group) or ``"swarm"`` (a rotating aggregator that
            spools, validates and aggregates; options under ``swarm``).
        anchor_device: where anchors and outer optimizer state live (``"cpu"`` by default,
            never silently on the accelerator); an accelerator this build cannot use is refused.
        anchor_dtype: dtype of the stored anchors; ``None`` means float32. ``"bfloat16"``
            halves anchor memory: the outer step still runs in float32 and bfloat16 anchors
            are stored with stochastic rounding.
        bucket_mb: size of one all-reduce bucket in MiB; bounds the transport's extra memory
            (at least ``MIN_BUCKET_MB``: smaller buckets only make syncs slower).
        anchors: how anchors are restored on resume (``AnchorConfig``; a dict is accepted).
        swarm: options of the swarm transport (``SwarmTransportConfig``; a dict is accepted);
            setting them with ``transport="allreduce"`` has no effect and warns
            (docs/swarm_transport.md).
        num_fragments: Streaming DiLoCo's F: the trained parameters split into F fragments
            that sync on staggered schedules (fragment f at offset f x sync_every / F);
            ``sync_every`` must be a multiple of F.
        fragment_layout: ``"strided"`` (layer i -> fragment i mod F), ``"sequential"`` or
            explicit lists of module names, one list per fragment (checked at setup).
        sync_delay: tau, inner steps between sending a fragment's pseudo-gradient and applying
            the averaged result; the exchange runs in a background thread meanwhile
            (``0 <= sync_delay < sync_every / num_fragments``).
        merge_alpha: on arrival, ``local <- (1 - alpha) x global + alpha x local``.
        quantize: codec of the exchanged pseudo-gradients: none, bf16, int8 or int4.
        quantize_block_size: elements sharing one absmax scale (int8 / int4).
        error_feedback: carry each island's quantization error into its next round.
        sync_at_end: when fit ends with inner steps since the last round, run one last round
            so every island ends holding the same global model (the anchors); ``False`` keeps
            each island's local weights.
        membership: ``"static"`` (one torch.distributed world, every island in every round) or
            ``"torchft"`` (each launch is one island; islands meet through a lighthouse and
            may fail, restart and join; needs the ``elastic`` extra; docs/elastic.md). With
            ``"torchft"``, fragments, ``sync_delay``, ``merge_alpha`` and ``quantize`` (with
            error feedback) work, each fragment's round being a torchft round of its own;
            ``transport="swarm"`` is refused.
        lighthouse: torchft only: the lighthouse's address, as ``swarm-lighthouse`` prints it,
            e.g. ``http://host:29510``.
        island_id: torchft only: this island's name, unique among live islands.
        min_islands: torchft only: a round commits only with at least this many islands.
        quorum_timeout_s: torchft only: how long a round waits for enough islands.
        round_timeout_s: torchft only: bound on a round's collectives, its heal and its
            commit gate. ``None`` (the default) derives it per round as ``timeout_s`` does for
            the peer group: 4x the payload's time at the link rate this rank measured in its
            last round (10 Mbit/s before any), at least 60 s; a value set here is used as it is.
        shard_outer: with ``island_size = k > 1``, each rank of an island owns about 1/k of
            the anchors and outer state (balanced by bytes) and exchanges only that share
            across islands; the island then gathers the new parameters over its own group.
            Cross-island bytes, anchor memory and outer-step work per rank drop about k-fold;
            refused with ``swarm.max_norm``. ``False`` keeps every rank's full copy. No effect
            with ``island_parallel="fsdp"``: there each rank's share is its own model shard.
            With ``membership="torchft"`` the island is the launch's world (k ranks): each rank
            then exchanges its share with a torchft Manager of its own, and every island of the
            swarm must split the outer state alike (the same k; ``False`` means 1).
        island_parallel: how an island's ranks split the work: ``"ddp"`` (every rank holds the
            whole model, gradients averaged over the island's group) or ``"fsdp"`` (the module's
            ``configure_model`` shards it over the island's own ``(data_parallel,
            tensor_parallel)`` mesh; the outer round runs on each rank's local shards;
            docs/fsdp.md).
        tensor_parallel_size: with ``island_parallel="fsdp"``, ranks of the island's
            ``tensor_parallel`` mesh dimension; ``island_size / tensor_parallel_size`` ranks form
            its ``data_parallel`` dimension.
        frozen_params: what the outer loop does with parameters an optimizer holds that have
            ``requires_grad=False`` at setup: ``"exclude"`` (they cannot change while frozen:
            no anchor, never exchanged; unfreezing one later is refused at that step) or
            ``"sync"`` (anchored and exchanged like the others, so they can be unfrozen
            mid-run).
        timeout_s: how long any collective of a static run (DDP inside an island, the outer
            round, a checkpoint's barriers) waits for the other ranks before every waiting
            rank raises ``CollectiveTimeoutError``: a rank that stopped or hung ends the run
            after this many seconds instead of blocking it (torch's default is 30 minutes).
            ``None`` (the default) means ``DEFAULT_TIMEOUT_S`` for every group, except that
            the peer group's bound grows with the round's payload over the link rate the last
            round measured (``transport.link``); a value set here is used as it is everywhere.
    """

    sync_every: int = field(default=100, metadata=_must_match("resume", "islands"))
    sync_every_s: float | None = field(default=None, metadata=_must_match("islands"))
    island_size: int = field(default=1, metadata=_must_match("resume"))
    transport: TransportName = field(default="allreduce", metadata=_must_match("resume"))
    anchor_device: str = "cpu"
    anchor_dtype: str | None = field(default=None, metadata=_must_match("resume", "islands"))
    bucket_mb: float = 32.0
    anchors: AnchorConfig = field(default_factory=AnchorConfig)
    swarm: SwarmTransportConfig = field(default_factory=SwarmTransportConfig)
    num_fragments: int = field(default=1, metadata=_must_match("resume", "islands"))
    fragment_layout: FragmentLayout = field(
        default="strided", metadata=_must_match("resume", "islands")
    )
    sync_delay: int = field(default=0, metadata=_must_match("resume", "islands"))
    merge_alpha: float = field(default=0.0, metadata=_must_match("resume", "islands"))
    quantize: CodecName = field(default=NO_CODEC, metadata=_must_match("resume", "islands"))
    quantize_block_size: int = field(default=128, metadata=_must_match("resume", "islands"))
    error_feedback: bool = field(default=False, metadata=_must_match("resume", "islands"))
    sync_at_end: bool = True
    membership: MembershipName = "static"
    lighthouse: str | None = None
    island_id: str | None = None
    min_islands: int = 2
    quorum_timeout_s: float = 60.0
    round_timeout_s: float | None = None
    shard_outer: bool = True
    island_parallel: IslandParallel = "ddp"
    tensor_parallel_size: int = 1
    frozen_params: FrozenParams = "exclude"
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_positive_int("sync_every", self.sync_every, "e.g. sync_every=100 (DiLoCo's H)")
        check_positive_int("island_size", self.island_size, "1 makes every rank an island")
        check_transport(self.transport)
        _check_anchor_device(self.anchor_device)
        fix = "; true (default) ends fit with every island holding the global model"
        check_bool("sync_at_end", self.sync_at_end, fix)
        parse_dtype(self.anchor_dtype, option="anchor_dtype")
        self.anchors = _nested_config(AnchorConfig, self.anchors, "anchors", "{'mmap': False}")
        self.swarm = _nested_config(SwarmTransportConfig, self.swarm, "swarm", "{'offload': False}")
        if self.transport != "swarm" and self.swarm != SwarmTransportConfig():
            warnings.warn(
                f"swarm transport options have no effect with transport={self.transport!r}; "
                "set transport='swarm' to use them, or drop them.",
                UserWarning,
                stacklevel=3,
            )
        check_block_mb("bucket_mb", self.bucket_mb, floor=MIN_BUCKET_MB, default=32.0)
        check_streaming(self)
        check_budget_options(self)
        _check_shard_outer(self)
        check_island_parallel(self)
        after = "600 (a stopped rank then ends the run after 10 minutes)"
        _check_timeout("timeout_s", self.timeout_s, after)
        derive = "300, or None to derive it from each round's payload and the measured link rate"
        _check_timeout("round_timeout_s", self.round_timeout_s, derive)
        check_frozen_params(self.frozen_params)

    def resume_options(self) -> dict[str, Any]:
        """The options a checkpoint records and a resume compares (``RESUME_OPTIONS``), as
        plain values: the dtype by its torch name, numbers and flags normalised."""
        values = {name: getattr(self, name) for name in RESUME_OPTIONS}
        values["anchor_dtype"] = str(self.anchor_torch_dtype).removeprefix("torch.")
        values["merge_alpha"] = float(self.merge_alpha)
        values["error_feedback"] = bool(self.error_feedback)
        return values

    @property
    def group_timeout_s(self) -> float:
        """Every process group's timeout at creation: ``timeout_s``, or its default."""
        return DEFAULT_TIMEOUT_S if self.timeout_s is None else float(self.timeout_s)

    @property
    def outer_sharded(self) -> bool:
        """Whether each rank of an island owns a shard of the outer state (``shard_outer``)."""
        return self.shard_outer and self.island_size > 1 and self.island_parallel == "ddp"

    @property
    def model_sharded(self) -> bool:
        """Whether each rank holds only its shard of the model (``island_parallel="fsdp"``)."""
        return self.island_parallel == "fsdp"

    @property
    def data_parallel_size(self) -> int:
        """Ranks of an island's ``data_parallel`` mesh dimension (``island_size`` under DDP)."""
        return self.island_size // self.tensor_parallel_size

    @property
    def anchor_torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.anchor_dtype, option="anchor_dtype") or torch.float32

    @property
    def bucket_numel(self) -> int:
        """Float32 elements in one transport bucket (at least one)."""
        return max(1, int(self.bucket_mb * 2**20) // 4)


def must_match(site: MustMatchSite) -> tuple[str, ...]:
    """The ``SwarmConfig`` fields marked must-match for ``site``, in declaration order.

    Args:
        site: ``"resume"`` (a checkpoint records the option and a resume names each change,
            ``lightning_swarm.resume.compatibility``) or ``"islands"`` (every island of an
            elastic swarm must hold the same value; ``round_header.swarm_settings``).
    """
    return tuple(f.name for f in fields(SwarmConfig) if site in f.metadata.get(_MUST_MATCH, ()))


# The fields that shape the outer loop's saved state: a checkpoint records them and a resume
# names every one that changed (lightning_swarm.resume.compatibility says what follows).
RESUME_OPTIONS: tuple[str, ...] = must_match("resume")
# The settings that make two islands' rounds mean the same thing; the round header refuses an
# island whose values differ (with the outer optimizer's, lightning_swarm.membership).
ISLAND_SETTINGS: tuple[str, ...] = must_match("islands")


def _check_shard_outer(config: SwarmConfig) -> None:
    """``shard_outer`` is a bool, and refused with the options a share cannot serve."""
    fix = "; true (default) splits the outer state among an island's ranks"
    check_bool("shard_outer", config.shard_outer, fix)
    if not config.outer_sharded:
        return
    if config.transport == "swarm" and config.swarm.max_norm is not None:
        raise SwarmConfigError(
            "shard_outer=True with island_size > 1 cannot apply swarm.max_norm: each rank "
            "exchanges only its share, so the norm of an island's whole pseudo-gradient is "
            "never seen in one place; set shard_outer=False to bound contributions by norm, "
            "or drop swarm.max_norm."
        )


def check_island_parallel(config: SwarmConfig) -> None:
    """``island_parallel`` and ``tensor_parallel_size``, and what model-sharded islands refuse."""
    if config.island_parallel not in ISLAND_PARALLEL:
        raise SwarmConfigError(
            f"island_parallel={config.island_parallel!r} is not one of {list(ISLAND_PARALLEL)}; "
            "use 'ddp' (every rank holds the model) or 'fsdp' (configure_model shards it)."
        )
    check_positive_int(
        "tensor_parallel_size", config.tensor_parallel_size, "1 = no tensor parallel"
    )
    if config.tensor_parallel_size > 1 and not config.model_sharded:
        raise SwarmConfigError(
            f"tensor_parallel_size={config.tensor_parallel_size} needs island_parallel='fsdp' "
            "(a DDP island has no tensor-parallel mesh); set island_parallel='fsdp' or "
            "tensor_parallel_size=1."
        )
    if config.island_size % config.tensor_parallel_size != 0:
        raise SwarmConfigError(
            f"tensor_parallel_size={config.tensor_parallel_size} does not divide "
            f"island_size={config.island_size}; an island is data_parallel x tensor_parallel "
            "ranks, so choose a divisor of island_size."
        )
    if config.model_sharded and config.membership != "static":
        raise SwarmConfigError(
            f"membership={config.membership!r} cannot be combined with island_parallel='fsdp': "
            "elastic membership (its heal, round header and per-rank shares) is written for "
            "whole parameters on each rank, not FSDP shards; use membership='static'."
        )


FROZEN_PARAMS: tuple[str, ...] = get_args(FrozenParams)


def check_frozen_params(value: object) -> None:
    """``frozen_params`` is one of ``FROZEN_PARAMS``."""
    if value not in FROZEN_PARAMS:
        raise SwarmConfigError(
            f"frozen_params={value!r} is not known; use 'exclude' (frozen parameters get no "
            "anchor and are never exchanged) or 'sync' (they are kept in the outer loop, so "
            "they can be unfrozen mid-run)."
        )


def _check_timeout(option: str, value: object, example: str) -> None:
    """``option``'s ``value`` is None (its default applies) or a finite number of seconds above
    zero; ``example`` follows ``option=`` in the message."""
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not 0 < float(value) < float("inf"):  # type: ignore[arg-type]
        raise SwarmConfigError(
            f"{option}={value!r} must be a finite number of seconds above 0, e.g. "
            f"{option}={example}."
        )


def _check_anchor_device(anchor_device: str) -> None:
    """A torch device this build can use (an accelerator must be available here)."""
    try:
        device = torch.device(anchor_device)
    except (RuntimeError, TypeError) as err:
        raise SwarmConfigError(
            f"anchor_device={anchor_device!r} is not a torch device; use 'cpu' "
            "(recommended) or an accelerator such as 'cuda'."
        ) from err
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        raise SwarmConfigError(
            f"anchor_device={anchor_device!r}, but this torch build finds no {device.type} "
            f"device (torch.{device.type}.is_available() is False); use anchor_device='cpu' "
            f"(the default), or run where torch can use a {device.type} device."
        )


_Nested = TypeVar("_Nested", AnchorConfig, SwarmTransportConfig)


def _nested_config(cls: type[_Nested], value: object, option: str, example: str) -> _Nested:
    """An option group ``cls`` from itself or a mapping of its fields (YAML / keyword dict),
    rejecting unknown keys by name."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping) or hasattr(value, "keys"):
        items = {str(k): v for k, v in dict(value).items()}  # type: ignore[call-overload]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise SwarmConfigError(
                f"{option} has unknown keys {unknown}; known keys: {sorted(known)}."
            )
        return cls(**items)
    raise SwarmConfigTypeError(
        f"{option} must be a dict such as {example} or an instance of {cls.__name__}, got "
        f"{type(value).__name__}."
    )


def check_budget_options(config: SwarmConfig) -> None:
    """``sync_every_s``: a positive number, and refused by name with what it cannot combine.

    Fragments stagger rounds by steps and a delay applies a round steps after its send: both
    count steps an island takes at its own pace, so under a time budget their rounds would
    fall at different times on different islands. Every transport and torchft's quorum weigh
    a budgeted round by the islands' inner steps (docs/speeds.md).
    """
    check_budget(config.sync_every_s)
    if config.sync_every_s is None:
        return
    refused = [
        (config.num_fragments != 1, f"num_fragments={config.num_fragments}", "num_fragments=1"),
        (config.sync_delay != 0, f"sync_delay={config.sync_delay}", "sync_delay=0"),
    ]
    for bad, given, fix in refused:
        if bad:
            raise SwarmConfigError(
                f"sync_every_s={config.sync_every_s} cannot be combined with {given}: rounds on "
                f"a time budget are whole-model rounds without delay; set {fix}, or drop "
                "sync_every_s to sync every sync_every steps."
            )


def check_streaming(config: SwarmConfig) -> None:
    """Validate the Streaming DiLoCo options (fragments, delay, merge, quantization).

    The schedule's own checks (divisibility, delay range, alpha range) run by building the
    ``FragmentSchedule``; whether an explicit layout covers every trained parameter is checked
    at setup, when the names are known.
    """
    check_positive_int(
        "quantize_block_size", config.quantize_block_size, "e.g. 128 elements per scale"
    )
    FragmentSchedule(
        sync_every=config.sync_every,
        num_fragments=config.num_fragments,
        sync_delay=config.sync_delay,
        merge_alpha=config.merge_alpha,
    )
    config.fragment_layout = as_layout(config.fragment_layout, config.num_fragments)
    Codec(config.quantize, config.quantize_block_size)
    check_bool("error_feedback", config.error_feedback)
    if config.error_feedback and config.quantize == NO_CODEC:
        warnings.warn(
            "error_feedback has no effect with quantize='none' (nothing is lost to carry over); "
            "set quantize to bf16, int8 or int4, or drop error_feedback.",
            UserWarning,
            stacklevel=4,
        )
