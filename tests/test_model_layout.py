"""The one model layout: what the checkpoint's fingerprint records and the round header hashes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from lightning_swarm.algorithm.model_layout import (
    ParamLayout,
    describe_difference,
    fingerprint,
    hash63,
    model_layout,
)
from lightning_swarm.membership.state_wire import decode_tree, encode_tree
from lightning_swarm.resume.compatibility import layout_record
from tests.dist_utils import run_ranks


def _layout(dtype: torch.dtype = torch.float32, **shapes: tuple[int, ...]) -> dict:
    shapes = shapes or {"w": (4, 3), "b": (3,)}
    return model_layout({k: torch.empty(s, dtype=dtype, device="meta") for k, s in shapes.items()})


def test_equal_layouts_have_one_fingerprint_in_any_order() -> None:
    layout = _layout()
    whole = {"w": ParamLayout((4, 3), "float32", (0, 0), (4, 3))}
    assert layout == {**whole, "b": ParamLayout((3,), "float32", (0,), (3,))}
    assert all(entry.whole for entry in layout.values())
    assert _layout() == layout
    assert fingerprint(_layout()) == fingerprint(layout)
    assert fingerprint(_layout(b=(3,), w=(4, 3))) == fingerprint(layout)


def test_fingerprint_changes_with_a_shape_a_name_or_a_dtype() -> None:
    base = fingerprint(_layout())
    assert fingerprint(_layout(w=(3, 4), b=(3,))) != base
    assert fingerprint(_layout(w=(4, 3), bias=(3,))) != base
    assert fingerprint(_layout(torch.bfloat16)) != base


def test_fingerprint_is_the_hash_of_the_sorted_name_shape_dtype_text() -> None:
    # The value a round header carries (islands compare it): sha256 of the sorted
    # (name, "shape dtype") pairs as JSON, its first 8 bytes little-endian, top bit cleared.
    text = json.dumps([["b", "(3,) float32"], ["w", "(4, 3) float32"]])
    digest = hashlib.sha256(text.encode()).digest()
    assert fingerprint(_layout()) == int.from_bytes(digest[:8], "little") & (2**63 - 1)


def test_the_round_headers_hashes_are_the_one_hash63() -> None:
    # One fold of sha256 into 63 bits for the model's fingerprint, the island id and the
    # settings (one masked it, the other shifted it: different values for the same bytes).
    from lightning_swarm.membership.round_header import HeaderRow, encode_settings, island_hash

    digest = hashlib.sha256(b"island-a").digest()
    assert hash63(b"island-a") == int.from_bytes(digest[:8], "little") & (2**63 - 1)
    assert island_hash("island-a") == hash63(b"island-a")
    row = HeaderRow(island=0, model=0, healing=0, joined_ns=0, nonce=0, finite=1)
    settings = {"sync_every": 4, "outer_optimizer.lr": 0.7}
    row.set_settings(settings)
    assert row.settings == hash63(encode_settings(settings))
    assert all(0 <= h < 2**63 for h in (row.settings, island_hash("island-a")))


def _sharded_layout(rank: int, world: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    w = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)])  # 3 + 2 rows: uneven
    b = distribute_tensor(torch.zeros(1), mesh, [Shard(0)])  # 1 + 0: an empty shard
    torch.save(model_layout({"w": w, "b": b}), out / f"{rank}.pt")


def test_a_dtensors_layout_is_its_global_shape_and_this_ranks_slice(tmp_path: Path) -> None:
    run_ranks(_sharded_layout, 2, tmp_path, timeout_s=60)
    first, second = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1))
    assert first["w"] == ParamLayout((5, 3), "float32", (0, 0), (3, 3))
    assert second["w"] == ParamLayout((5, 3), "float32", (3, 0), (2, 3))
    assert first["b"].slice == ((0,), (1,)) and second["b"].local_shape == (0,)
    assert (
        not first["w"].whole and str(first["w"]) == "(5, 3) float32 (this rank: (3, 3) at (0, 0))"
    )
    # The model is the same on both ranks; the slices (what paired ranks must share) are not.
    assert fingerprint(first) == fingerprint(second)
    assert fingerprint(first, placement=True) != fingerprint(second, placement=True)
    assert describe_difference(first, second, here="on rank 0", there="on rank 1").startswith(
        "w is (5, 3) float32 (this rank: (3, 3) at (0, 0)) on rank 0 but (5, 3) float32 (this "
        "rank: (2, 3) at (3, 0)) on rank 1"
    )


def test_checkpoint_records_names_and_shapes_of_the_layout_without_dtypes() -> None:
    record = layout_record(2, [_layout()], None)
    assert record == {"num_islands": 2, "params": [[["w", [4, 3]], ["b", [3]]]], "fragments": None}
    assert layout_record(2, [_layout(torch.bfloat16)], None) == record
    assert layout_record(2, [_layout(w=(4, 4), b=(3,))], None) != record


def test_layout_crosses_the_heal_wire_and_still_compares_equal() -> None:
    layout = _layout()
    header, tensors = encode_tree({"layout": layout})
    received = decode_tree(header, tensors)["layout"]
    assert received == layout
    other = dict(received, w=((4, 4), "float32"))
    assert describe_difference(layout, other) == (
        "w is (4, 3) float32 here but (4, 4) float32 in the swarm"
    )
