"""Issue 22, item 1: a full disk during a checkpoint save loses nothing and says so.

Every file of a save (the swarm files and Lightning's own file) is written to a temporary name
in its own folder and renamed; a failed save removes what it wrote, leaves the previous
checkpoint as it was, and raises ``DiskFullError`` ("no space left on device", the file, the
bytes needed). The disk is simulated by a writer that fails part-way (``tests.disk_full``),
and, where this machine lets us mount one, by a real 8 MiB tmpfs.
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_swarm.cli.preflight import resolve_ckpt_path
from lightning_swarm.errors import DiskFullError
from lightning_swarm.resume.atomic import atomic_save
from lightning_swarm.resume.files import swarm_root
from tests.disk_full import fail_writes, leftovers
from tests.resume_utils import StepDataModel, fit, fit_here, load_ranks


def test_atomic_save_names_a_full_disk_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "anchors.pt"
    atomic_save({"x": torch.ones(4)}, path)
    before = path.read_bytes()
    fail_writes(monkeypatch, "anchors.pt", after_bytes=500)
    with pytest.raises(DiskFullError) as info:
        atomic_save({"x": torch.zeros(50_000)}, path)
    message = str(info.value)
    assert "no space left on device" in message and str(path) in message
    assert "needs about 200,000 bytes" in message  # 50,000 float32 values
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("where", "name"),
    [
        ("step=3.ckpt.swarm", "island-00000.pt"),  # the swarm's own files, written first
        ("step=3.ckpt.swarm", "anchors.pt"),
        ("ckpts", ".step=3.ckpt.tmp-"),  # Lightning's file: written last, in its own folder
    ],
)
def test_a_save_that_runs_out_of_space_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, name: str
) -> None:
    ckpts = tmp_path / "ckpts"
    fail_writes(monkeypatch, where, name)  # the saves after steps 1 and 2 succeed
    with pytest.raises(DiskFullError, match="no space left on device") as info:
        fit_here(tmp_path / "out", max_steps=5, ckpt_dir=ckpts)
    assert name.strip(".").removesuffix(".tmp-") in str(info.value)
    assert "needs about" in str(info.value)
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["step=1.ckpt", "step=2.ckpt"]
    assert not swarm_root(ckpts / "step=3.ckpt").exists()
    assert leftovers(ckpts) == []
    monkeypatch.undo()
    # The previous checkpoint is whole: a resume from it trains on to the end.
    fit_here(tmp_path / "resumed", max_steps=4, ckpt_path=ckpts / "step=2.ckpt")
    assert load_ranks(tmp_path / "resumed", 1)[0]["global_step"] == 4


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpts = tmp_path / "ckpts"
    fail_writes(monkeypatch, "step=2.ckpt.swarm", "island-00001.pt")  # rank 1's own file
    with pytest.raises(Exception, match="no space left on device") as info:
        fit(tmp_path / "out", devices=2, island_size=1, max_steps=4, ckpt_dir=ckpts)
    assert "island-00001.pt" in str(info.value)
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["step=1.ckpt"]
    assert not swarm_root(ckpts / "step=2.ckpt").exists()
    assert leftovers(ckpts) == []


def test_a_full_disk_under_the_lightning_file_fails_the_save_alike_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpts = tmp_path / "ckpts"
    fail_writes(monkeypatch, "ckpts", ".step=2.ckpt.tmp-")  # global rank 0 writes it, last
    with pytest.raises(Exception, match="no space left on device") as info:
        fit(tmp_path / "out", devices=2, island_size=1, max_steps=4, ckpt_dir=ckpts)
    # Whichever rank's error the launcher reports, it is the agreed one, naming global rank 0
    # (rank 0 used to raise its own error, and only the others this one).
    assert f"DiskFullError: checkpoint {ckpts / 'step=2.ckpt'} was not saved" in str(info.value)
    assert "(global rank 0: DiskFullError: no space left on device" in str(info.value)
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["step=1.ckpt"]
    assert not swarm_root(ckpts / "step=2.ckpt").exists()
    assert leftovers(ckpts) == []


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """An 8 MiB tmpfs at ``tmp_path / "disk"``, or a skip where mounting is not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True
        )
    except OSError as err:  # no mount command at all
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


class BigStepModel(StepDataModel):
    """StepDataModel with 1 MiB more parameters: a save (island file, anchors, Lightning file,
    with Adam's two moments) takes about 7 MiB, so an 8 MiB disk holds one save, not two."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(2**18))

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-6 * self.big.square().mean()


def test_a_real_full_disk_keeps_the_previous_checkpoint(small_disk: Path, tmp_path: Path) -> None:
    ckpts = small_disk / "ckpts"
    with pytest.raises(DiskFullError, match="no space left on device"):
        fit_here(tmp_path / "out", max_steps=4, ckpt_dir=ckpts, module=BigStepModel())
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["step=1.ckpt"]
    assert [p.name for p in swarm_root(ckpts / "step=1.ckpt").iterdir()]  # its save is there
    assert not swarm_root(ckpts / "step=2.ckpt").exists()
    assert leftovers(ckpts) == []
    last = resolve_ckpt_path("last", str(small_disk), [])
    assert last == str((ckpts / "step=1.ckpt").resolve())
    fit_here(tmp_path / "resumed", max_steps=2, ckpt_path=Path(last), module=BigStepModel())
    assert load_ranks(tmp_path / "resumed", 1)[0]["global_step"] == 2


def test_the_strategy_writes_lightning_files_atomically_unless_given_its_own_io() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from lightning_swarm import SwarmStrategy
    from lightning_swarm.lightning_file import AtomicCheckpointIO

    def io_of(plugins: list[object]) -> object:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=SwarmStrategy(), plugins=plugins, logger=False
        )
        return trainer.strategy.checkpoint_io

    assert isinstance(io_of([]), AtomicCheckpointIO)
    own = TorchCheckpointIO()
    assert io_of([own]) is own  # a user's own checkpoint IO is kept
    wrapped = io_of([AsyncCheckpointIO()])
    assert isinstance(wrapped, AsyncCheckpointIO)
    assert isinstance(wrapped.checkpoint_io, AtomicCheckpointIO)  # and wrapped, ours inside
