"""The docs cannot rot: the README's Python snippet and the launch guide's tested commands run
as written (the commands with a tiny model and 2 steps appended), and the README lists every
doc."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.cli_utils import ROOT, TINY, run_in

FENCE = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)
TESTED = re.compile(r"<!-- tested -->\n```bash\n(.*?)```", re.DOTALL)
# Appended to each tested command: the main job shrunk to 2 steps.
SHORT = [*TINY, "trainer.max_steps=2", "trainer.val_check_interval=2", "strategy.sync_every=1"]


def _blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def test_readme_snippet_runs_as_written(tmp_path: Path) -> None:
    snippet = _blocks(ROOT / "README.md", "python")[0]
    assert "model" not in re.findall(r"fit\((\w+)", snippet)  # no undefined names to fill in
    script = tmp_path / "train.py"
    script.write_text(snippet)
    done = run_in(tmp_path, [sys.executable, str(script)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outer steps: 2" in done.stdout  # max_steps=20, sync_every=10


def test_readme_lists_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    index = readme[readme.index("## Documentation") :]
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"`docs/{p.name}`:" not in index]
    assert not missing, f"README's documentation list lacks {missing}"


def _tested_commands() -> list[str]:
    text = (ROOT / "docs" / "launch.md").read_text()
    return [body.replace("\\\n", " ").strip() for body in TESTED.findall(text)]


def test_launch_guide_marks_the_cpu_commands() -> None:
    commands = _tested_commands()
    assert len(commands) == 2
    assert commands[0].startswith("swarm-train ") and commands[1].startswith("torchrun ")


@pytest.mark.parametrize("index", [0, 1], ids=["lightning", "torchrun"])
def test_launch_guide_command_runs(tmp_path: Path, index: int) -> None:
    words = shlex.split(_tested_commands()[index])
    # The doc's programs, from this interpreter (the checkout first on the path).
    program = {
        "swarm-train": [sys.executable, "-m", "lightning_swarm.cli.app"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }[words[0]]
    if "hydra.run.dir" not in " ".join(words):
        words.append(f"hydra.run.dir={tmp_path / 'run'}")
    done = run_in(tmp_path, [*program, *words[1:], *SHORT])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning_swarm run summary" in done.stdout
    assert "outer steps                              2" in done.stdout
    assert len(list(tmp_path.rglob("summary.json"))) == 1  # every rank agreed on one run dir
