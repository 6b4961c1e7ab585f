"""Checkpoints of a sharded outer loop: one anchor shard per rank of island 0, re-sharded by name.

2 islands of 2 ranks (4 processes, fork, gloo), checkpoints after every step. A resume with
sharding off reads every shard and must continue bitwise like the sharded run (with 2 islands
a sum of two contributions does not depend on how the buckets were packed); a resume onto
islands of one rank must start from exactly the saved anchors. A behind island
(``SwarmResume(island_ckpt_paths=...)``) catches up to its peers' anchors whichever runs, sharded
or not, wrote the two checkpoints and whether the resumed run shards.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_swarm.callbacks.resume import SwarmResume
from lightning_swarm.resume.atomic import atomic_save
from lightning_swarm.resume.files import ANCHORS_FILE
from tests.resume_utils import (
    fit,
    flip_bit_in_tensor_data,
    load_ranks,
    record_file_again,
    swarm_dir,
)

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


# -- a behind island catches up (SwarmResume(island_ckpt_paths=...)) with a sharded outer loop --
# Island 1 restores its own state from step 2 (round 0, before the first sync at step 3); every
# other island restores from step 5 (round 1, between syncs). Catch-up (docs/resume.md,
# lightning_swarm/algorithm/diloco.py) must leave island 1 with
#   local = anchors(step 5) + (its local at step 2 - anchors(step 2))   (float32, per parameter)
# and the newest anchors, outer state and counters on every rank, whatever share each rank owns.
OLD_STEP, NEW_STEP = 2, 5


def _resume_behind(
    out: Path, main: Path, old: Path, *, max_steps: int = MAX_STEPS, **kw: object
) -> list[dict]:
    """Resume 2 islands of 2 ranks from ``main``, island 1 from ``old``; every rank's dump."""
    fit(
        out,
        devices=4,
        island_size=2,
        max_steps=max_steps,
        ckpt_path=main,
        callbacks=[SwarmResume(island_ckpt_paths={1: old})],
        **kw,  # type: ignore[arg-type]
    )
    return load_ranks(out, 4)


def _all_saved_anchors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every anchor a save holds: ``anchors.pt`` (unsharded) or all its rank shards."""
    anchors: dict[str, torch.Tensor] = {}
    for path in sorted(swarm_dir(ckpt).glob("anchors*.pt")):
        anchors.update(torch.load(path, weights_only=True)["outer"][0]["anchors"])
    return anchors


def _caught_up_params(old: Path, new: Path) -> dict[str, torch.Tensor]:
    """Island 1's parameters after catch-up, from the saved tensors (docs/resume.md)."""
    anchor_old, anchor_new = _all_saved_anchors(old), _all_saved_anchors(new)
    local = torch.load(swarm_dir(old) / "island-00001.pt", weights_only=True)["module"]
    assert set(anchor_old) == set(anchor_new) == set(local)
    return {name: anchor_new[name] + (local[name] - anchor_old[name]) for name in local}


def _assert_peers_share_anchors(ranks: list[dict], key: str) -> None:
    """Rank r and rank r ^ 2 (same position, other island) hold the same anchors, bitwise."""
    for rank, info in enumerate(ranks):
        mine, peer = info[key][0], ranks[rank ^ 2][key][0]
        assert mine and set(mine) == set(peer), (key, rank)
        assert all(torch.equal(a, peer[n]) for n, a in mine.items()), (key, rank)


@pytest.fixture(scope="module")
def unsharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unsharded")
    fit(
        root / "out",
        devices=4,
        island_size=2,
        max_steps=MAX_STEPS,
        ckpt_dir=root / "ckpts",
        shard_outer=False,
    )
    return root


