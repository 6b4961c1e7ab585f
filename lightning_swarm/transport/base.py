"""The transport contract: "average these pseudo-gradients across islands", bucket by bucket.

The transport is the only component that moves pseudo-gradients between islands. The round
engine drives every transport through ``Transport``: ``open`` (one agreement on the finite flag,
before anything moves), ``start(bucket) -> Handle`` per bucket in the same order on every rank,
every handle's ``wait``, then ``agree`` (whether the round applies). A ``Bucket``'s ``flat``
belongs to the transport from ``start`` until its handle's ``wait`` returns; it then holds the
mean. ``pipelined`` transports finish a bucket at its wait; the others may finish every bucket
only at the first wait, so the engine starts all of a round's buckets (back to back in one
buffer) before it waits for any.

With ``RoundStats.applied`` every rank holds the identical mean; otherwise the round was skipped,
the contents are unspecified and the caller leaves its anchors unchanged. A non-finite
pseudo-gradient: all-reduce transports raise ``NonFinitePseudoGradientError`` on every rank at
``open``; the swarm transport drops that island's contribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass
class RoundStats:
    """What one round cost, as seen by this rank.

    Attributes:
        bytes_sent: payload bytes this rank put on the wire for the round.
        bytes_received: payload bytes this rank took off the wire.
        wall_s: wall-clock seconds of the round, from ``open`` to ``agree``.
        applied: False when the round was skipped and anchors must stay unchanged.
        non_finite_islands: islands whose contribution was rejected for NaN or inf (the swarm
            transport; the same on every rank that took part). Other transports raise instead.
        rejected_own: this island's own contribution was one of them: it received the round's
            result but its inner state is poisoned (the outer loop resets it).
        heal: a live island's outer state (an ``OuterRecord`` dict, fresh tensors owned by the
            receiver) this rank must install before it applies the round (elastic membership).
        island_healed: some rank of this island installs a heal in this round (identical on
            every rank of the island): the island gathers its parameters and counters after.
        swarm_steps: under a time budget, the most inner steps of any island in the round,
            where the transport learns it only as the round runs (the aggregator; the others
            answer in ``Opening.swarm_steps``).
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
    """What an island brings to a time-budgeted round (``sync_every_s``).

    Attributes:
        steps: inner steps it took since it left the last round: its weight in the mean.
        inner_steps: inner steps it has taken in all (the swarm's stopping rule reads the most).
    """

    steps: int
    inner_steps: int


@dataclass(frozen=True)
class RoundRequest:
    """What the engine asks of ``Transport.open``: the round it opens.

    Attributes:
        round_index: the round (the outer step count it starts from).
        finite: this island's pseudo-gradient holds no NaN or inf.
        names: the tensors of the round, in order, packed into its buckets.
        place: where the round sits in the schedule (``None``: its own, inline).
        offer: the outer state a healing peer may be sent (transports that ``heals``; built by
            the engine on its own thread, read-only until the next ``open``).
        work: with a time budget only: what this island brings (its weight).
    """

    round_index: int
    finite: bool
    names: Mapping[str, torch.Size]
    place: RoundPlace | None = None
    offer: Mapping[str, Any] | None = None
    work: Work | None = None


@dataclass(frozen=True)
class Opening:
    """What ``open`` decided for this island's round (static transports: the defaults).

    Attributes:
        adopt: the swarm's round this island takes in place of its own (elastic membership:
            an island being healed, or out of step): it exchanges zeros in the shape of
            ``adopt.fragment``'s names, applies that fragment's mean if the round applies, and
            takes the swarm's clock (``adopt.apply_step``) either way. ``None``: its own round.
        abandon: no bucket moves; the round will not apply (``agree`` says so).
        scale: with ``work``: the factor the island multiplies its pseudo-gradient by before
            the plain mean, ``n * w_own / sum_i w_i``, so that the mean is weighted by each
            island's ``Work.steps`` (exactly 1.0 when every weight is equal).
        swarm_steps: with ``work``: the most ``Work.inner_steps`` of any island in the round.
    """

    adopt: RoundPlace | None = None
    abandon: bool = False
    scale: float = 1.0
    swarm_steps: int | None = None


@dataclass(frozen=True)
class Bucket:
    """One bucket of a round: contiguous float32 ``flat``, made of ``runs`` (element counts,
    back to back, each a piece of one tensor that starts on a codec block of that tensor)."""

    flat: Tensor
    runs: tuple[int, ...]

    def run_views(self) -> list[Tensor]:
        """``flat`` cut into its runs (views)."""
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
    """Averages a round's float32 buckets across islands (see the module docstring).

    Attributes:
        bucket_numel: most elements of one bucket the engine should start.
        block_size: buckets are planned on these blocks (a codec's; 1 without one).
        pipelined: a bucket's mean is final when its handle's ``wait`` returns.
        heals: ``open`` sends ``RoundRequest.offer`` to peers it heals, so the engine builds
            one for every round.
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
        """Start the round ``request`` names. Collective; raises
        ``NonFinitePseudoGradientError`` on every rank when an island is not ``finite``, where
        the transport refuses such rounds. With ``work`` the ``Opening`` says how to weigh this
        island."""
        ...

    def start(self, bucket: Bucket) -> Handle: ...

    def agree(self) -> RoundStats:
        """After every handle waited: whether the round applies, and bytes not yet counted by
        the handles."""
        ...

    def close(self) -> None: ...
