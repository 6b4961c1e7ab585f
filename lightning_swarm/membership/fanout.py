"""The membership's collectives inside one island: rank 0's fan-out, and the ranks' agreements.

Every call is collective over the island, on a gloo group (created beside a group of another
backend, destroyed in ``close``); errors are raised alike on every rank (``transport.agree``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch.distributed as dist
from torch import Tensor

from lightning_swarm.membership.errors import MembershipError
from lightning_swarm.membership.state_wire import decode_tree, encode_tree, receive_buffers
from lightning_swarm.transport.agree import Gather, agree, objects_over

T = TypeVar("T")


@dataclass
class RoundOutcome:
    """One round as the rank that ran it saw it."""

    committed: bool = False
    genesis: bool = False
    participants: int = 0
    healed: dict[str, Any] | None = None
    heal_bytes: int = 0
    heal_s: float = 0.0


class IslandFanout:
    """``side_group``: create a gloo group beside ``group``; ``None`` decides by its backend."""

    def __init__(self, group: dist.ProcessGroup | None, side_group: bool | None = None) -> None:
        self.group = group
        self.size, rank = 1, 0
        if dist.is_available() and dist.is_initialized():
            self.size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.position = rank
        self.is_leader = rank == 0
        self._src = dist.get_global_rank(group, 0) if group is not None and self.size > 1 else 0
        self._created: dist.ProcessGroup | None = None
        if self.size > 1:
            if side_group is None:
                side_group = dist.get_backend(group) != dist.Backend.GLOO
            if side_group:
                ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
                created = dist.new_group(ranks, backend=dist.Backend.GLOO)
                assert isinstance(created, dist.ProcessGroup), "every rank is in its island"
                self.group = self._created = created

    def close(self) -> None:
        if self._created is not None:
            dist.destroy_process_group(self._created)
            self._created = None

    def _broadcast(self, tensor: Tensor) -> None:
        if tensor.device.type == "cpu":
            dist.broadcast(tensor, src=self._src, group=self.group)
            return
        staged = tensor.cpu()  # gloo moves CPU tensors; an accelerator's go through a copy
        dist.broadcast(staged, src=self._src, group=self.group)
        tensor.copy_(staged)

    def _gather(self) -> Gather:
        return objects_over(self.group) if self.size > 1 else lambda outcome: [outcome]

    def share_error(self, error: MembershipError | None) -> None:
        agree(gather=self._gather(), error=error)

    def on_leader(self, run: Callable[[], T], default: T) -> T:
        """``run()`` on rank 0 (``default`` on the others) and its result, pickled (small records
        only), on every rank; a ``MembershipError`` it raises is raised on every rank."""
        result, error = default, None
        if self.is_leader:
            try:
                result = run()
            except MembershipError as err:
                error = err
        shared: T = agree(gather=self._gather(), error=error, share=result).shares[0]
        return shared

    def all_true(self, flag: bool) -> bool:
        return agree(flag, gather=self._gather()).all_ok

    def agree_round(
        self, error: MembershipError | None, committed: bool, healed: bool
    ) -> tuple[bool, bool]:
        """(every rank committed, some rank was healed), or the lowest rank's error raised."""
        agreed = agree(gather=self._gather(), error=error, values=(committed, healed))
        return agreed.sums[0] == self.size, agreed.sums[1] > 0

    def lead_round(self, run: Callable[[], RoundOutcome], tensors: list[Tensor]) -> RoundOutcome:
        """``run()`` on rank 0 and its outcome on every rank (``on_leader``), with its averaged
        ``tensors`` (committed past genesis) and healed state (raw tensor bytes, not pickled)."""
        if self.size == 1:
            return run()
        sent: list[Any] = [None, []]  # rank 0's outcome and its heal tensors

        def lead() -> tuple[RoundOutcome, bytes]:
            outcome = sent[0] = run()
            if outcome.healed is None:
                return outcome, b""
            header, sent[1] = encode_tree(outcome.healed)
            return replace(outcome, healed=None), header

        outcome, header = self.on_leader(lead, (RoundOutcome(), b""))
        if header:
            heal_tensors = sent[1] if self.is_leader else receive_buffers(header)
            for t in heal_tensors:
                self._broadcast(t)
            outcome.healed = sent[0].healed if self.is_leader else decode_tree(header, heal_tensors)
        if outcome.committed and not outcome.genesis:
            for t in tensors:
                self._broadcast(t)
        return outcome