@pytest.fixture(scope="module")
def caught_up(sharded_run: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The sharded resume with island 1 behind: the run every other variant must equal."""
    out = tmp_path_factory.mktemp("caught_up") / "out"
    return _resume_behind(out, _ckpt(sharded_run, NEW_STEP), _ckpt(sharded_run, OLD_STEP))


def test_behind_island_catches_up_to_its_peers_anchors_sharded(
    sharded_run: Path, caught_up: list[dict]
) -> None:
    old, new = _ckpt(sharded_run, OLD_STEP), _ckpt(sharded_run, NEW_STEP)
    expected = _caught_up_params(old, new)
    local_old = torch.load(swarm_dir(old) / "island-00001.pt", weights_only=True)["module"]
    local_new = [
        torch.load(swarm_dir(new) / f"island-0000{i}.pt", weights_only=True)["module"]
        for i in (0, 1)
    ]
    anchor_new = _all_saved_anchors(new)
    for rank, info in enumerate(caught_up):
        if rank >= 2:  # island 1
            assert "caught up optimizer(s) [0] to round(s) [1]" in info["summary"], info
            assert f"restored round(s) [0] at inner step(s) [{OLD_STEP}]" in info["summary"]
        else:
            assert "no catch-up needed" in info["summary"], info["summary"]
        start = expected if rank >= 2 else local_new[0]
        for name, value in info["start_params"].items():
            assert torch.equal(value, start[name]), (rank, name)
        # This rank's share of the newest anchors, sharded (both shares are non-empty).
        share = info["start_anchors"][0]
        assert 0 < len(share) < len(anchor_new), rank
        assert all(torch.equal(a, anchor_new[n]) for n, a in share.items()), rank
        # Training went on to the end: the round at step 6 and the end-of-fit round.
        assert info["global_step"] == MAX_STEPS and info["inner_steps"] == [MAX_STEPS]
        assert info["outer_steps"] == [3]
    # The caught-up island holds its peers' anchors, at the start and after every round.
    _assert_peers_share_anchors(caught_up, "start_anchors")
    _assert_peers_share_anchors(caught_up, "anchors")
    # The catch-up moved island 1: it is neither its old local nor its step-5 local.
    island1 = caught_up[2]["start_params"]
    assert not any(torch.equal(island1[n], local_old[n]) for n in anchor_new)
    assert not any(torch.equal(island1[n], local_new[1][n]) for n in anchor_new)
    # Both ranks of an island agree throughout; the end-of-fit round leaves every island on
    # the same (global) parameters.
    for rank in range(4):
        for key, other in (("start_params", rank ^ 1), ("params", 0)):
            mine, theirs = caught_up[rank][key], caught_up[other][key]
            assert all(torch.equal(v, theirs[n]) for n, v in mine.items()), (rank, key)


@pytest.mark.parametrize(
    ("main", "old", "shard_outer"),
    [
        ("sharded", "sharded", False),  # sharded checkpoints, unsharded resume
        ("unsharded", "unsharded", True),  # unsharded checkpoints, sharded resume
        ("sharded", "unsharded", True),  # the old island state from an unsharded run
        ("unsharded", "sharded", False),
    ],
)
def test_catch_up_with_shard_outer_toggled_ends_bitwise_equal(
    sharded_run: Path,
    unsharded_run: Path,
    caught_up: list[dict],
    tmp_path: Path,
    main: str,
    old: str,
    shard_outer: bool,
) -> None:
    """With 2 islands a sharded round equals an unsharded one bit for bit (tests above), so
    which run wrote each checkpoint and whether the resume shards must not change a bit."""
    runs = {"sharded": sharded_run, "unsharded": unsharded_run}
    resumed = _resume_behind(
        tmp_path,
        _ckpt(runs[main], NEW_STEP),
        _ckpt(runs[old], OLD_STEP),
        shard_outer=shard_outer,
    )
    for rank in range(4):
        ref, got = caught_up[rank], resumed[rank]
        assert ("caught up optimizer(s) [0]" in got["summary"]) == (rank >= 2), got["summary"]
        for key in ("start_params", "params"):
            for name, value in ref[key].items():
                assert torch.equal(value, got[key][name]), (key, rank, name)
        for key in ("start_anchors", "anchors"):
            # The reference is sharded: this rank's share; an unsharded resume holds them all.
            share = set(ref[key][0])
            assert set(got[key][0]) == (share if shard_outer else set(ref["params"])), key
            for name in share:
                assert torch.equal(ref[key][0][name], got[key][0][name]), (key, rank, name)
        assert got["outer_steps"] == ref["outer_steps"] and got["inner_steps"] == ref["inner_steps"]
        for sa, sb in zip(
            ref["optimizer"]["state"].values(), got["optimizer"]["state"].values(), strict=True
        ):
            assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)


def test_catch_up_from_sharded_checkpoints_onto_islands_of_one_rank(
    sharded_run: Path, tmp_path: Path
) -> None:
    """island_size 2 -> 1 re-shards every anchor onto one rank; island 1 still catches up."""
    old, new = _ckpt(sharded_run, OLD_STEP), _ckpt(sharded_run, NEW_STEP)
    fit(
        tmp_path,
        devices=2,
        island_size=1,
        max_steps=MAX_STEPS,
        ckpt_path=new,
        callbacks=[SwarmResume(island_ckpt_paths={1: old})],
    )
    expected = _caught_up_params(old, new)
    island0, island1 = load_ranks(tmp_path, 2)
    assert "caught up optimizer(s) [0] to round(s) [1]" in island1["summary"]
    for name, anchor in _all_saved_anchors(new).items():
        assert torch.equal(island0["start_anchors"][0][name], anchor)
        assert torch.equal(island1["start_anchors"][0][name], anchor)
        assert torch.equal(island1["start_params"][name], expected[name]), name
    assert island1["outer_steps"] == island0["outer_steps"] == [3]


STREAMING = {"sync_every": 4, "num_fragments": 2, "sync_delay": 1}


def test_catch_up_onto_a_saved_round_in_flight_sharded_equals_unsharded(tmp_path: Path) -> None:
    """Streaming DiLoCo: both checkpoints hold fragment 1 in flight (sent at steps 2 and 6).

    Island 1 drops its own round in flight, catches up to the step-6 anchors and, with every
    island, applies the step-6 round at step 7 from the merged shards' saved average.
    """
    ckpts = tmp_path / "ckpts"
    # Past step 6: the last step's save follows the end-of-fit round, which applies early.
    fit(tmp_path / "full", devices=4, island_size=2, max_steps=7, ckpt_dir=ckpts, **STREAMING)
    old, new = ckpts / "step=2.ckpt", ckpts / "step=6.ckpt"
    for ckpt in (old, new):
        shards = sorted(swarm_dir(ckpt).glob("anchors-rank-*.pt"))
        assert [
            torch.load(p, weights_only=True)["outer"][0]["pending"]["fragment"] for p in shards
        ] == [1, 1]
    runs = {
        shard: _resume_behind(
            tmp_path / f"shard_{shard}", new, old, max_steps=9, shard_outer=shard, **STREAMING
        )
        for shard in (True, False)
    }
    expected = _caught_up_params(old, new)
    _assert_peers_share_anchors(runs[True], "start_anchors")
    _assert_peers_share_anchors(runs[True], "anchors")
    for rank in range(4):
        sharded, full = runs[True][rank], runs[False][rank]
        assert ("caught up" in sharded["summary"]) == (rank >= 2), sharded["summary"]
        if rank >= 2:
            assert all(torch.equal(v, expected[n]) for n, v in sharded["start_params"].items())
        for key in ("start_params", "params"):
            assert all(torch.equal(v, full[key][n]) for n, v in sharded[key].items()), (rank, key)
        for key in ("start_anchors", "anchors"):
            share = sharded[key][0]
            assert all(torch.equal(a, full[key][0][n]) for n, a in share.items()), (rank, key)
        assert sharded["outer_steps"] == full["outer_steps"] and sharded["inner_steps"] == [9]


def test_nan_in_an_old_anchor_shard_names_that_shard(sharded_run: Path, tmp_path: Path) -> None:
    """A behind island reads every shard of its old checkpoint: the error names the one file."""
    root = tmp_path / "copy"
    shutil.copytree(sharded_run / "ckpts", root / "ckpts")
    old = _ckpt(root, OLD_STEP)
    path = swarm_dir(old) / "anchors-rank-00001.pt"
    payload = torch.load(path, weights_only=True)
    anchors = payload["outer"][0]["anchors"]
    name = sorted(anchors)[0]
    anchors[name] = torch.full_like(anchors[name], float("nan"))
    atomic_save(payload, path)
    record_file_again(old, path.name)
    with pytest.raises(Exception, match=rf"rank 2: non-finite values in {path}: {name} "):
        fit(
            tmp_path / "out",
            devices=4,
            island_size=2,
            max_steps=MAX_STEPS,
            ckpt_path=_ckpt(root, NEW_STEP),
            callbacks=[SwarmResume(island_ckpt_paths={1: old})],
        )
    assert not (tmp_path / "out").exists()


def test_island_state_newer_than_ckpt_path_is_refused_with_the_fix(
    sharded_run: Path, tmp_path: Path
) -> None:
    """Lightning restores its loops from ckpt_path: it must be the newest checkpoint."""
    old, new = _ckpt(sharded_run, OLD_STEP), _ckpt(sharded_run, NEW_STEP)
    with pytest.raises(
        Exception,
        match=rf"island_ckpt_paths holds a newer island state than ckpt_path: {new} is at outer "
        rf"round\(s\) \[1\], ckpt_path {old} at \[0\]\. .* pass the newest checkpoint as "
        "ckpt_path and the older ones of the islands that are behind in island_ckpt_paths",
    ):
        fit(
            tmp_path / "out",
            devices=4,
            island_size=2,
            max_steps=MAX_STEPS,
            ckpt_path=old,
            callbacks=[SwarmResume(island_ckpt_paths={1: new})],
        )
    assert not (tmp_path / "out").exists()
