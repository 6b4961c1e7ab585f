"""The values an ``OuterSync`` is configured with and reports: plain records, no behaviour.

``StreamingOptions`` holds the Streaming DiLoCo options of one ``OuterSync`` (read, never mutated,
after construction); ``SyncReport`` is one applied or skipped round as this rank saw it, built
at the round's end and owned by the caller from then on. Neither holds a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.outer.worker import SyncWorker

OuterOptimizerFactory = Callable[[Iterable[Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class SyncReport:
    """One applied (or skipped) round as seen by this rank.

    ``wall_s`` is the time the training thread was blocked by the round: computing the
    pseudo-gradients at the send, the exchange itself when it ran inline, waiting for the worker
    and the outer step and merge at the apply. ``transport_s`` is the exchange's own duration,
    wherever it ran (hidden behind inner steps when ``sync_delay > 0``).
    """

    outer_steps: int
    pseudo_grad_norm: float
    bytes_sent: int
    bytes_received: int
    wall_s: float
    applied: bool
    fragment: int = 0
    fragment_rounds: int = 0
    transport_s: float = 0.0
    # Islands rejected for NaN or inf in this round, and whether this island was one of them.
    non_finite_islands: tuple[int, ...] = ()
    rejected_own: bool = False
    # This island's outer state was installed from a live island's in this round (elastic).
    healed: bool = False


@dataclass
class StreamingOptions:
    """Streaming DiLoCo options of one ``OuterSync`` (defaults: plain DiLoCo).

    Attributes:
        fragments: lists of parameter names, together covering every parameter exactly once;
            ``None`` = one fragment of all parameters.
        sync_delay: tau, inner steps between a fragment's send and its apply.
        merge_alpha: on apply, ``local <- (1 - alpha) * global + alpha * local``.
        codec: the transport's codec, needed for error feedback; ``None`` = no feedback.
        error_feedback: keep each parameter's quantization error for its next round.
        worker: runs delayed exchanges; required when ``sync_delay > 0``.
    """

    fragments: Sequence[Sequence[str]] | None = None
    sync_delay: int = 0
    merge_alpha: float = 0.0
    codec: Codec | None = None
    error_feedback: bool = False
    worker: SyncWorker | None = field(default=None, compare=False)
