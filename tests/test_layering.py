"""The package's imports point down only, and no two of its modules import each other.

Every ``import`` statement counts: at module level, inside functions and under
``TYPE_CHECKING`` (a deferred import is still an import; if it closes a loop the design has a
cycle). The graph is built with ``ast`` from the source files, so nothing is executed.

Layers, top to bottom (a module may import its own layer or any layer below it):

- glue: the package root, ``strategy``, ``island_ddp``, ``elastic``,
  ``between_rounds``, ``cli/``, ``callbacks/``, ``demo/``, ``pipeline/glue``;
- outer loop: ``outer/``;
- resume / records: ``resume/``;
- options and membership: ``config`` (the strategy's options, built on the transport's own
  option types), ``membership/`` (who takes part in a round: torchft's quorum);
- transport and pipeline stages: ``transport/``, ``pipeline/`` (the stage split and the
  schedule runner, which ``config`` checks schedules with);
- topology: ``topology`` (plain arithmetic the transports' groups are built from);
- algorithm: ``algorithm/``;
- memory and constants: ``memory/``, ``errors`` (the error root), ``profiling`` (trace labels).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "lightning_swarm"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# (module or package, layer): the longest match wins; higher layers sit above lower ones. The
# package root matches itself only, so a new module without a layer fails the test.
LAYERS: list[tuple[str, int]] = [
    (PACKAGE, 7),
    (f"{PACKAGE}.strategy", 7),
    (f"{PACKAGE}.lightning_file", 7),
    (f"{PACKAGE}.between_rounds", 7),
    (f"{PACKAGE}.island_ddp", 7),
    (f"{PACKAGE}.elastic", 7),
    (f"{PACKAGE}.cli", 7),
    (f"{PACKAGE}.callbacks", 7),
    (f"{PACKAGE}.demo", 7),
    (f"{PACKAGE}.pipeline.glue", 7),
    (f"{PACKAGE}.outer", 6),
    (f"{PACKAGE}.warm_start", 6),
    (f"{PACKAGE}.resume", 5),
    (f"{PACKAGE}.membership", 4),
    (f"{PACKAGE}.config", 4),
    (f"{PACKAGE}.transport", 3),
    (f"{PACKAGE}.pipeline", 3),
    (f"{PACKAGE}.topology", 2),
    (f"{PACKAGE}.algorithm", 1),
    (f"{PACKAGE}.memory", 0),
    (f"{PACKAGE}.errors", 0),
    (f"{PACKAGE}.profiling", 0),
]
GLUE = 7


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(module: str) -> Iterator[str]:
    """Every absolute module name ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    yield from _imports_in(path.read_text(), package)


def _imports_in(source: str, package: str) -> Iterator[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` too.
            yield from (f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def _internal_edges() -> dict[str, set[str]]:
    """``module -> modules it imports``, the packages run on the way included.

    Importing ``a.b.c`` first runs ``a/b/__init__.py``: that package is an edge too, unless it
    contains the importer (a module's own packages are always initialised before it runs).
    """
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        own = set(_ancestors(module))
        targets: set[str] = set()
        for name in _imports(module):
            targets.update(a for a in _ancestors(name) if a in MODULES and a not in own)
            if name in MODULES:
                targets.add(name)
        edges[module] = targets - {module}
    return edges


def _layer(module: str) -> int:
    matches = [
        (len(p), layer)
        for p, layer in LAYERS
        if module == p or (p != PACKAGE and module.startswith(p + "."))
    ]
    if not matches:
        pytest.fail(f"{module} has no layer: add it to LAYERS in {Path(__file__).name}")
    return max(matches)[1]


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_walk_sees_deferred_imports() -> None:
    # Guards the walker itself: imports inside functions and under TYPE_CHECKING count.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lightning_swarm.strategy import SwarmStrategy\n"
        "def f():\n    from . import census\n    import lightning_swarm.outer.loop\n"
    )
    found = set(_imports_in(source, f"{PACKAGE}.callbacks"))
    assert {f"{PACKAGE}.strategy", f"{PACKAGE}.callbacks.census"} <= found
    assert f"{PACKAGE}.outer.loop" in found
    edges = _internal_edges()
    assert f"{PACKAGE}.outer.loop" in edges[f"{PACKAGE}.outer"]
    assert f"{PACKAGE}" not in edges[f"{PACKAGE}.outer.loop"]  # its own package runs first
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _layer(module)  # fails naming the module


def test_every_layer_names_a_module_that_exists() -> None:
    # A stale entry would give a renamed module's new name no layer check at all.
    stale = [p for p, _ in LAYERS if p not in MODULES]
    assert not stale, f"LAYERS names modules that no longer exist: {stale}"


# File names that may repeat, each with one meaning wherever it stands.
SHARED_FILE_NAMES = {"__init__.py", "config.py", "errors.py"}


def test_no_two_modules_share_a_file_name() -> None:
    by_name: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        by_name.setdefault(path.name, []).append(module)
    repeated = {n: m for n, m in by_name.items() if len(m) > 1 and n not in SHARED_FILE_NAMES}
    assert not repeated, f"one file name, several modules (rename one): {repeated}"


def test_no_import_cycles() -> None:
    cycles = _cycles(_internal_edges())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_imports_point_down() -> None:
    upward = [
        f"{importer} (layer {_layer(importer)}) imports {imported} (layer {_layer(imported)})"
        for importer, targets in _internal_edges().items()
        for imported in sorted(targets)
        if _layer(imported) > _layer(importer)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _external(module: str) -> set[str]:
    return {name for name in _imports(module) if not name.startswith(PACKAGE)}


def _uses(names: set[str], prefix: str) -> bool:
    return any(n == prefix or n.startswith(prefix + ".") for n in names)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) < GLUE))
def test_only_the_glue_imports_lightning(module: str) -> None:
    external = _external(module)
    assert not _uses(external, "lightning"), f"{module} imports lightning"
    assert not _uses(external, "pytorch_lightning"), f"{module} imports pytorch_lightning"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) <= 1))
def test_algorithm_and_memory_never_communicate(module: str) -> None:
    assert not _uses(_external(module), "torch.distributed"), f"{module} uses torch.distributed"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == 0))
def test_memory_is_stdlib(module: str) -> None:
    assert not _uses(_external(module), "torch"), f"{module} imports torch"


CALLBACKS = sorted(m for m in MODULES if m.startswith(f"{PACKAGE}.callbacks"))


@pytest.mark.parametrize("module", CALLBACKS)
def test_callbacks_do_not_import_the_strategy(module: str) -> None:
    imported = {i for i in _imports(module) if i == f"{PACKAGE}.strategy"}
    assert not imported, f"{module} imports lightning_swarm.strategy; read a protocol instead"
