"""Typed, self-validating configuration of the swarm strategy (``SwarmConfig``).

Each option is declared, defaulted and documented once here; the strategy's keywords, the Hydra
schema and docs/options.md derive from it. ``__post_init__`` raises ``SwarmConfigError`` or
``SwarmConfigTypeError`` naming the option and the fix. Imports neither torch.distributed nor
lightning.
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
from lightning_swarm.algorithm.outer_schedule import MomentumSchedule
from lightning_swarm.algorithm.robust import is_number
from lightning_swarm.errors import SwarmConfigError, SwarmConfigTypeError
from lightning_swarm.transport.config import (
    MIN_BUCKET_MB,
    SwarmTransportConfig,
    TransportName,
    check_block_mb,
    check_bool,
    check_transport,
)

IslandParallel = Literal["ddp", "fsdp"]
MembershipName = Literal["static", "torchft"]
FrozenParams = Literal["exclude", "sync"]

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
    key = None if value is None else str(value).removeprefix("torch.").lower()
    if key is not None and key not in _DTYPES:
        raise SwarmConfigError(
            f"{option}={key if isinstance(value, torch.dtype) else value!r} is not a supported "
            f"dtype; use one of {sorted(set(_DTYPES))} or null for float32."
        )
    return None if key is None else _DTYPES[key]


@dataclass(kw_only=True)
class AnchorConfig:
    """How anchors are restored from a checkpoint.

    Attributes:
        mmap: map the saved anchors (``torch.load(mmap=True)``) so bytes a restart does not
            touch stay file-backed; ``False`` reads them into RAM, as does the environment
            variable ``LIGHTNING_SWARM_ANCHOR_MMAP=0``.
        verify: before a resume installs anything, check every swarm file against its recorded
            checksum and scan anchors and parameters for NaN/inf; ``False`` skips both.
    """

    mmap: bool = True
    verify: bool = True

    def __post_init__(self) -> None:
        check_bool("anchors.mmap", self.mmap)
        check_bool("anchors.verify", self.verify)


DEFAULT_TIMEOUT_S = 1800.0
"""Every process group's timeout when ``timeout_s`` is not set (torch's own default)."""
ROUND_TIMEOUT_FLOOR_S = 60.0
"""An elastic round's least timeout when ``round_timeout_s`` is not set, and the bound of what
does not grow with the payload (group set-ups, a heal's header)."""

# Where an option must match (field metadata, next to its declaration): "resume" between a
# checkpoint and the resuming run, "islands" between the islands of an elastic swarm.
MustMatchSite = Literal["resume", "islands"]
_RESUME_ISLANDS: dict[str, tuple[MustMatchSite, ...]] = {"must_match": ("resume", "islands")}
_RESUME: dict[str, tuple[MustMatchSite, ...]] = {"must_match": ("resume",)}


@dataclass(kw_only=True)
class SwarmConfig:
    """Options of ``SwarmStrategy`` that are plain data; each default here is the only one.

    Attributes:
        sync_every: H, inner optimizer steps between outer syncs (per optimizer).
        sync_every_s: rounds on a time budget instead: each island trains this many seconds
            between rounds (or until it reaches ``Trainer(max_steps)``, never past it), and the
            fit ends at the first round where some island reached ``max_steps``
            (docs/speeds.md). Needs one fragment and ``sync_delay=0``.
        island_size: ranks per island; must divide the world size.
        transport: how pseudo-gradients are averaged across islands: ``"allreduce"`` over the
            peer group, or ``"swarm"`` (an aggregator that spools, validates and aggregates).
        anchor_device: where anchors and outer optimizer state live.
        anchor_dtype: dtype of the stored anchors (``None``: float32); ``"bfloat16"`` halves
            anchor memory (stochastic rounding; the outer step still runs in float32).
        bucket_mb: MiB in one all-reduce bucket, bounding the transport's extra memory.
        anchors: how anchors are restored on resume (``AnchorConfig``; a dict is accepted).
        swarm: options of the swarm transport (``SwarmTransportConfig``; a dict is accepted).
        num_fragments: Streaming DiLoCo's F: the trained parameters sync in F fragments on
            staggered schedules; ``sync_every`` must be a multiple of F.
        fragment_layout: ``"strided"`` (layer i -> fragment i mod F), ``"sequential"`` or
            explicit lists of module names, one list per fragment.
        sync_delay: tau, inner steps between sending a fragment's pseudo-gradient and applying
            the result (``0 <= sync_delay < sync_every / num_fragments``).
        merge_alpha: on arrival, ``local <- (1 - alpha) x global + alpha x local``.
        quantize: codec of the exchanged pseudo-gradients: none, bf16, int8 or int4.
        quantize_block_size: elements sharing one absmax scale (int8 / int4).
        error_feedback: carry each island's quantization error into its next round.
        sync_at_end: run one last round when fit ends between rounds, so every island ends
            holding the global model; ``False`` keeps the local weights.
        membership: ``"static"`` (one torch.distributed world, every island in every round) or
            ``"torchft"`` (each launch is one island that may fail, restart and join;
            docs/elastic.md).
        lighthouse: torchft only: the lighthouse's address, as ``swarm-lighthouse`` prints it.
        island_id: torchft only: this island's name, unique among live islands.
        min_islands: torchft only: a round commits only with at least this many islands.
        quorum_timeout_s: torchft only: how long a round waits for enough islands.
        round_timeout_s: torchft only: bound on a round's collectives, heal and commit gate;
            ``None`` derives it from the payload and the measured link rate (at least 60 s).
        shard_outer: with ``island_size = k > 1``, each rank owns and exchanges about 1/k of
            the anchors and outer state; refused with ``swarm.max_norm``.
        island_parallel: ``"ddp"`` (every rank holds the whole model) or ``"fsdp"`` (the
            module's ``configure_model`` shards it over the island's mesh; docs/fsdp.md).
        tensor_parallel_size: with ``island_parallel="fsdp"``, ranks of the island mesh's
            ``tensor_parallel`` dimension.
        pipeline_parallel_size: pipeline stages per island (the island mesh's
            ``pipeline_parallel`` dimension; ``island_size = pp x dp x tp``): each rank holds
            and syncs its stage's parameters only; the module's ``configure_model`` keeps its
            stage (``lightning_swarm.keep_stage``) and ``training_step`` runs the batch through
            ``strategy.pipeline_step`` (docs/pipeline.md).
        pipeline_microbatches: micro-batches each batch is split into for the pipeline
            schedule (``None``: ``pipeline_parallel_size``).
        pipeline_schedule: ``"1f1b"`` or ``"gpipe"`` (torch.distributed.pipelining's).
        frozen_params: parameters with ``requires_grad=False`` at setup: ``"exclude"`` (no
            anchor, never exchanged) or ``"sync"`` (kept, so they can be unfrozen mid-run).
        timeout_s: how long a static run's collectives wait before every waiting rank raises
            ``CollectiveTimeoutError``; ``None``: ``DEFAULT_TIMEOUT_S``, the peer group's bound
            growing with the round's payload.
        outer_momentum_warmup: share of the run's rounds (``max_steps / sync_every``) over
            which the outer SGD momentum rises from 0 to its own value (``MomentumSchedule``;
            docs/tuning.md); 0 starts at full momentum.
        outer_momentum_cooldown: share of the rounds at the end over which it falls back to 0
            at the last round; 0 keeps it to the end. Both 0: the momentum is left as the outer
            optimizer holds it (constant).
        warm_start_steps: a synchronous start (post-local SGD): for the first this many
            optimizer steps every rank's gradients are averaged with its counterparts in the
            other islands before the inner step (as DDP over all ranks would), with no outer
            round; then the anchors start from the islands' (equal) weights and rounds follow
            every ``sync_every`` steps. It pays the link at every one of those steps.
    """

    sync_every: int = field(default=100, metadata=_RESUME_ISLANDS)
    sync_every_s: float | None = field(default=None, metadata={"must_match": ("islands",)})
    island_size: int = field(default=1, metadata=_RESUME)
    transport: TransportName = field(default="allreduce", metadata=_RESUME)
    anchor_device: str = "cpu"
    anchor_dtype: str | None = field(default=None, metadata=_RESUME_ISLANDS)
    bucket_mb: float = 32.0
    anchors: AnchorConfig = field(default_factory=AnchorConfig)
    swarm: SwarmTransportConfig = field(default_factory=SwarmTransportConfig)
    num_fragments: int = field(default=1, metadata=_RESUME_ISLANDS)
    fragment_layout: FragmentLayout = field(default="strided", metadata=_RESUME_ISLANDS)
    sync_delay: int = field(default=0, metadata=_RESUME_ISLANDS)
    merge_alpha: float = field(default=0.0, metadata=_RESUME_ISLANDS)
    quantize: CodecName = field(default=NO_CODEC, metadata=_RESUME_ISLANDS)
    quantize_block_size: int = field(default=128, metadata=_RESUME_ISLANDS)
    error_feedback: bool = field(default=False, metadata=_RESUME_ISLANDS)
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
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int | None = None
    pipeline_schedule: str = "1f1b"
    frozen_params: FrozenParams = "exclude"
    timeout_s: float | None = None
    outer_momentum_warmup: float = field(default=0.5, metadata={"must_match": ("islands",)})
    outer_momentum_cooldown: float = field(default=0.5, metadata={"must_match": ("islands",)})
    warm_start_steps: int = 0

    def __post_init__(self) -> None:
        check_positive_int("sync_every", self.sync_every, "e.g. sync_every=100 (DiLoCo's H)")
        check_positive_int("island_size", self.island_size, "1 makes every rank an island")
        check_transport(self.transport)
        if isinstance(self.anchor_device, torch.device):
            self.anchor_device = str(self.anchor_device)
        _check_anchor_device(self.anchor_device)
        fix = "; true (default) ends fit with every island holding the global model"
        check_bool("sync_at_end", self.sync_at_end, fix)
        parse_dtype(self.anchor_dtype, option="anchor_dtype")
        if isinstance(self.anchor_dtype, torch.dtype):
            self.anchor_dtype = str(self.anchor_dtype).removeprefix("torch.")
        self.anchors = _nested_config(AnchorConfig, self.anchors, "anchors", "{'mmap': False}")
        self.swarm = _nested_config(SwarmTransportConfig, self.swarm, "swarm", "{'offload': False}")
        if self.transport != "swarm" and self.swarm != SwarmTransportConfig():
            warnings.warn(
                f"swarm transport options have no effect with transport={self.transport!r}; "
                "set transport='swarm' to use them, or drop them.",
                UserWarning,
                stacklevel=3,
            )
        default_mb = SwarmConfig.bucket_mb  # the field's default, stated once
        check_block_mb("bucket_mb", self.bucket_mb, floor=MIN_BUCKET_MB, default=default_mb)
        _check_streaming(self)
        _check_budget_options(self)
        _check_parallel(self)
        after = "600 (a stopped rank then ends the run after 10 minutes)"
        _check_timeout("timeout_s", self.timeout_s, after)
        derive = "300, or None to derive it from each round's payload and the measured link rate"
        _check_timeout("round_timeout_s", self.round_timeout_s, derive)
        self.momentum_schedule  # noqa: B018  # validates both shares, naming them
        _check_warm_start(self)
        if self.frozen_params not in get_args(FrozenParams):
            raise SwarmConfigError(
                f"frozen_params={self.frozen_params!r} is not known; use 'exclude' (frozen "
                "parameters get no anchor and are never exchanged) or 'sync' (they are kept in "
                "the outer loop, so they can be unfrozen mid-run)."
            )

    def resume_options(self) -> dict[str, Any]:
        """The options a checkpoint records and a resume compares (``RESUME_OPTIONS``), as
        plain values: the dtype by its torch name, numbers and flags normalised."""
        values = {name: getattr(self, name) for name in RESUME_OPTIONS}
        values["anchor_dtype"] = str(self.anchor_torch_dtype).removeprefix("torch.")
        values["merge_alpha"] = float(self.merge_alpha)
        values["error_feedback"] = bool(self.error_feedback)
        return values

    @property
    def momentum_schedule(self) -> MomentumSchedule:
        """The outer momentum schedule of ``outer_momentum_warmup`` / ``_cooldown``."""
        return MomentumSchedule(
            warmup=self.outer_momentum_warmup, cooldown=self.outer_momentum_cooldown
        )

    @property
    def group_timeout_s(self) -> float:
        """Every process group's timeout at creation: ``timeout_s``, or its default."""
        return DEFAULT_TIMEOUT_S if self.timeout_s is None else float(self.timeout_s)

    @property
    def outer_sharded(self) -> bool:
        """Whether each rank of an island owns a shard of the outer state (``shard_outer``)."""
        return self.shard_outer and self.island_size > 1 and not self.model_sharded

    @property
    def model_sharded(self) -> bool:
        """Whether each rank holds only its part of the model (``island_parallel="fsdp"``, or
        pipeline stages): per-rank checkpoint files, an island mesh, each rank its own share."""
        return self.island_parallel == "fsdp" or self.pipeline_parallel_size > 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks of an island's ``data_parallel`` mesh dimension (``island_size`` under DDP)."""
        return self.island_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    @property
    def microbatches(self) -> int:
        """Micro-batches per batch under pipeline stages (``pipeline_microbatches`` or pp)."""
        return self.pipeline_microbatches or self.pipeline_parallel_size

    @property
    def anchor_torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.anchor_dtype, option="anchor_dtype") or torch.float32

    @property
    def bucket_numel(self) -> int:
        """Float32 elements in one transport bucket (at least one)."""
        return max(1, int(self.bucket_mb * 2**20) // 4)


def must_match(site: MustMatchSite) -> tuple[str, ...]:
    """The ``SwarmConfig`` fields that must match at ``site``, in declaration order:
    ``"resume"`` (a checkpoint records them; ``resume.compatibility`` names each change) or
    ``"islands"`` (equal on every island of an elastic swarm; ``round_header``)."""
    return tuple(f.name for f in fields(SwarmConfig) if site in f.metadata.get("must_match", ()))


RESUME_OPTIONS: tuple[str, ...] = must_match("resume")
ISLAND_SETTINGS: tuple[str, ...] = must_match("islands")


def _check_parallel(config: SwarmConfig) -> None:
    """``shard_outer``, ``island_parallel`` and ``tensor_parallel_size``, and what they refuse."""
    check_bool(
        "shard_outer",
        config.shard_outer,
        "; true (default) splits the outer state among an island's ranks",
    )
    if config.outer_sharded and config.transport == "swarm" and config.swarm.max_norm is not None:
        raise SwarmConfigError(
            "shard_outer=True with island_size > 1 cannot apply swarm.max_norm: each rank "
            "exchanges only its share, so the norm of an island's whole pseudo-gradient is "
            "never seen in one place; set shard_outer=False to bound contributions by norm, "
            "or drop swarm.max_norm."
        )
    choices = list(get_args(IslandParallel))
    if config.island_parallel not in choices:
        raise SwarmConfigError(
            f"island_parallel={config.island_parallel!r} is not one of {choices}; "
            "use 'ddp' (every rank holds the model) or 'fsdp' (configure_model shards it)."
        )
    tp = config.tensor_parallel_size
    check_positive_int("tensor_parallel_size", tp, "1 = no tensor parallel")
    if tp > 1 and not config.model_sharded:
        raise SwarmConfigError(
            f"tensor_parallel_size={tp} needs island_parallel='fsdp' "
            "(a DDP island has no tensor-parallel mesh); set island_parallel='fsdp' or "
            "tensor_parallel_size=1."
        )
    if config.island_size % tp != 0:
        raise SwarmConfigError(
            f"tensor_parallel_size={tp} does not divide "
            f"island_size={config.island_size}; an island is data_parallel x tensor_parallel "
            "ranks, so choose a divisor of island_size."
        )
    _check_pipeline(config)


def _check_pipeline(config: SwarmConfig) -> None:
    """``pipeline_parallel_size``, ``pipeline_microbatches`` and ``pipeline_schedule``."""
    from lightning_swarm.pipeline.schedule import check_schedule

    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    check_positive_int("pipeline_parallel_size", pp, "1 = no pipeline stages")
    if config.pipeline_microbatches is not None:
        check_positive_int("pipeline_microbatches", config.pipeline_microbatches, "e.g. 4")
    if config.island_size % (pp * tp) != 0:
        raise SwarmConfigError(
            f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} does not divide "
            f"island_size={config.island_size}; an island is pipeline_parallel x data_parallel "
            "x tensor_parallel ranks, so choose sizes whose product divides island_size."
        )
    check_schedule(config.pipeline_schedule, config.microbatches, pp)
    if pp > 1 and config.sync_every_s is not None:
        raise SwarmConfigError(
            f"pipeline_parallel_size={pp} cannot be combined with sync_every_s: rounds on a "
            "time budget are not built for pipeline stages; use sync_every."
        )


