"""The one model layout: what the checkpoint's fingerprint records and the round header hashes."""

from __future__ import annotations

import hashlib
import json

import torch

from lightning_swarm.algorithm.model_layout import (
    ParamLayout,
    describe_difference,
    fingerprint,
    hash63,
    model_layout,
)
from lightning_swarm.membership.state_wire import decode_tree, encode_tree
from lightning_swarm.resume.compatibility import layout_fingerprint


def _layout(dtype: torch.dtype = torch.float32, **shapes: tuple[int, ...]) -> dict:
    shapes = shapes or {"w": (4, 3), "b": (3,)}
    return model_layout({k: torch.empty(s, dtype=dtype, device="meta") for k, s in shapes.items()})


def test_equal_layouts_have_one_fingerprint_in_any_order() -> None:
    layout = _layout()
    assert layout == {"w": ParamLayout((4, 3), "float32"), "b": ParamLayout((3,), "float32")}
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


def test_global_shapes_describe_local_shards() -> None:
    shard = {"w": torch.empty(2, 3, device="meta"), "b": torch.empty(3, device="meta")}
    assert model_layout(shard, {"w": (4, 3)}) == _layout()


def test_checkpoint_records_names_and_shapes_of_the_layout_without_dtypes() -> None:
    record = layout_fingerprint(2, [_layout()], None)
    assert record == {"num_islands": 2, "params": [[["w", [4, 3]], ["b", [3]]]], "fragments": None}
    assert layout_fingerprint(2, [_layout(torch.bfloat16)], None) == record
    assert layout_fingerprint(2, [_layout(w=(4, 4), b=(3,))], None) != record


def test_layout_crosses_the_heal_wire_and_still_compares_equal() -> None:
    layout = _layout()
    header, tensors = encode_tree({"layout": layout})
    received = decode_tree(header, tensors)["layout"]
    assert received == layout
    other = dict(received, w=((4, 4), "float32"))
    assert describe_difference(layout, other) == (
        "w is (4, 3) float32 here but (4, 4) float32 in the swarm"
    )
