"""``SyncState``: everything one ``OuterSync``'s rounds read and write, in one record.

The round engine (``outer/round.py``) is the one writer of these fields (with the helpers it
hands its dicts to, ``bucket_step`` and ``staging``); everything else reads them. ``params`` are
the module's, written in place by an applied round. ``anchors`` are owned here (one per
``owned`` name, never aliased to a parameter, the pure global model); the outer optimizer over
them owns its state. Sharded, only ``owned`` names have anchors, state and residuals on this
rank. ``residuals`` are per island; everything else (``in_flight``: a held round between send
and apply) is global.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_swarm.algorithm.budget import RoundBudget
from lightning_swarm.algorithm.fragments import FragmentSchedule
from lightning_swarm.outer.reports import OuterOptimizerFactory, StreamingOptions
from lightning_swarm.outer.shard import IslandShard
from lightning_swarm.transport.base import RoundPlace, RoundStats, Transport


@dataclass
class Exchanged:
    """What an exchange reported: the transport's round stats and the averaged
    pseudo-gradient's norm (both identical on all ranks). The averaged tensors themselves are
    written into the round's ``deltas`` in place."""

    stats: RoundStats
    norm: float
    # True when ``norm`` is already the whole island's (a round restored from a checkpoint).
    combined: bool = False
    # The swarm's round the island took in place of its own (``transport.base.Opening``): its
    # place and its averaged deltas (a buffer of their own); the own round is dropped.
    adopted: RoundPlace | None = None
    adopted_flat: Tensor | None = None
    adopted_deltas: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class RoundInFlight:
    """A fragment's two-phase round between its send and its apply.

    Its ``deltas`` are full-size float32 pseudo-gradients that the exchange overwrites in place
    with the average; until ``future`` resolves they belong to the worker thread.
    """

    fragment: int
    send_step: int
    deltas: dict[str, Tensor]
    flat: Tensor | None = None  # the buffer ``deltas`` are views of (None: restored by name)
    send_blocked_s: float = 0.0
    future: Future[Exchanged] | None = None
    result: Exchanged | None = None
    error: Exception | None = None  # a sharded inline exchange that failed (raised at apply)
    # A state dict holds ``deltas``: the engine must not reuse ``flat`` for a later round.
    exported: bool = False


@dataclass(kw_only=True)
class SyncState:
    """The fields an ``OuterSync``'s members share (see the module docstring).

    Attributes:
        params: trained parameters by name, in a fixed order identical on every rank.
        shard: this rank's share of a sharded island, or None (owns every name).
        owned: the names this rank keeps anchors and outer state for.
        owned_fragments: per fragment, the owned names it contains.
        fragments: per fragment, every name it contains.
        transport: averages pseudo-gradients across islands.
        schedule: when each fragment sends and applies.
        streaming: fragments, delay, merge alpha, codec, error feedback and the worker.
        anchor_device: where anchors and outer state live.
        anchor_dtype: the anchors' dtype (float32 unless ``anchor_dtype`` says otherwise).
        outer_optimizer_factory: builds the outer optimizer over the anchors (again on resume).
        anchors: the global parameters as of the last applied round (owned names only).
        outer_optimizer: steps the anchors.
        placeholders: the anchors are memory-less placeholders awaiting a resume.
        inner_steps: inner steps counted so far.
        outer_steps: applied rounds so far (all fragments).
        fragment_rounds: applied rounds per fragment.
        synced_at: per fragment, the inner step after which its locals last equalled its
            anchors on every island (None: unknown, e.g. placeholders awaiting a resume).
        ended_at: the inner step of the last end-of-fit round, or None.
        residuals: error-feedback residuals by owned name (this island's own state).
        in_flight: the round sent and not applied yet, or None.
        budget: the island's time budget between rounds (``sync_every_s``), or None: rounds
            follow ``schedule`` (``budget`` replaces it: one fragment, no delay).
    """

    params: dict[str, torch.nn.Parameter]
    shard: IslandShard | None
    owned: list[str]
    owned_fragments: list[list[str]]
    fragments: list[list[str]]
    transport: Transport
    schedule: FragmentSchedule
    streaming: StreamingOptions
    anchor_device: torch.device
    anchor_dtype: torch.dtype
    outer_optimizer_factory: OuterOptimizerFactory
    anchors: dict[str, Tensor]
    outer_optimizer: torch.optim.Optimizer
    placeholders: bool
    inner_steps: int = 0
    outer_steps: int = 0
    fragment_rounds: list[int] = field(default_factory=list)
    synced_at: list[int | None] = field(default_factory=list)
    ended_at: int | None = None
    residuals: dict[str, Tensor] = field(default_factory=dict)
    in_flight: RoundInFlight | None = None
    budget: RoundBudget | None = None
