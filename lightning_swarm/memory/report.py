"""``SwarmMemoryReport``: what a swarm run tells the host-memory census about its own state.

A protocol instead of an import: the census reads these figures from the strategy's
``memory_report`` (``OuterLoop`` implements it) without reaching into private state. No method
keeps a reference to a tensor. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class SwarmMemoryReport(Protocol):
    """Resident state of the swarm on this rank, as the census logs it."""

    def memory_key(self) -> Hashable:
        """A value that changes whenever ``anchor_bytes`` or ``outer_state_bytes`` may change.

        Both walk every anchor (cost grows with the number of parameters), so the census
        recomputes them only when this key changes.
        """
        ...

    def anchor_bytes(self) -> int:
        """Bytes of every anchor tensor (the global model this rank keeps)."""
        ...

    def outer_state_bytes(self) -> int:
        """Bytes of the outer optimizers' state tensors (e.g. Nesterov momentum)."""
        ...

    def spool_bytes(self) -> int | None:
        """Bytes spooled to disk right now; ``None`` when the transport does not spool."""
        ...

    def anchor_spans(self) -> Sequence[tuple[int, int]]:
        """``(address, bytes)`` of each host-memory anchor storage, to match against maps."""
        ...
