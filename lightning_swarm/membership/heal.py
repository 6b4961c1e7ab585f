"""Healing over the process group: torchft's checkpoint transport, without pickle.

torchft's own heal transports pickle or ship ``torch.save`` bytes; ``TensorHealTransport`` sends a
JSON header (``state_wire``) and raw tensor bytes instead. The sender's state is read while its
training thread waits for the quorum, so it does not change during the send; received tensors are
fresh CPU tensors owned by the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport
from torchft.process_group import ProcessGroup

from lightning_swarm.membership.state_wire import byte_size, decode_tree, encode_tree, tensor_specs

_TAG_LENGTH, _TAG_HEADER, _TAG_FIRST_TENSOR = 1, 2, 3


class TensorHealTransport(CheckpointTransport[Any]):
    """Moves a state tree between islands as a JSON header plus tensors over ``pg``.

    The length and header wait the ``timeout`` torchft passes; the tensors wait
    ``timeout_for(their bytes)`` when the owner set it (a bound that grows with the state),
    else torchft's too.
    """

    def __init__(self, pg: ProcessGroup, on_phase: Callable[[str], None]) -> None:
        self._pg = pg
        # The membership's fault hook (tests): "heal_send" / "heal_recv" after the header.
        self._on_phase = on_phase
        self.timeout_for: Callable[[int], timedelta] | None = None
        self.last_heal_bytes = 0
        self.last_heal_s = 0.0

    def _tensor_timeout(self, nbytes: int, timeout: timedelta) -> timedelta:
        return timeout if self.timeout_for is None else self.timeout_for(nbytes)

    def metadata(self) -> str:
        return "lightning_swarm-tensor-heal"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        header, tensors = encode_tree({"step": step, "state": state_dict})
        length = torch.tensor([len(header)], dtype=torch.int64)
        header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        for dst in dst_ranks:
            works = [
                self._pg.send([length], dst, tag=_TAG_LENGTH),
                self._pg.send([header_t], dst, tag=_TAG_HEADER),
            ]
            self._on_phase("heal_send")
            works += [
                self._pg.send([t], dst, tag=_TAG_FIRST_TENSOR + i)
                for i, t in enumerate(tensors)
                if t.numel()
            ]
            wait = self._tensor_timeout(sum(t.numel() for t in tensors), timeout)  # uint8
            for work in works:
                work.wait(wait)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        start = time.perf_counter()
        length = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([length], src_rank, tag=_TAG_LENGTH).wait(timeout)
        if not 0 < int(length.item()) < 1 << 31:
            raise ValueError(f"a healing peer announced a header of {int(length.item())} B")
        header_t = torch.empty(int(length.item()), dtype=torch.uint8)
        self._pg.recv([header_t], src_rank, tag=_TAG_HEADER).wait(timeout)
        header = header_t.numpy().tobytes()
        self._on_phase("heal_recv")
        payload = [torch.empty(byte_size(d, s), dtype=torch.uint8) for d, s in tensor_specs(header)]
        works = [
            self._pg.recv([t], src_rank, tag=_TAG_FIRST_TENSOR + i)
            for i, t in enumerate(payload)
            if t.numel()
        ]
        wait = self._tensor_timeout(sum(t.numel() for t in payload), timeout)
        for work in works:
            work.wait(wait)
        tree = decode_tree(header, payload)
        if not isinstance(tree, dict) or tree.get("step") != step:
            raise ValueError(f"a healing peer sent the state of another step (expected {step})")
        self.last_heal_bytes = sum(t.numel() for t in payload)
        self.last_heal_s = time.perf_counter() - start
        return tree["state"]
