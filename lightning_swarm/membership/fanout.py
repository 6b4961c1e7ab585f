"""The membership's collectives inside one island: rank 0's fan-out, and the ranks' agreements.

``IslandFanout`` broadcasts what rank 0 learnt from torchft (error, the round's opening, commit
verdict, averaged tensors, healed state); with a Manager per rank, ``all_true``, ``agree_round`` and
``share_text`` make the ranks end a round alike. The group is gloo, created beside an NCCL
island group and destroyed in ``close``. Every call is collective over the island; with one
rank it returns its input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.membership.errors import MembershipError
from lightning_swarm.membership.state_wire import byte_size, decode_tree, encode_tree, tensor_specs
from lightning_swarm.transport.agree import Gather, agree, objects_over
from lightning_swarm.transport.base import Opening, RoundPlace

T = TypeVar("T")


@dataclass
class RoundOutcome:
    """One round as the rank that ran it saw it (the island's rank 0, or each rank per rank)."""

    committed: bool = False
    genesis: bool = False
    participants: int = 0
    healed: dict[str, Any] | None = None
    heal_bytes: int = 0
    heal_s: float = 0.0


class IslandFanout:
    """The membership's collectives over one island: rank 0's fan-out, the ranks' agreements
    (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, side_group: bool | None = None) -> None:
        """``side_group``: create a gloo group beside ``group``; ``None`` decides by its backend
        (anything but gloo needs one)."""
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
        """Destroy the gloo group created beside the island's own (if any). Idempotent."""
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

    def _share_numbers(self, values: list[Any], dtype: torch.dtype) -> list[Any]:
        """Rank 0's ``values`` on every rank (the others pass as many placeholders)."""
        row = torch.tensor(values, dtype=dtype)
        self._broadcast(row)
        return row.tolist()

    def _share_bytes(self, data: bytes, length: int) -> bytes:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_leader else None
        buf = buf if buf is not None else torch.empty(length, dtype=torch.uint8)
        self._broadcast(buf)
        return buf.numpy().tobytes()

    def share_error(self, error: MembershipError | None) -> None:
        """Raise rank 0's error (or none) on every rank of the island (``transport.agree``:
        an error on another rank is raised alike, the lowest rank's first)."""
        agree(gather=self._gather(), error=error)

    def on_leader(self, run: Callable[[], T], default: T) -> T:
        """``run()`` on rank 0, ``default`` on the other ranks; a ``MembershipError`` it raises
        is raised on every rank (collective)."""
        result, error = default, None
        if self.is_leader:
            try:
                result = run()
            except MembershipError as err:
                error = err
        self.share_error(error)
        return result

    def share_opening(self, opening: Opening) -> Opening:
        """Rank 0's ``opening`` on every rank of the island (collective)."""
        if self.size == 1:
            return opening
        place = (0, 0, 0) if opening.adopt is None else astuple(opening.adopt)
        steps = -1 if opening.swarm_steps is None else opening.swarm_steps
        # float64: the scale as rank 0 computed it; the counts are exact below 2**53.
        values = self._share_numbers(
            [int(opening.adopt is not None), *place, int(opening.abandon), steps, opening.scale],
            torch.float64,
        )
        adopted, fragment, send_step, apply_step, abandon, steps = (int(v) for v in values[:6])
        adopt = RoundPlace(fragment, send_step, apply_step) if adopted else None
        return Opening(
            adopt=adopt,
            abandon=bool(abandon),
            scale=values[6],
            swarm_steps=None if steps < 0 else steps,
        )

    def share_text(self, text: str) -> str:
        """Rank 0's ``text`` on every rank of the island (e.g. its store address)."""
        if self.size == 1:
            return text
        data = text.encode() if self.is_leader else b""
        (length,) = self._share_numbers([len(data)], torch.int64)
        return self._share_bytes(data, length).decode()

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of the island (collective)."""
        if self.size == 1:
            return flag
        value = torch.tensor([0 if flag else 1], dtype=torch.int64)
        dist.all_reduce(value, group=self.group)
        return int(value.item()) == 0

    def agree_round(
        self, error: MembershipError | None, committed: bool, healed: bool
    ) -> tuple[bool, bool]:
        """End a round alike on every rank of an island whose ranks each ran it.

        Returns (every rank committed, some rank was healed). Raises the error of the lowest
        rank that has one, on every rank (collective).
        """
        agreed = agree(gather=self._gather(), error=error, values=(committed, healed))
        return agreed.sums[0] == self.size, agreed.sums[1] > 0

    def _gather(self) -> Gather:
        """Every rank's outcome over the island's gloo group; with one rank, its own."""
        return objects_over(self.group) if self.size > 1 else lambda outcome: [outcome]

    def share_outcome(self, outcome: RoundOutcome, tensors: list[Tensor]) -> RoundOutcome:
        """Rank 0's outcome on every rank, with its averaged ``tensors`` and healed state."""
        if self.size == 1:
            return outcome
        header, heal_tensors = (
            encode_tree(outcome.healed) if outcome.healed is not None else (b"", [])
        )
        status = [outcome.committed, outcome.genesis, outcome.participants, len(header)]
        status += [outcome.heal_bytes, int(outcome.heal_s * 1e6)]
        committed, genesis, participants, header_len, heal_bytes, heal_us = self._share_numbers(
            [int(v) for v in status], torch.int64
        )
        shared = RoundOutcome(bool(committed), bool(genesis), participants, None, heal_bytes)
        shared.heal_s = heal_us / 1e6
        if header_len:
            header = self._share_bytes(header, header_len)
            if not self.is_leader:
                heal_tensors = [
                    torch.empty(byte_size(d, s), dtype=torch.uint8) for d, s in tensor_specs(header)
                ]
            for t in heal_tensors:
                self._broadcast(t)
            shared.healed = outcome.healed if self.is_leader else decode_tree(header, heal_tensors)
        if shared.committed and not shared.genesis:
            for t in tensors:
                self._broadcast(t)
        return shared
