"""Checkpoints of a sharded outer loop: one anchor shard per rank of island 0, re-sharded by name.

2 islands of 2 ranks (4 processes, fork, gloo), checkpoints after every step. A resume with
sharding off reads every shard and must continue bitwise like the sharded run (with 2 islands
a sum of two contributions does not depend on how the buckets were packed); a resume onto
islands of one rank must start from exactly the saved anchors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_swarm.checkpoint import ANCHORS_FILE
from tests.resume_utils import fit, flip_bit_in_tensor_data, load_ranks, swarm_dir

MAX_STEPS = 7


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    fit(root / "out", devices=4, island_size=2, max_steps=MAX_STEPS, ckpt_dir=root / "ckpts")
    return root


def _ckpt(root: Path, step: int) -> Path:
    return root / "ckpts" / f"step={step}.ckpt"


def _saved_anchors(ckpt: Path) -> dict[str, torch.Tensor]:
    anchors: dict[str, torch.Tensor] = {}
    for shard in sorted(swarm_dir(ckpt).glob("anchors-rank-*.pt")):
        anchors.update(torch.load(shard, weights_only=True)["outer"][0]["anchors"])
    return anchors


def test_lightning_run_sharded_equals_unsharded(sharded_run: Path, tmp_path: Path) -> None:
    fit(tmp_path, devices=4, island_size=2, max_steps=MAX_STEPS, shard_outer=False)
    sharded, full = load_ranks(sharded_run / "out", 4), load_ranks(tmp_path, 4)
    for rank in range(4):
        assert sharded[rank]["outer_steps"] == full[rank]["outer_steps"] == [3]
        for name, p in full[rank]["params"].items():
            assert torch.equal(p, sharded[rank]["params"][name]), (rank, name)
        assert 0 < len(sharded[rank]["anchors"][0]) < len(full[rank]["anchors"][0])
        for name, anchor in sharded[rank]["anchors"][0].items():
            assert torch.equal(anchor, full[rank]["anchors"][0][name]), (rank, name)


def test_each_rank_of_island_0_writes_its_share_with_a_checksum(sharded_run: Path) -> None:
    ckpt = _ckpt(sharded_run, 4)
    directory = swarm_dir(ckpt)
    shards = sorted(p.name for p in directory.glob("anchors-rank-*.pt"))
    assert shards == ["anchors-rank-00000.pt", "anchors-rank-00001.pt"]
    assert not (directory / ANCHORS_FILE).exists()
    files = torch.load(ckpt, weights_only=True)["swarm"]["files"]
    assert set(shards) <= set(files)
    held = [
        set(torch.load(directory / s, weights_only=True)["outer"][0]["anchors"]) for s in shards
    ]
    assert held[0].isdisjoint(held[1]) and held[0] and held[1]
    final = load_ranks(sharded_run / "out", 4)
    assert set(final[0]["anchors"][0]) == held[0] and set(final[1]["anchors"][0]) == held[1]


@pytest.mark.parametrize("step", [3, 4])
def test_resume_with_sharding_off_continues_bitwise(
    sharded_run: Path, tmp_path: Path, step: int
) -> None:
    fit(
        tmp_path,
        devices=4,
        island_size=2,
        max_steps=MAX_STEPS,
        ckpt_path=_ckpt(sharded_run, step),
        shard_outer=False,
    )
    full, resumed = load_ranks(sharded_run / "out", 4), load_ranks(tmp_path, 4)
    for rank in range(4):
        for name, p in full[rank]["params"].items():
            assert torch.equal(p, resumed[rank]["params"][name]), (step, rank, name)
        assert set(resumed[rank]["anchors"][0]) == set(full[0]["params"])  # every anchor again
        for name, anchor in full[rank]["anchors"][0].items():
            assert torch.equal(anchor, resumed[rank]["anchors"][0][name]), (step, rank, name)
        assert resumed[rank]["outer_steps"] == full[rank]["outer_steps"]


def test_resume_onto_islands_of_one_rank_starts_from_the_saved_anchors(
    sharded_run: Path, tmp_path: Path
) -> None:
    ckpt = _ckpt(sharded_run, 4)
    fit(tmp_path, devices=2, island_size=1, max_steps=5, ckpt_path=ckpt)
    saved = _saved_anchors(ckpt)
    for info in load_ranks(tmp_path, 2):
        start = info["start_anchors"][0]
        assert set(start) == set(saved)
        assert all(torch.equal(start[n], saved[n]) for n in saved)


@pytest.fixture(scope="module")
def feedback_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("feedback")
    fit(
        root / "out",
        devices=4,
        island_size=2,
        max_steps=MAX_STEPS,
        ckpt_dir=root / "ckpts",
        quantize="int4",
        quantize_block_size=8,
        error_feedback=True,
    )
    return root


def test_error_feedback_residuals_of_every_share_resume_bitwise(
    feedback_run: Path, tmp_path: Path
) -> None:
    ckpt = _ckpt(feedback_run, 4)
    island = torch.load(swarm_dir(ckpt) / "island-00001.pt", weights_only=True)
    names = set(load_ranks(feedback_run / "out", 4)[0]["params"])
    assert set(island["outer_island"][0]["residuals"]) == names  # both shares' residuals
    fit(
        tmp_path,
        devices=4,
        island_size=2,
        max_steps=MAX_STEPS,
        ckpt_path=ckpt,
        quantize="int4",
        quantize_block_size=8,
        error_feedback=True,
    )
    full, resumed = load_ranks(feedback_run / "out", 4), load_ranks(tmp_path, 4)
    for rank in range(4):
        for name, p in full[rank]["params"].items():
            assert torch.equal(p, resumed[rank]["params"][name]), (rank, name)
        for name, anchor in full[rank]["anchors"][0].items():
            assert torch.equal(anchor, resumed[rank]["anchors"][0][name]), (rank, name)


def test_flipped_bit_in_an_anchor_shard_is_detected(sharded_run: Path, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(sharded_run / "ckpts", root / "ckpts")
    ckpt = _ckpt(root, 4)
    flip_bit_in_tensor_data(swarm_dir(ckpt) / "anchors-rank-00001.pt")
    with pytest.raises(Exception, match=r"anchors-rank-00001.pt: checksum mismatch"):
        fit(tmp_path / "out", devices=4, island_size=2, max_steps=MAX_STEPS, ckpt_path=ckpt)
    assert not (tmp_path / "out").exists()
