"""Issue 22, item 1: ``ckpt_path=last`` never chooses a checkpoint that cannot be resumed.

Each candidate, newest first, is checked (the Lightning file's CRCs, the swarm record's
checksum, the swarm files' sizes and checksums); a newer broken one is skipped with a warning
naming it and the one chosen.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lightning_swarm.cli.preflight import resolve_ckpt_path
from lightning_swarm.resume.files import ANCHORS_FILE
from tests.resume_utils import edit_record, fit_here, swarm_dir


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("last")
    fit_here(root / "out", max_steps=3, ckpt_dir=root / "ckpts")
    return root / "ckpts"


def _run_dir(saved: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved, run / "ckpts")
    for step in (1, 2, 3):  # copies share a time: order them as they were written
        os.utime(run / "ckpts" / f"step={step}.ckpt", (1_000 * step, 1_000 * step))
    return run


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 5])


def _drop_anchor_file(ckpt: Path) -> None:
    (swarm_dir(ckpt) / ANCHORS_FILE).unlink()


def _shorten_anchor_file(ckpt: Path) -> None:
    anchors = swarm_dir(ckpt) / ANCHORS_FILE
    anchors.write_bytes(anchors.read_bytes()[:-10])


def _edit_counter(ckpt: Path) -> None:
    edit_record(ckpt, lambda r: r.update(outer_steps=[7]), reseal_it=False)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "truncated or corrupt"),
        (_drop_anchor_file, "anchors.pt is missing"),
        (_shorten_anchor_file, r"anchors.pt is truncated or corrupt \(\d+ bytes, its checkpoint"),
        (_edit_counter, "was changed after it was written"),
    ],
)
def test_last_skips_a_broken_newest_checkpoint_and_names_both(
    saved: Path, tmp_path: Path, damage, reason: str
) -> None:  # type: ignore[no-untyped-def]
    run = _run_dir(saved, tmp_path)
    newest, previous = run / "ckpts" / "step=3.ckpt", run / "ckpts" / "step=2.ckpt"
    damage(newest)
    os.utime(newest, (3_000, 3_000))
    with pytest.warns(UserWarning, match=reason) as caught:
        chosen = resolve_ckpt_path("last", str(run), [])
    assert chosen == str(previous.resolve())
    (warning,) = [w for w in caught if "ckpt_path=last" in str(w.message)]
    assert str(newest) in str(warning.message) and str(previous) in str(warning.message)


def test_last_takes_the_newest_when_it_is_complete(saved: Path, tmp_path: Path) -> None:
    run = _run_dir(saved, tmp_path)
    assert resolve_ckpt_path("last", str(run), []) == str((run / "ckpts" / "step=3.ckpt").resolve())


def test_last_with_no_complete_checkpoint_lists_each(saved: Path, tmp_path: Path) -> None:
    run = _run_dir(saved, tmp_path)
    for step in (1, 2, 3):
        _truncate(run / "ckpts" / f"step={step}.ckpt")
    with pytest.raises(ValueError, match="found no complete checkpoint: .*step=3.ckpt .*step=1"):
        resolve_ckpt_path("last", str(run), [])
