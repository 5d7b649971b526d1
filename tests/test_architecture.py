"""The package rules of docs/architecture.md, checked on the source tree.

Every module must also be named on the map there (`_mapped_files` says how the
map is read). Imports are read from the AST (module level, inside functions and
under ``TYPE_CHECKING`` alike), so a rule broken by a lazy import fails too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "service")
CORE_FORBIDDEN = ("grpc", "google.protobuf", "kvstore.v1", "asyncio", "redis")
"""What the pure core (the modules at the top of `kvstore/`) never imports."""
CORE_SUBPACKAGES = {"api", "cli", "client", "integrations", "ops", "pool", "v1"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.parts[:2] == ("kvstore", "v1"):
                continue  # generated code
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module `name` imports: absolute names, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # ``from pkg import sub`` imports the submodule, not a name of pkg.
            subs = {f"{base}.{alias.name}" for alias in node.names} & known
            found.update(subs or {base})
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    edges = _internal(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert cycles == []


def test_core_is_pure(graph: dict[str, set[str]]) -> None:
    core = [
        m for m in graph if m.startswith("kvstore.") and m.split(".")[1] not in CORE_SUBPACKAGES
    ]
    assert "kvstore.hashing" in core and "kvstore.store" in core
    offending = {m: sorted(t for t in graph[m] if t.startswith(CORE_FORBIDDEN)) for m in core}
    assert {m: t for m, t in offending.items() if t} == {}


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


FORBIDDEN_EDGES = [
    # (importer, imported): dependencies point one way (docs/architecture.md).
    (("kvstore",), ("service",)),
    (("service",), ("kvstore.client", "kvstore.cli", "kvstore.integrations")),
    (("kvstore.pool",), ("kvstore.client", "kvstore.cli", "kvstore.integrations")),
    (("kvstore.api", "kvstore.ops"), ("kvstore.client", "kvstore.cli", "kvstore.integrations")),
    (("kvstore.client",), ("kvstore.cli", "kvstore.integrations")),
    (("kvstore.cli",), ("kvstore.client", "kvstore.integrations")),
]


def test_dependencies_point_one_way(graph: dict[str, set[str]]) -> None:
    upward = {
        (m, t)
        for m, targets in graph.items()
        for t in targets
        for importers, imported in FORBIDDEN_EDGES
        if _in(m, *importers) and _in(t, *imported)
    }
    assert upward == set()


def test_no_file_over_500_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}


MAP = ROOT / "docs" / "architecture.md"


def _mapped_files() -> set[str]:
    """The files the map names, as paths from the repository root.

    The map is the first fenced block after the "## Packages" heading of
    docs/architecture.md. A line's first column is its text up to the first
    gap of two or more spaces. A line names something when every word of that
    column is a file (``*.py``) or when the column is one folder (``name/``);
    any other line (a description carried over, the proto file) is skipped.
    Names are relative to the nearest folder line above with less indentation,
    so ``api/wire.py`` under ``kvstore/`` is ``kvstore/api/wire.py``. A
    package's ``__init__.py`` is named by its folder's line.
    """
    text = MAP.read_text()
    block = text[text.index("## Packages") :].split("```")[1]
    folders: list[tuple[int, str]] = []  # (indentation, path), innermost last
    named: set[str] = set()
    for line in block.splitlines():
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        words = re.split(r"\s{2,}", stripped, maxsplit=1)[0].split()
        is_folder = len(words) == 1 and words[0].endswith("/")
        if not words or not (is_folder or all(w.endswith(".py") for w in words)):
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = folders[-1][1] if folders else ""
        if is_folder:
            folders.append((indent, base + words[0]))
            named.add(base + words[0] + "__init__.py")
        else:
            named.update(base + w for w in words)
    return named


def test_every_module_is_on_the_map() -> None:
    modules = {str(path.relative_to(ROOT)) for path in _modules().values()}
    mapped = {m for m in _mapped_files() if not m.startswith("kvstore/v1/")}
    missing, stale = sorted(modules - mapped), sorted(mapped - modules)
    assert not missing, f"modules missing from docs/architecture.md: {missing}"
    assert not stale, f"names on docs/architecture.md's map that are not modules: {stale}"
