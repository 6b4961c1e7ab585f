"""The sharded outer loop: each of an island's k ranks owns a share of the anchors and state.

Position j of every island owns the same names (``partition_by_bytes``), so its peer group
exchanges exactly that share; after a round the owners broadcast their new parameters to the
island (``IslandShard.gather``), and the island agrees on the verdict and norm (``agree``).
``IslandShard`` owns no tensors; the gather's buckets are temporaries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.outer.errors import ShareFailedError
from lightning_swarm.transport.buckets import Piece, placed, plan_buckets


def partition_by_bytes(
    fragments: Sequence[Sequence[str]], sizes: Mapping[str, int], num_shards: int
) -> dict[str, int]:
    """The owner (0 .. num_shards - 1) of every name, balanced by bytes within each fragment
    (greedy, largest first); deterministic from names and sizes alone."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    owner: dict[str, int] = {}
    total = [0] * num_shards
    for names in fragments:
        load = [0] * num_shards
        order = sorted(range(len(names)), key=lambda i: (-sizes[names[i]], i))
        for i in order:
            shard = min(range(num_shards), key=lambda s: (load[s], total[s], s))
            owner[names[i]] = shard
            load[shard] += sizes[names[i]]
            total[shard] += sizes[names[i]]
    return owner


@dataclass(frozen=True)
class IslandShard:
    """This rank's place in its island's sharded outer loop; ``owner`` maps every trained
    name to the position that owns its anchor, ``device`` holds the agreement's small tensor."""

    group: dist.ProcessGroup
    position: int
    size: int
    owner: Mapping[str, int]
    bucket_numel: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def owns(self, name: str) -> bool:
        return self.owner[name] == self.position

    @torch.no_grad()
    def gather(self, names: Sequence[str], params: Mapping[str, Tensor]) -> None:
        """Every owner broadcasts its ``names``' parameters to the island (collective), in
        buckets of one dtype, two in flight; a one-piece bucket travels in place."""
        with record_function(labels.ISLAND_GATHER):
            in_flight: list[tuple[list[Tensor], list[Piece], Tensor, Any]] = []
            copies: list[tuple[Tensor, Tensor]] = []
            for position in range(self.size):
                mine = [params[n].data for n in names if self.owner[n] == position]
                runs, run_copies = _flat_runs(mine)
                copies += run_copies
                for flats in runs:
                    for bucket in plan_buckets([f.numel() for f in flats], self.bucket_numel):
                        # Two buckets in flight: the next one is packed while one travels.
                        if len(in_flight) == 2:
                            _finish_broadcast(*in_flight.pop(0))
                        in_flight.append(_start_broadcast(flats, bucket, self.group, position))
            for item in in_flight:
                _finish_broadcast(*item)
            for tensor, flat in copies:  # a non-contiguous parameter received into a copy
                tensor.copy_(flat.view_as(tensor))

    def agree(
        self, applied: bool, norm: float, error: BaseException | None = None
    ) -> tuple[bool, float]:
        """The island-wide verdict (every share applied) and norm (collective).

        Raises:
            BaseException: ``error`` on the rank whose share failed, and ``ShareFailedError``
                on the others, so that no rank goes on to a gather its island never joins.
        """
        flags = torch.tensor(
            [0.0 if applied else 1.0, norm * norm, 0.0 if error is None else 1.0],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(flags, group=self.group)
        if error is not None:
            raise error
        if flags[2].item() > 0:
            raise ShareFailedError(
                "another rank of this island failed its share of the outer round (its own "
                "error names the cause); the round was not applied on this island."
            )
        return bool(flags[0].item() == 0.0), float(flags[1].sqrt().item())

    @staticmethod
    def device_for(group: dist.ProcessGroup, device: torch.device | None) -> torch.device:
        """The device a collective on ``group`` needs for its small tensors."""
        if dist.get_backend(group) == "nccl" and device is not None:
            return device
        return torch.device("cpu")

    def collect(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Every share's ``tensors`` on position 0, this rank's own elsewhere (collective)."""
        mine = {name: t.cpu() for name, t in tensors.items()}
        gathered: list[Any] | None = [None] * self.size if self.position == 0 else None
        dist.gather_object(mine, gathered, group=self.group, group_dst=0)
        if gathered is None:
            return dict(tensors)
        return {name: t for share in gathered for name, t in share.items()}


def _flat_runs(tensors: list[Tensor]) -> tuple[list[list[Tensor]], list[tuple[Tensor, Tensor]]]:
    """Runs of one dtype and device as flat tensors, and (tensor, flat copy) pairs of the
    non-contiguous ones, to write back afterwards."""
    runs: list[list[Tensor]] = []
    copies: list[tuple[Tensor, Tensor]] = []
    kind: tuple[torch.dtype, torch.device] | None = None
    for t in tensors:
        if (t.dtype, t.device) != kind:
            runs.append([])
            kind = (t.dtype, t.device)
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
        if not t.is_contiguous():
            copies.append((t, flat))
        runs[-1].append(flat)
    return runs, copies


def _start_broadcast(
    flats: list[Tensor], bucket: list[Piece], group: dist.ProcessGroup, position: int
) -> tuple[list[Tensor], list[Piece], Tensor, Any]:
    pieces = [_piece(flats, p) for p in bucket]
    flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    work = dist.broadcast(flat, group=group, group_src=position, async_op=True)
    return flats, bucket, flat, work


def _finish_broadcast(flats: list[Tensor], bucket: list[Piece], flat: Tensor, work: Any) -> None:
    work.wait()
    if len(bucket) == 1:
        return
    for at, p in placed(bucket):
        _piece(flats, p).copy_(flat[at : at + p.length])


def _piece(flats: list[Tensor], p: Piece) -> Tensor:
    return flats[p.tensor_index][p.start : p.stop]
