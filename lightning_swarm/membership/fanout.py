"""How an island's rank 0 hands a round's outcome to the island's other ranks.

Only rank 0 of an island talks to torchft. Its other ranks hold the same parameters and anchors
(DDP inside the island), so they need exactly what rank 0 learnt: an error, whether the round
committed, the averaged tensors, and a healed state. ``IslandFanout`` broadcasts these over a
gloo group of the island's ranks, with tensors on the CPU. In an island whose own group is NCCL
(GPUs), it creates that gloo group beside it (``dist.new_group`` is collective over the whole
world: with ``membership="torchft"`` the world is the island, so every rank creates it, in the
same place) and destroys it in ``close``; a tensor on an accelerator travels through a CPU copy.
With an island of one rank every call is a no-op that returns its input. Every rank of the
island must make the same calls in the same order; all of them are collective over the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_swarm.membership.errors import KINDS, MembershipError, kind_code
from lightning_swarm.membership.state_wire import byte_size, decode_tree, encode_tree, tensor_specs


@dataclass
class RoundOutcome:
    """One round as the island's rank 0 saw it."""

    committed: bool = False
    genesis: bool = False
    participants: int = 0
    healed: dict[str, Any] | None = None
    heal_bytes: int = 0
    heal_s: float = 0.0


class IslandFanout:
    """Collective hand-over from the island's rank 0 (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, side_group: bool | None = None) -> None:
        """``side_group``: create a gloo group beside ``group``; ``None`` decides by its backend
        (anything but gloo needs one)."""
        self.group = group
        self.size, rank = 1, 0
        if dist.is_available() and dist.is_initialized():
            self.size, rank = dist.get_world_size(group), dist.get_rank(group)
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

    def _share_bytes(self, data: bytes, length: int) -> bytes:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_leader else None
        buf = buf if buf is not None else torch.empty(length, dtype=torch.uint8)
        self._broadcast(buf)
        return buf.numpy().tobytes()

    def share_error(self, error: MembershipError | None) -> None:
        """Raise rank 0's error (or none) on every rank of the island."""
        if self.size > 1:
            message = str(error).encode() if error is not None else b""
            status = torch.tensor(
                [kind_code(error) if error is not None else 0, len(message)], dtype=torch.int64
            )
            self._broadcast(status)
            code, length = (int(v) for v in status.tolist())
            if code and not self.is_leader:
                raise KINDS[code](self._share_bytes(b"", length).decode())
            if code:
                self._share_bytes(message, length)
        if error is not None:
            raise error

    def share_outcome(self, outcome: RoundOutcome, tensors: list[Tensor]) -> RoundOutcome:
        """Rank 0's outcome on every rank, with its averaged ``tensors`` and healed state."""
        if self.size == 1:
            return outcome
        header, heal_tensors = (
            encode_tree(outcome.healed) if outcome.healed is not None else (b"", [])
        )
        status = torch.tensor(
            [
                int(outcome.committed),
                int(outcome.genesis),
                outcome.participants,
                len(header),
                outcome.heal_bytes,
                int(outcome.heal_s * 1e6),
            ],
            dtype=torch.int64,
        )
        self._broadcast(status)
        committed, genesis, participants, header_len, heal_bytes, heal_us = status.tolist()
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
