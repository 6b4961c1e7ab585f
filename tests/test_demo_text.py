"""The main job's corpus (``lightning_swarm/demo/text.py``): a bad ``data.corpus_dir`` is a
``SwarmConfigError`` naming the folder and the fix (issue 39, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_swarm.demo.text import StdlibTextDataModule, read_corpus
from lightning_swarm.errors import SwarmConfigError, SwarmError

FIX = (
    "point data.corpus_dir at a folder of .py files (read recursively), or set it to null to "
    "read the Python standard library."
)


def test_a_missing_corpus_folder_is_named_with_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "corpus"
    data = StdlibTextDataModule(corpus_dir=str(missing))
    with pytest.raises(SwarmConfigError) as caught:
        data.setup("fit")
    assert str(caught.value) == f"data.corpus_dir={missing} does not exist; {FIX}"
    assert isinstance(caught.value, SwarmError)


def test_a_file_given_as_the_corpus_folder_is_named_with_the_fix(tmp_path: Path) -> None:
    file = tmp_path / "corpus.py"
    file.write_text("x = 1\n")
    with pytest.raises(SwarmConfigError) as caught:
        read_corpus(file, max_bytes=1000, val_every=2)
    assert str(caught.value) == f"data.corpus_dir={file} is a file, not a folder; {FIX}"


def test_a_folder_of_python_files_is_read_and_split(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"m{i}.py").write_text(f"value = {i}\n")
    train, val = read_corpus(tmp_path, max_bytes=1000, val_every=2)
    assert train and val and len(train) + len(val) == 4 * len(b"value = 0\n")