def _check_timeout(option: str, value: object, example: str) -> None:
    """``value`` is None or a finite number of seconds above zero."""
    if value is not None and not (is_number(value) and value > 0):  # type: ignore[operator]
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


def _check_warm_start(config: SwarmConfig) -> None:
    """``warm_start_steps``: a count, and refused where the islands do not step together."""
    steps = config.warm_start_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise SwarmConfigError(
            f"warm_start_steps={steps!r} must be a whole number of optimizer steps >= 0, e.g. "
            "warm_start_steps=100 (0, the default, starts with local steps)."
        )
    if steps == 0:
        return
    refused = [
        (
            config.membership != "static",
            f"membership={config.membership!r}",
            "islands that join and leave do not take their steps together",
            "membership='static'",
        ),
        (
            config.sync_every_s is not None,
            f"sync_every_s={config.sync_every_s}",
            "islands on a time budget step at their own pace",
            "sync_every",
        ),
        (
            config.island_parallel != "ddp",
            f"island_parallel={config.island_parallel!r}",
            "its gradients are FSDP shards, which the warm start does not average",
            "island_parallel='ddp'",
        ),
        (
            config.pipeline_parallel_size > 1,
            f"pipeline_parallel_size={config.pipeline_parallel_size}",
            "a pipeline schedule's gradients are not built for it yet",
            "pipeline_parallel_size=1",
        ),
    ]
    for bad, given, why, fix in refused:
        if bad:
            raise SwarmConfigError(
                f"warm_start_steps={steps} cannot be combined with {given}: the warm start "
                f"averages gradients across islands at every step, and {why}; use {fix}, or "
                "set warm_start_steps=0."
            )


def _check_budget_options(config: SwarmConfig) -> None:
    """``sync_every_s``: fragments and a delay count steps each island takes at its own pace,
    so under a time budget their rounds would fall at different times on different islands."""
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


def _check_streaming(config: SwarmConfig) -> None:
    """The Streaming DiLoCo options; whether an explicit layout covers every trained parameter
    is checked at setup, when the names are known."""
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
