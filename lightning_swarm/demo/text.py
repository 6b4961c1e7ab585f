"""The main job's corpus: the Python standard library's own source files.

Bytes are the tokens. Whole files go to validation by a stable hash of their relative path, so
the split is the same on every rank with the same Python version."""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_swarm.errors import SwarmConfigError


def read_corpus(root: Path, max_bytes: int, val_every: int) -> tuple[bytes, bytes]:
    """(train, val): the ``*.py`` files under ``root`` (sorted, site-packages excluded, up to
    ``max_bytes``), about one file in ``val_every`` held out.

    Raises:
        SwarmConfigError: ``root`` is not a folder, or holds too little to split.
    """
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise SwarmConfigError(
            f"data.corpus_dir={root} {what}; point data.corpus_dir at a folder of .py files "
            "(read recursively), or set it to null to read the Python standard library."
        )
    files: list[tuple[bool, bytes]] = []  # (held out, content)
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        files.append((zlib.crc32(rel.encode()) % val_every == 0, data))
        total += len(data)
        if total >= max_bytes:
            break
    if files and not any(held for held, _ in files):
        # A small max_bytes can miss every held-out file: then the last file read is held out.
        files[-1] = (True, files[-1][1])
    train = b"".join(data for held, data in files if not held)
    val = b"".join(data for held, data in files if held)
    if not train or not val:
        raise SwarmConfigError(
            f"corpus under {root} gave {len(train)} training and {len(val)} validation bytes; "
            "raise data.max_bytes or point data.corpus_dir at a larger folder of .py files."
        )
    return train, val


class ByteBlocks(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows of ``block_size + 1`` bytes: (input, next-byte target)."""

    def __init__(self, data: bytes, block_size: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ResumableDataLoader(DataLoader[tuple[Tensor, Tensor]]):
    """A ``DataLoader`` whose position in an epoch is in every Lightning checkpoint, so a resume
    from mid-epoch sees the batches an uninterrupted run would. The position is keyed by the
    sampler's epoch (set by Lightning); Lightning does not prefetch from a loader with a length,
    so the batches yielded are the batches trained on. Skipped batches are loaded and dropped.
    """

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": getattr(self, "_epoch", None), "batches": getattr(self, "_yielded", 0)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_at = (state_dict["epoch"], int(state_dict["batches"]))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:  # type: ignore[override]
        # A generator: the body runs at the first next(), after Lightning set the epoch.
        return self._batches()

    def _batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        epoch = getattr(self.sampler, "epoch", None)
        saved_epoch, skip = getattr(self, "_resume_at", (None, 0))
        self._resume_at = (None, 0)
        if saved_epoch != epoch:
            skip = 0
        self._epoch, self._yielded = epoch, 0
        for batch in super().__iter__():
            self._yielded += 1
            if self._yielded > skip:
                yield batch


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level language-modelling data: ``batch_size`` sequences of ``block_size`` bytes per
    rank per inner step, from ``corpus_dir`` (``None``: the standard library)."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 8_000_000,
        val_every: int = 20,
        val_batches: int = 16,
        corpus_dir: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if value < 1:
                raise SwarmConfigError(f"data.{name} must be >= 1, got {value}")
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_every = val_every
        self.val_batches = val_batches
        self.corpus_dir = corpus_dir
        self.train_set: ByteBlocks | None = None
        self.val_set: ByteBlocks | None = None

    def setup(self, stage: str | None = None) -> None:
        root = Path(self.corpus_dir or sysconfig.get_paths()["stdlib"])
        train, val = read_corpus(root, self.max_bytes, self.val_every)
        self.train_set = ByteBlocks(train, self.block_size)
        # A fixed, small validation set keeps evaluation cheap and identical across runs.
        limit = self.val_batches * self.batch_size * (self.block_size + 1)
        self.val_set = ByteBlocks(val[:limit], self.block_size)

    def train_dataloader(self) -> ResumableDataLoader:
        assert self.train_set is not None
        return ResumableDataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True
        )

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)
