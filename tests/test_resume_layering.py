"""The save/restore layer stays below the Lightning glue (imports walked with ``ast``).

Counts every import: top level, inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_swarm

PACKAGE = Path(lightning_swarm.__file__).parent
LOWER = [*sorted((PACKAGE / "resume").glob("*.py"))]
FORBIDDEN = (
    "lightning",
    "pytorch_lightning",
    "lightning_swarm.strategy",
    "lightning_swarm.callbacks",
)


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_resume_layer_imports_no_lightning_and_no_glue() -> None:
    assert len(LOWER) >= 7
    bad = {p.name: [n for n in _imports(p) if _forbidden(n)] for p in LOWER}
    assert not any(bad.values()), bad


def test_strategy_does_not_import_the_resume_callback() -> None:
    hooks = _imports(PACKAGE / "strategy.py")
    assert "lightning_swarm.resume" in hooks  # the strategy's base owns the checkpointer
    for module in ("strategy.py", "strategy.py"):
        names = _imports(PACKAGE / module)
        assert not [n for n in names if n.startswith("lightning_swarm.callbacks")], names


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from lightning_swarm.strategy import SwarmStrategy\n")
    assert [n for n in _imports(probe) if _forbidden(n)] == ["lightning_swarm.strategy"]
