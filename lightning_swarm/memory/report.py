"""``SwarmMemoryReport``: what a swarm run tells the host-memory census about its own state.

A small protocol instead of an import: the census (Lightning glue) reads these figures from
whatever the strategy exposes as ``memory_report``, and never imports the strategy or reaches
into its private state. ``lightning_swarm.outer.OuterLoop`` implements it. Stdlib only.

Every method is cheap except where noted; none keeps a reference to a tensor.
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
