"""The docs cannot rot: the README's Python snippet, the launch guide's tested commands (with a
tiny model and 2 steps appended) and docs/your_model.md's CLI recipe run as written, and the
README lists every doc."""

from __future__ import annotations

import re
import shlex
import shutil
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


def test_your_model_recipe_runs_as_written(tmp_path: Path) -> None:
    """docs/your_model.md's CLI recipe, its command unchanged, from a copy of the checkout's
    ``examples/`` (its ``outputs/`` land in ``tmp_path``); ``../.venv/bin/swarm-train`` is
    this interpreter's CLI, the checkout on the path after the recipe's own ``PYTHONPATH``."""
    page = (ROOT / "docs" / "your_model.md").read_text()
    (command,) = [body.replace("\\\n", " ").strip() for body in TESTED.findall(page)]
    assert command.startswith("cd examples && ")
    shutil.copytree(
        ROOT / "examples",
        tmp_path / "examples",
        ignore=shutil.ignore_patterns("outputs", "__pycache__"),
    )
    cli = tmp_path / ".venv" / "bin" / "swarm-train"
    cli.parent.mkdir(parents=True)
    cli.write_text(
        "#!/bin/sh\n"
        f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{ROOT}"\n'
        f'exec {shlex.quote(sys.executable)} -m lightning_swarm.cli.app "$@"\n'
    )
    cli.chmod(0o755)
    done = run_in(tmp_path, ["bash", "-c", command])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning_swarm run summary" in done.stdout
    (rounds,) = re.findall(r"(\d+) outer rounds", page)  # the page's own figure
    assert int(rounds) > 1
    assert re.findall(r"^ +outer steps +(\d+)$", done.stdout, re.MULTILINE) == [rounds]
    assert len(list((tmp_path / "examples" / "outputs").rglob("summary.json"))) == 1


# -- every path, test and option a doc names exists ---------------------------------------------
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
TOP = ("lightning_swarm/", "tests/", "benchmarks/", "examples/", "docs/", "conf/", ".ci/")
SUFFIXES = (".py", ".md", ".yaml", ".json", ".png", ".toml", ".csv")


# Written on another branch at the same time as the page that links it.
def _spans(path: Path) -> list[str]:
    return CODE_SPAN.findall(path.read_text())


def named_paths(span: str) -> list[str]:
    """The repository paths a code span names: whole spans, and words of a command line."""
    out = []
    for word in re.split(r"[\s=:(),]+", span):
        word = word.strip("'\".")
        if not PATH.match(word) or word.startswith((".", "-")):
            continue
        if word.startswith(TOP) or word.endswith(".py"):
            out.append(word)
    return out


def _exists(name: str) -> bool:
    if "/" not in name:  # a bare file name: some file of the repository has it
        tops = ("lightning_swarm", "tests", "benchmarks", "examples")
        return any(next((ROOT / top).rglob(name), None) is not None for top in tops)
    return any((base / name).exists() for base in (ROOT, ROOT / "lightning_swarm"))


def test_every_path_a_doc_names_exists() -> None:
    missing = [
        f"{doc.name}: {name}"
        for doc in DOCS
        for span in _spans(doc)
        for name in named_paths(span)
        if not _exists(name)
    ]
    assert not missing, f"docs name files that do not exist: {missing}"


def _test_names() -> set[str]:
    import ast

    names = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
    return names


def test_every_test_a_doc_names_exists() -> None:
    known = _test_names()
    named = {
        (doc.name, name)
        for doc in DOCS
        for span in _spans(doc)
        for name in re.findall(r"(?<![.\w])(test_\w+)\b(?!\.py|\*)", span)
    }
    missing = sorted(f"{doc}: {name}" for doc, name in named if name not in known)
    assert not missing, f"docs name tests that do not exist: {missing}"


def _option_names() -> set[str]:
    import dataclasses

    from lightning_swarm.config import AnchorConfig, SwarmConfig, SwarmTransportConfig

    names = {f.name for f in dataclasses.fields(SwarmConfig)} | {"outer_optimizer"}
    names |= {f"anchors.{f.name}" for f in dataclasses.fields(AnchorConfig)}
    names |= {f"swarm.{f.name}" for f in dataclasses.fields(SwarmTransportConfig)}
    return names


def test_every_option_a_doc_names_exists() -> None:
    """``strategy.<option>`` on a command line, and the README's option table."""
    known = _option_names()
    named = set()
    for doc in DOCS:
        for span in _spans(doc):
            for name in re.findall(r"(?<![\w/])strategy\.([a-z_]+(?:\.[a-z_]+)?)=", span):
                top = name.split(".")[0]
                named.add((doc.name, name if top in ("anchors", "swarm") else top))
            for call in re.findall(r"SwarmStrategy\(([^)]*)", span):
                named |= {(doc.name, k) for k in re.findall(r"(\w+)=", call)}
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## The options people change") : readme.index("## Documentation")]
    for row in re.findall(r"^\| (`[^|]+) \|", table, re.MULTILINE):
        named |= {("README.md", name) for name in CODE_SPAN.findall(row)}
    outer = {n for n in named if n[1].startswith("outer_optimizer")}
    missing = sorted(f"{doc}: {name}" for doc, name in named - outer if name not in known)
    assert not missing, f"docs name options SwarmConfig does not have: {missing}"


def test_the_docs_test_catches_a_missing_path_test_and_option() -> None:
    assert named_paths("tests/test_nothing_here.py") == ["tests/test_nothing_here.py"]
    assert not _exists("tests/test_nothing_here.py")
    assert "test_no_such_test" not in _test_names()
    assert "sync_evry" not in _option_names() and "sync_every" in _option_names()
