"""The transport contract: "average these pseudo-gradients across islands".

The transport is the only component that moves pseudo-gradients between islands. Contract of
``Transport.average``:
- ``tensors`` are contiguous float32, owned by the caller, with the same names, order and shapes
  on every rank of the peer group; they are overwritten in place.
- With ``RoundStats.applied`` true every rank holds the identical mean; with it false the round
  was skipped, the contents are unspecified and the caller leaves its anchors unchanged.
- Collective: every rank calls it with the same ``round_index``.
- A non-finite pseudo-gradient: all-reduce transports raise ``NonFinitePseudoGradientError`` on
  every rank before anything moves; the swarm transport drops that island's contribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor


@dataclass
class RoundStats:
    """What one ``average`` call cost, as seen by this rank.

    Attributes:
        bytes_sent: payload bytes this rank put on the wire for the round.
        bytes_received: payload bytes this rank took off the wire.
        wall_s: wall-clock seconds spent inside ``average``.
        applied: False when the round was skipped and anchors must stay unchanged.
        non_finite_islands: islands whose contribution was rejected for NaN or inf (the swarm
            transport; the same on every rank that took part). Other transports raise instead.
        rejected_own: this island's own contribution was one of them: it received the round's
            result but its inner state is poisoned (the outer loop resets it).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0
    applied: bool = True
    non_finite_islands: tuple[int, ...] = ()
    rejected_own: bool = False


@runtime_checkable
class Transport(Protocol):
    """Averages named float32 tensors across islands; see the module docstring."""

    def average(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        """Overwrite ``tensors`` with their mean across islands."""
        ...

    def close(self) -> None:
        """Release resources (buffers, spool files). Idempotent."""
        ...
