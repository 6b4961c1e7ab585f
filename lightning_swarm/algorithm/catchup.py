"""Catch-up: rebase an island that resumes from an older round onto the newest anchors.

An island whose saved state is from round r_old while its peers' is from r_new > r_old holds
``local`` = its own anchor at r_old plus the progress of its inner steps since. Throwing that
progress away (local <- global_new) wastes the island's work; keeping ``local`` as is would drag
the newest anchors back towards round r_old at the next sync. Catch-up keeps the progress and
moves its base::

    local <- global_new + (local - anchor_old)

Computed in float32 whatever the parameter and anchor dtypes (as the pseudo-gradient is), then
stored in ``local``'s dtype. Pure torch; no argument is modified except ``local``.
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
