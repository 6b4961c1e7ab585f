"""Module docstrings state contracts, briefly: every module has one, and together they stay a
small share of the library's lines. Measurements and histories belong in docs/."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_swarm"
MAX_SHARE = 0.05  # module docstrings, as a share of the library's lines


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False)


def test_every_module_has_a_docstring() -> None:
    missing = [str(p.relative_to(PACKAGE.parent)) for p in _modules() if not _docstring(p)]
    assert not missing, f"modules without a docstring: {missing}"


def test_module_docstrings_are_a_small_share_of_the_library() -> None:
    sizes = {p: len((_docstring(p) or "").splitlines()) for p in _modules()}
    total = sum(len(p.read_text().splitlines()) for p in sizes)
    share = sum(sizes.values()) / total
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    named = ", ".join(f"{p.relative_to(PACKAGE.parent)} ({n})" for p, n in largest)
    assert share <= MAX_SHARE, (
        f"module docstrings hold {share:.1%} of the library's {total} lines (at most "
        f"{MAX_SHARE:.0%}); keep contracts there and move measurements to docs/. Largest: {named}"
    )


def test_the_count_sees_a_docstring_and_nothing_else(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""One.\n\nTwo.\n"""\n\nX = """not a docstring"""\n')
    assert len((_docstring(module) or "").splitlines()) == 3
    module.write_text("X = 1\n")
    assert _docstring(module) is None
