"""Damaged checkpoints, bad resume options and changed options, through real Trainer runs.

A flipped bit in any swarm file is caught by its checksum before anything is installed; NaN or
inf saved in anchors or island parameters is reported as such; ``island_ckpt_paths`` naming an
island that does not exist is refused; options changed at resume are named in one warning, and
an outer optimizer of another class is refused.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from lightning_swarm.callbacks.resume import SwarmResume
from lightning_swarm.resume.atomic import atomic_save
from lightning_swarm.resume.files import ANCHORS_FILE
from tests.resume_utils import (
    fit,
    fit_here,
    flip_bit_in_tensor_data,
    load_ranks,
    record_file_again,
    swarm_dir,
)

MAX_STEPS = 5


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 islands of 1 rank, checkpoints after every step."""
    root = tmp_path_factory.mktemp("full")
    fit(root / "out", devices=2, island_size=1, max_steps=4, ckpt_dir=root / "ckpts")
    return root


def _copy(full_run: Path, tmp_path: Path) -> Path:
    """A private copy of step 4's checkpoint (the tests damage it)."""
    shutil.copytree(full_run / "ckpts", tmp_path / "ckpts")
    return tmp_path / "ckpts" / "step=4.ckpt"


def _resume(tmp_path: Path, ckpt: Path, **kw: object) -> None:
    fit(tmp_path / "out", devices=2, island_size=1, max_steps=MAX_STEPS, ckpt_path=ckpt, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["island-00001.pt", ANCHORS_FILE])
def test_flipped_bit_is_a_checksum_mismatch_on_every_rank(
    full_run: Path, tmp_path: Path, name: str
) -> None:
    ckpt = _copy(full_run, tmp_path)
    path = swarm_dir(ckpt) / name
    entry = flip_bit_in_tensor_data(path)
    assert "/data/" in entry
    reader = "rank 1: " if name.startswith("island") else "rank 0: "
    with pytest.raises(Exception, match=rf"{reader}swarm state file .*/{name}: checksum mismatch"):
        _resume(tmp_path, ckpt)
    assert not (tmp_path / "out").exists()  # no rank trained
    # the documented switch skips the check (the flipped bit then goes unnoticed)
    _resume(tmp_path, ckpt, anchors={"verify": False})
    assert all("unverified" in r["summary"] for r in load_ranks(tmp_path / "out", 2))


def _poison(ckpt: Path, name: str, tensor: str) -> Path:
    """Save NaN into one tensor of swarm file ``name`` and record the file as written."""
    path = swarm_dir(ckpt) / name
    payload = torch.load(path, weights_only=True)
    target = payload["outer"][0]["anchors"] if name == ANCHORS_FILE else payload["module"]
    target[tensor] = target[tensor].clone()
    target[tensor][0, 0] = float("nan")
    atomic_save(payload, path)
    record_file_again(ckpt, name)
    return path


@pytest.mark.parametrize("name", ["island-00001.pt", ANCHORS_FILE])
def test_saved_nan_is_reported_as_such(full_run: Path, tmp_path: Path, name: str) -> None:
    ckpt = _copy(full_run, tmp_path)
    path = _poison(ckpt, name, "net.0.weight")
    with pytest.raises(Exception, match=rf"non-finite values in {path}: net.0.weight") as caught:
        _resume(tmp_path, ckpt)
    assert "that island's training diverged" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_island_ckpt_paths_naming_a_missing_island_is_refused(
    full_run: Path, tmp_path: Path
) -> None:
    ckpt = full_run / "ckpts" / "step=4.ckpt"
    old = full_run / "ckpts" / "step=2.ckpt"
    with pytest.raises(
        Exception,
        match=r"SwarmResume\(island_ckpt_paths=...\) names island\(s\) \[5\], but this run has "
        r"2 island\(s\), numbered 0 .. 1",
    ):
        _resume(tmp_path, ckpt, callbacks=[SwarmResume(island_ckpt_paths={5: old})])
    assert not (tmp_path / "out").exists()


# -- options changed at resume (one rank in this process, so its warnings are seen) -------------
@pytest.fixture(scope="module")
def quantized_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One island, int8 pseudo-gradients with error feedback; residuals exist after step 3."""
    root = tmp_path_factory.mktemp("quantized")
    kw: dict[str, object] = {"quantize": "int8", "error_feedback": True}
    fit_here(root / "out", max_steps=4, ckpt_dir=root / "ckpts", **kw)
    return root / "ckpts" / "step=4.ckpt"


def test_changed_options_are_named_in_one_warning(quantized_run: Path, tmp_path: Path) -> None:
    outer = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.8, nesterov=True)
    with pytest.warns(UserWarning) as caught:
        fit_here(
            tmp_path / "out",
            max_steps=6,
            ckpt_path=quantized_run,
            sync_every=5,
            quantize="int4",
            error_feedback=False,
            anchor_dtype=torch.bfloat16,
            outer_optimizer=outer,
            transport="swarm",
        )
    mine = [str(w.message) for w in caught if "resuming with options" in str(w.message)]
    assert len(mine) == 1, mine
    message = mine[0]
    for line in (
        "sync_every 3 -> 5: the next round comes at inner step 5 (it would have come at 6)",
        "quantize int8 -> int4: the next rounds send int4 pseudo-gradients",
        "error_feedback true -> false: the saved error-feedback residuals are dropped",
        "anchor_dtype float32 -> bfloat16: the saved float32 anchors are converted",
        "lr 0.7 -> 0.5: the checkpoint's 0.7 stays in force",
        "momentum 0.9 -> 0.8: an outer momentum ramp scales the new 0.8 from the next round on",
        "transport allreduce -> swarm: pseudo-gradients are averaged by the swarm transport from "
        "now on",
    ):
        assert line in message, (line, message)
    assert "merge_alpha" not in message and "quantize_block_size" not in message  # unchanged


def test_same_options_resume_without_a_warning(quantized_run: Path, tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_here(
            tmp_path / "out",
            max_steps=5,
            ckpt_path=quantized_run,
            quantize="int8",
            error_feedback=True,
        )
    assert not [w for w in caught if "resuming with options" in str(w.message)]


def test_outer_optimizer_of_another_class_is_refused(quantized_run: Path, tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"outer optimizer SGD -> Adam: the checkpoint's outer"):
        fit_here(
            tmp_path / "out",
            max_steps=5,
            ckpt_path=quantized_run,
            quantize="int8",
            error_feedback=True,
            outer_optimizer=functools.partial(torch.optim.Adam, lr=0.1),
        )
    assert not (tmp_path / "out").exists()


def test_anchor_of_another_shape_is_refused_before_install(full_run: Path, tmp_path: Path) -> None:
    ckpt = _copy(full_run, tmp_path)
    path = swarm_dir(ckpt) / ANCHORS_FILE
    payload = torch.load(path, weights_only=True)
    payload["outer"][0]["anchors"]["net.2.bias"] = torch.zeros(3)
    atomic_save(payload, path)
    record_file_again(ckpt, ANCHORS_FILE)  # a consistent file of the wrong model
    with pytest.raises(
        Exception, match=rf"{path}: parameter 'net.2.bias' \(shape \(2,\)\) has shape \(3,\)"
    ):
        _resume(tmp_path, ckpt)
    assert not (tmp_path / "out").exists()
