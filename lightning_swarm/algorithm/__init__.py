"""The DiLoCo math: pure functions over tensors, importing neither lightning nor
torch.distributed. Transport and Lightning glue call into it; nothing here communicates."""

from lightning_swarm.algorithm.diloco import (
    global_norm,
    merge_into_local,
    outer_step,
    pseudo_gradient,
)

__all__ = ["global_norm", "merge_into_local", "outer_step", "pseudo_gradient"]
