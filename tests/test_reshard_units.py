"""The cutting under a resume onto another layout (``resume.reshard``): views where a slice lies
in one saved tensor, copies into a file-backed scratch otherwise, named errors for gaps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_swarm.algorithm.model_layout import ParamLayout
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.global_model import Pieces
from lightning_swarm.resume.reshard import Cuts, Scratch, needs_reshard

WHOLE = torch.arange(7 * 4, dtype=torch.float32).reshape(7, 4)


def _rows(*bounds: tuple[int, int]) -> Pieces:
    """``WHOLE`` saved as row slices (as FSDP2 shards it), each a tensor of its own."""
    pieces = Pieces((7, 4), torch.float32)
    for start, stop in bounds:
        pieces.slices.append(((start, 0), WHOLE[start:stop].clone(), f"rank-{start}.pt"))
    return pieces


def _part(start: int, rows: int) -> ParamLayout:
    return ParamLayout((7, 4), "float32", (start, 0), (rows, 4))


def test_a_slice_inside_one_saved_tensor_is_a_view_of_it(tmp_path: Path) -> None:
    pieces = _rows((0, 4), (4, 7))
    cuts = Cuts()
    cuts.add("w", pieces, _part(4, 2))
    out, copied, _ = cuts.cut(str, tmp_path)
    assert copied == 0
    assert torch.equal(out["w"], WHOLE[4:6])
    assert out["w"].untyped_storage().data_ptr() == pieces.slices[1][1].untyped_storage().data_ptr()


def test_a_straddling_slice_is_copied_into_a_file_backed_scratch(tmp_path: Path) -> None:
    cuts = Cuts()
    cuts.add("straddles", _rows((0, 4), (4, 7)), _part(2, 4))  # rows 2-5: both saved tensors
    cuts.add("whole", _rows((0, 4), (4, 7)), ParamLayout((7, 4), "float32"))
    out, copied, file_backed = cuts.cut(str, tmp_path)
    assert file_backed and copied == Scratch.size_of((4, 4), torch.float32) + Scratch.size_of(
        (7, 4), torch.float32
    )
    assert torch.equal(out["straddles"], WHOLE[2:6]) and torch.equal(out["whole"], WHOLE)
    assert os.listdir(tmp_path) == []  # the scratch file was unlinked once mapped


def test_without_a_writable_directory_the_copies_go_to_memory(tmp_path: Path) -> None:
    cuts = Cuts()
    cuts.add("w", _rows((0, 4), (4, 7)), _part(2, 4))
    out, copied, file_backed = cuts.cut(str, tmp_path / "missing")
    assert copied and not file_backed
    assert torch.equal(out["w"], WHOLE[2:6])


def test_a_gap_in_the_saved_slices_is_named_with_the_files(tmp_path: Path) -> None:
    cuts = Cuts()
    cuts.add("w", _rows((0, 3), (5, 7)), _part(2, 4))  # rows 3-4 are in no saved file
    with pytest.raises(
        SwarmCheckpointError,
        match=r"hold 8 of the 16 elements wanted.*rank-0\.pt.*resume on the layout",
    ):
        cuts.cut(str, tmp_path)


def test_a_move_is_a_change_of_island_count_or_mesh() -> None:
    ddp = {"num_islands": 2, "params": []}
    assert not needs_reshard(ddp, dict(ddp))
    assert needs_reshard(ddp, {**ddp, "num_islands": 3})
    fsdp = {**ddp, "island_mesh": {"data_parallel": 2, "tensor_parallel": 1}}
    assert needs_reshard(ddp, fsdp) and needs_reshard(fsdp, ddp)
    tp = {**ddp, "island_mesh": {"data_parallel": 1, "tensor_parallel": 2}}
    assert needs_reshard(fsdp, tp) and not needs_reshard(tp, dict(tp))
