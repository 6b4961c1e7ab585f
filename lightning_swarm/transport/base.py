"""The transport contract: "average these pseudo-gradients across islands", bucket by bucket.

The engine calls ``open``, ``start(bucket)`` per bucket in the same order on every rank, every
handle's ``wait``, then ``agree``. A bucket's ``flat`` is the transport's from ``start`` until its
``wait`` returns, then holds the mean, identical on every rank if ``RoundStats.applied``; if not,
it holds garbage and the caller leaves its anchors unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_swarm.transport.errors import BadWorkError


@dataclass
class RoundStats:
    """What one round cost and decided, as seen by this rank (``wall_s``: ``open`` to ``agree``).

    Attributes:
        applied: False when the round was skipped and anchors must stay unchanged.
        non_finite_islands: islands the swarm transport rejected for NaN or inf (the same on
            every rank that took part); ``rejected_own``: this island was one of them, so its
            inner state is poisoned (the outer loop resets it).
        heal: a live island's outer state (an ``OuterRecord`` dict, fresh tensors owned by the
            receiver) this rank must install before it applies the round (elastic membership).
        island_healed: some rank of this island installs a heal in this round (identical on
            every rank of the island): the island gathers its parameters and counters after.
        swarm_steps: under a time budget, the most inner steps of any island, where the
            transport learns it only as the round runs (others answer in ``Opening``).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0
    applied: bool = True
    non_finite_islands: tuple[int, ...] = ()
    rejected_own: bool = False
    heal: Mapping[str, Any] | None = None
    island_healed: bool = False
    swarm_steps: int | None = None


@dataclass(frozen=True)
class RoundPlace:
    """Where a round sits in an island's schedule."""

    fragment: int
    send_step: int  # the inner step it was sent after
    apply_step: int  # the inner step it applies at (send_step + sync_delay; inline: send_step)


@dataclass(frozen=True)
class Work:
    """What an island brings to a time-budgeted round (``sync_every_s``): its weight in the mean
    (inner ``steps`` since it left the last round) and its ``inner_steps`` in all (the swarm's
    stopping rule reads the most)."""

    steps: int
    inner_steps: int


def checked_work(
    rows: Sequence[tuple[float, float]], names: Sequence[str] | None = None
) -> tuple[list[float], int]:
    """Every island's weight and the swarm's most inner steps, from the ``(steps, inner_steps)``
    each island sent (untrusted: a peer's bytes; ``names`` names the senders in messages).
    ``BadWorkError`` names the first that is not finite whole numbers ``0 <= steps <= inner``
    (0: an island that took no step since its last round, e.g. at an elastic island's join;
    it adds nothing to a weighted mean, and a round where every weight is 0 is a plain mean).
    """
    for i, (steps, inner) in enumerate(rows):
        if not (_whole(steps) and _whole(inner) and 0 <= steps <= inner):
            who = names[i] if names is not None else f"island {i}"
            raise BadWorkError(
                f"{who} sent the weight {steps!r} (inner steps since the last round) with "
                f"{inner!r} inner steps in all; a weight must be a whole number from 0 to its "
                "inner steps, so the round was not run on any island (anchors unchanged). "
                "Its round header is damaged, or it runs another version of lightning_swarm: "
                "run the same version with the same sync_every_s on every island."
            )
    return [float(steps) for steps, _ in rows], int(max(inner for _, inner in rows))


def _whole(value: float) -> bool:
    return math.isfinite(value) and value == math.floor(value)


@dataclass(frozen=True)
class RoundRequest:
    """The round ``Transport.open`` opens: ``round_index`` (the outer step count it starts
    from), whether this island is ``finite``, the ``names`` packed into its buckets in order,
    its ``place`` (``None``: inline), its ``work`` under a time budget, the ``offer`` a
    healing peer may be sent (read-only until the next ``open``), and ``layout``: the
    fingerprint of this rank's slices of ``names`` (``model_layout.fingerprint`` with
    ``placement``), which the ranks a round pairs up must share (0: not checked)."""

    round_index: int
    finite: bool
    names: Mapping[str, torch.Size]
    place: RoundPlace | None = None
    offer: Mapping[str, Any] | None = None
    work: Work | None = None
    layout: int = 0


@dataclass(frozen=True)
class Opening:
    """What ``open`` decided for this island's round (static transports: the defaults).

    Attributes:
        adopt: the swarm's round this island takes in place of its own (elastic membership: an
            island being healed, or out of step): it exchanges zeros in the shape of
            ``adopt.fragment``'s names, applies that fragment's mean if the round applies, and
            takes the swarm's clock (``adopt.apply_step``) either way.
        abandon: no bucket moves; the round will not apply (``agree`` says so).
        scale: with ``work``: the island multiplies its pseudo-gradient by
            ``n * w_own / sum_i w_i`` before the plain mean (1.0 when the weights are equal).
        swarm_steps: with ``work``: the most ``Work.inner_steps`` of any island in the round.
    """

    adopt: RoundPlace | None = None
    abandon: bool = False
    scale: float = 1.0
    swarm_steps: int | None = None


@dataclass(frozen=True)
class Bucket:
    """A round's contiguous float32 ``flat``, made of ``runs`` (element counts, back to back,
    each a piece of one tensor starting on a codec block of that tensor)."""

    flat: Tensor
    runs: tuple[int, ...]

    def run_views(self) -> list[Tensor]:
        return list(self.flat.split(list(self.runs)))


class Handle(Protocol):
    """A started bucket; ``wait`` completes its mean in place and returns the bytes sent."""

    def wait(self) -> int: ...


@dataclass
class Done:
    """A handle whose bucket is already complete."""

    sent: int = 0

    def wait(self) -> int:
        return self.sent


@runtime_checkable
class Transport(Protocol):
    """Averages a round's float32 buckets across islands (module docstring).

    Attributes:
        bucket_numel, block_size: the most elements of one bucket, planned on these blocks.
        pipelined: a bucket's mean is final when its handle's ``wait`` returns; else perhaps
            only at the first wait, so the engine starts all buckets (one buffer) first.
        heals: ``open`` may send ``RoundRequest.offer``, so the engine builds one every round.
        every_rank_in_round: every rank of the island takes part in every round, even one
            whose share of the fragment is empty (elastic islands: a Manager per rank).
    """

    heals: bool
    every_rank_in_round: bool

    @property
    def bucket_numel(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def pipelined(self) -> bool: ...

    def open(self, request: RoundRequest) -> Opening:
        """Start the round (collective). Where the transport refuses non-finite islands (all
        but the swarm's), raises ``NonFinitePseudoGradientError`` on every rank."""
        ...

    def start(self, bucket: Bucket) -> Handle: ...

    def agree(self) -> RoundStats:
        """After every wait: whether the round applies, and bytes the handles did not count."""
        ...

    def close(self) -> None: ...
