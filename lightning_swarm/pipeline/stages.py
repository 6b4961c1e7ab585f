"""Splitting a module into pipeline stages in ``configure_model``: each rank keeps its stage.

``keep_stage`` is what a LightningModule's ``configure_model`` calls when its island has a
``pipeline_parallel`` mesh dimension (``pipeline_parallel_size > 1``). Blocks are dealt out in
contiguous runs, as evenly as the count allows (the first stages take one more when it does not
divide). A block another stage holds is removed without renaming the rest: in a ``ModuleList``
or ``Sequential`` it becomes a parameter-free ``nn.Identity`` (``for block in self.blocks:
x = block(x)`` passes through it), in a ``ModuleDict`` its key goes. Every kept parameter
keeps its global name (``blocks.5.attn.weight`` on stage 1 is block 5 of the whole model),
which is what pairs a rank with its counterparts in other islands, what checkpoints record and
what an export joins.
Modules only the first (embeddings) or last (final norm, head) stage runs are set to ``None``
elsewhere; the module's ``forward`` skips a ``None`` module, as torchtitan's models do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_swarm.errors import SwarmConfigError


def stage_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """The block indices of every stage: contiguous, sizes differing by at most one.

    Raises:
        SwarmConfigError: more stages than blocks.
    """
    if num_stages > num_blocks:
        raise SwarmConfigError(
            f"pipeline_parallel_size={num_stages} stages for a model of {num_blocks} block(s): "
            "every stage needs at least one block. Lower pipeline_parallel_size to at most "
            f"{num_blocks}, or split the model into more blocks."
        )
    base, extra = divmod(num_blocks, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (1 if stage < extra else 0)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def keep_stage(
    module: nn.Module,
    mesh: Any,
    *,
    blocks: str = "blocks",
    first: Sequence[str] = (),
    last: Sequence[str] = (),
) -> range:
    """Keep this rank's pipeline stage of ``module`` and drop the rest (in place); returns the
    global indices of the blocks kept.

    Args:
        module: the model (the LightningModule or a submodule of it).
        mesh: the island's device mesh (``self.device_mesh``): its ``pipeline_parallel``
            dimension gives the stage; a mesh without one keeps everything.
        blocks: the attribute holding the blocks, a ``ModuleList``, ``Sequential`` or
            ``ModuleDict``.
        first: attributes only the first stage runs (embeddings); ``None`` on the others.
        last: attributes only the last stage runs (final norm, head); ``None`` on the others.

    Raises:
        SwarmConfigError: more stages than blocks, or ``blocks`` is not a ``ModuleList`` or
            ``ModuleDict``.
    """
    container = getattr(module, blocks, None)
    if not isinstance(container, nn.ModuleList | nn.ModuleDict | nn.Sequential):
        raise SwarmConfigError(
            f"keep_stage(blocks={blocks!r}): {type(module).__name__}.{blocks} is a "
            f"{type(container).__name__}, not a ModuleList, Sequential or ModuleDict; pass the "
            "attribute "
            "holding the model's repeated blocks."
        )
    names = list(getattr(mesh, "mesh_dim_names", None) or ())
    if "pipeline_parallel" not in names:
        return range(len(container))
    stages = mesh["pipeline_parallel"]
    stage, num_stages = stages.get_local_rank(), stages.size()
    mine = stage_blocks(len(container), num_stages)[stage]
    if isinstance(container, nn.ModuleList | nn.Sequential):
        for index in range(len(container)):
            if index not in mine:
                container[index] = nn.Identity()
    else:
        for index, key in enumerate(list(container.keys())):
            if index not in mine:
                del container[key]
    for attribute in first if stage != 0 else ():
        setattr(module, attribute, None)
    for attribute in last if stage != num_stages - 1 else ():
        setattr(module, attribute, None)
    return mine
