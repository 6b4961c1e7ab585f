"""The transport's options as plain data, validated where they are made.

Imports neither torch.distributed nor lightning (the strategy's options build on it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from lightning_swarm.algorithm.robust import check_aggregation, check_weights, is_number
from lightning_swarm.errors import SwarmConfigError

# The transports by option value; "swarm" is the aggregator transport (transport/aggregator/).
TransportName = Literal["allreduce", "swarm"]
TRANSPORTS: tuple[str, ...] = get_args(TransportName)
# Who aggregates a swarm round: one island in turn, or every island its own shard.
AGGREGATORS = ("rotating", "sharded")
MIN_BUCKET_MB = 1.0
MIN_CHUNK_MB = 0.25


def check_bool(option: str, value: object, fix: str = "") -> None:
    """``value`` is a bool; else raise naming ``option`` (``fix``: what each value means)."""
    if not isinstance(value, bool):
        raise SwarmConfigError(f"{option} must be true or false, got {value!r}{fix}.")


def check_block_mb(option: str, value: object, *, floor: float, default: float) -> None:
    """The one check of a block size in MiB: a finite number at or above ``floor``; raise
    naming ``option``, the floor and ``default`` as the fix."""
    if not is_number(value):
        raise SwarmConfigError(
            f"{option} must be a finite number of MiB, got {value!r}; e.g. {option}={default:g}."
        )
    assert isinstance(value, (int, float))
    if value < floor:
        raise SwarmConfigError(
            f"{option}={value!r} is below the floor of {floor:g} MiB: every block costs a "
            f"message and a loop turn, so tiny blocks make each sync many times slower "
            f"(docs/swarm_transport.md); use {option}={default:g} (the default) or at least "
            f"{floor:g}."
        )


def check_aggregator(name: object, *, option: str) -> None:
    if name not in AGGREGATORS:
        raise SwarmConfigError(
            f"{option} must be one of {list(AGGREGATORS)}, got {name!r}; 'rotating' gives each "
            "round to one island in turn, 'sharded' 1/n of it to every island."
        )


def check_transport(name: object) -> None:
    if name not in TRANSPORTS:
        raise SwarmConfigError(
            f"transport={name!r} is not known; choose one of {list(TRANSPORTS)}."
        )


@dataclass(kw_only=True)
class SwarmTransportConfig:
    """Options of the swarm transport (``transport="swarm"``), under ``swarm:`` in YAML.

    Attributes:
        offload: spool peers' pseudo-gradients to disk on the aggregator (``True``) or hold
            them in memory (``False``); results are identical.
        spool_dir: where each rank creates its run's spool directory; ``None`` = TMPDIR; ``~``
            is expanded. Point it at a local disk (not tmpfs) with room for about peers x
            payload bytes.
        aggregation: ``mean``, ``weighted_mean``, ``median`` or ``trimmed_mean``.
        trim_ratio: fraction of contributions dropped at EACH end per coordinate by
            ``trimmed_mean`` (in ``[0, 0.5)``).
        min_contributions: accepted contributions (the aggregator's own included) a round
            needs; with fewer the round is skipped and anchors stay unchanged.
        max_norm: reject a contribution whose L2 norm exceeds this; ``None`` = no bound.
        island_weights: one non-negative weight per island for ``weighted_mean``, e.g. each
            island's samples per inner step; rejected islands' weights drop out.
        chunk_mb: MiB per point-to-point message, and the block size of validation and
            aggregation (bounds the aggregator's extra memory to about peers x chunk); at
            least ``MIN_CHUNK_MB``.
        cleanup_timeout_s: how long spool cleanup waits for in-flight writes and reads.
        aggregator: ``rotating`` (one island aggregates each round, in turn) or ``sharded``
            (every island aggregates 1/n of every round: bytes and work per island stay flat
            as islands are added; same results, rules and spool; docs/scaling.md).
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
    aggregator: str = "rotating"  # not a Literal: OmegaConf refuses them in this Hydra schema

    def __post_init__(self) -> None:
        check_bool("swarm.offload", self.offload)
        if self.spool_dir is not None:
            if not isinstance(self.spool_dir, (str, Path)) or not str(self.spool_dir):
                raise SwarmConfigError(
                    f"swarm.spool_dir must be a directory path (a string) or null for TMPDIR, "
                    f"got {self.spool_dir!r}; e.g. swarm.spool_dir=/local/scratch/spool."
                )
            self.spool_dir = str(Path(self.spool_dir).expanduser())
        check_aggregation(self.aggregation, option="swarm.aggregation")
        if not is_number(self.trim_ratio) or not 0.0 <= self.trim_ratio < 0.5:
            raise SwarmConfigError(
                f"swarm.trim_ratio must lie in [0, 0.5), got {self.trim_ratio!r}; e.g. 0.1."
            )
        needed = self.min_contributions
        if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
            raise SwarmConfigError(
                f"swarm.min_contributions must be a positive integer, got {needed!r}; 1 applies "
                "any round."
            )
        if self.max_norm is not None and (not is_number(self.max_norm) or self.max_norm <= 0):
            raise SwarmConfigError(
                f"swarm.max_norm must be a positive number or null, got {self.max_norm!r}."
            )
        check_block_mb("swarm.chunk_mb", self.chunk_mb, floor=MIN_CHUNK_MB, default=4.0)
        if not is_number(self.cleanup_timeout_s) or self.cleanup_timeout_s <= 0:
            raise SwarmConfigError(
                f"swarm.cleanup_timeout_s must be a positive number, got "
                f"{self.cleanup_timeout_s!r}; e.g. 60."
            )
        check_aggregator(self.aggregator, option="swarm.aggregator")
        if self.aggregation == "weighted_mean" and self.island_weights is None:
            raise SwarmConfigError(
                "swarm.aggregation='weighted_mean' needs swarm.island_weights, one weight per "
                "island (e.g. [2, 1] when island 0 sees twice the samples of island 1)."
            )
        if self.island_weights is not None:
            self.island_weights = check_weights(self.island_weights, option="swarm.island_weights")
            if self.aggregation != "weighted_mean":
                warnings.warn(
                    "swarm.island_weights has no effect unless swarm.aggregation='weighted_mean'.",
                    UserWarning,
                    stacklevel=2,
                )

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 2**20)

    def transport_kwargs(self) -> dict[str, Any]:
        """These options as ``SwarmAggregator``'s keywords but ``owners`` (``aggregator``), with
        ``chunk_mb`` as ``chunk_bytes``."""
        skip = ("chunk_mb", "aggregator")
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        kwargs["chunk_bytes"] = self.chunk_bytes
        return kwargs
