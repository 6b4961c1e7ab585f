"""The mean of a round's pseudo-gradients over the quorum, bucket by bucket.

``bucketed_mean`` packs the tensors into one reused float32 CPU bucket of at most
``bucket_numel`` elements, averages each full bucket with torchft's ``Manager.allreduce`` and
writes the result back into the tensors' own storage. ``Manager.allreduce`` averages over the
participating islands, zeroes the share of an island being healed, and records a failure (a
dead peer) for the commit gate instead of raising, so a failed bucket leaves garbage that the
abandoned round never applies. Tensors may live on any device (copies cross it); the bucket is
the only extra memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def bucketed_mean(manager: Any, tensors: list[Tensor], bucket_numel: int) -> None:
    """Overwrite ``tensors`` in place with their mean over the quorum (see the module)."""
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(min(bucket_numel, max(total, 1)))
    pieces: list[tuple[Tensor, int]] = []
    fill = 0
    for t in tensors:
        view, pos = t.view(-1), 0
        while pos < view.numel():
            n = min(view.numel() - pos, flat.numel() - fill)
            flat[fill : fill + n].copy_(view[pos : pos + n])
            pieces.append((view[pos : pos + n], fill))
            fill, pos = fill + n, pos + n
            if fill == flat.numel():
                _reduce_bucket(manager, flat[:fill], pieces)
                pieces, fill = [], 0
    if fill:
        _reduce_bucket(manager, flat[:fill], pieces)


def _reduce_bucket(manager: Any, bucket: Tensor, pieces: list[tuple[Tensor, int]]) -> None:
    manager.allreduce(bucket).wait()
    for piece, offset in pieces:
        piece.copy_(bucket[offset : offset + piece.numel()])
