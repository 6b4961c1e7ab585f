"""Catch-up: rebase an island that resumes from an older round onto the newest anchors.

``local <- global_new + (local - anchor_old)`` keeps the island's progress since its old anchor
without dragging the new anchors back towards the old round. Computed in float32, stored in
``local``'s dtype; only ``local`` is modified.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def catch_up_(local: Tensor, anchor_old: Tensor, global_new: Tensor) -> None:
    """Overwrite ``local`` in place with ``global_new + (local - anchor_old)``.

    Raises:
        ValueError: the three tensors do not share one shape.
    """
    if not local.shape == anchor_old.shape == global_new.shape:
        raise ValueError(
            f"catch-up needs one shape, got local {tuple(local.shape)}, old anchor "
            f"{tuple(anchor_old.shape)}, new anchor {tuple(global_new.shape)}"
        )
    progress = local.to(torch.float32) - anchor_old.to(device=local.device, dtype=torch.float32)
    progress += global_new.to(device=local.device, dtype=torch.float32)
    local.copy_(progress)
