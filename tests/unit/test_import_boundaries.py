"""Who may import which engine, and no import circle among the product's modules.

Only `storage/lmdb/` imports `lmdb`, only `storage/postgres/` imports `asyncpg`; the shared
vocabulary reaches neither; the PostgreSQL store imports no module of the LMDB store. Read from the
source with `ast` (every import of a module, lazy ones included), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("exhook_server", "storage")
ENGINES = {"lmdb": "storage.lmdb", "asyncpg": "storage.postgres"}
#: Modules both stores build on: neither engine may be reachable from them.
SHARED = ("storage.model", "storage.errors", "storage.port", "storage.export_format", "storage.plan")


def _path(module: str) -> Path | None:
    """The file of a module of the repository, or None for a third-party one."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _packages(module: str) -> list[str]:
    """`module` and the packages importing it imports first (storage.postgres.x: storage, storage.postgres)."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@functools.cache
def direct_imports(module: str) -> frozenset[str]:
    """Every module `module` names in an import statement, anywhere in its file."""
    path = _path(module)
    assert path is not None, module
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.update(_packages(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.update(_packages(node.module))
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if _path(sub) is not None:  # `from storage.lmdb import keys` imports storage.lmdb.keys
                    found.add(sub)
    found.discard(module)
    return frozenset(found)


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def product_modules() -> list[str]:
    return sorted(_module(p) for top in PRODUCT for p in (ROOT / top).rglob("*.py") if "_proto" not in p.parts)


def _ours(name: str) -> bool:
    return name.split(".")[0] in PRODUCT and _path(name) is not None


@functools.cache
def reachable(module: str) -> frozenset[str]:
    """Every module importing `module` may import: repository modules followed, others as leaves."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in direct_imports(todo.pop()):
            if name not in seen:
                seen.add(name)
                if _ours(name):
                    todo.append(name)
    return frozenset(seen)


def _engines(names: frozenset[str]) -> set[str]:
    return {name.split(".")[0] for name in names} & set(ENGINES)


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_reach_no_engine(module: str) -> None:
    assert _path(module) is not None, module
    assert _engines(reachable(module)) == set(), f"{module} reaches {sorted(_engines(reachable(module)))}"


def test_each_engine_is_imported_by_its_store_only() -> None:
    found = {m: _engines(direct_imports(m)) for m in product_modules()}
    assert any("lmdb" in e for e in found.values()) and any("asyncpg" in e for e in found.values())
    wrong = sorted(
        (m, engine) for m, engines in found.items() for engine in engines if not m.startswith(ENGINES[engine])
    )
    assert wrong == []


@pytest.mark.parametrize("module", [m for m in product_modules() if m.startswith("storage.postgres")])
def test_postgres_store_imports_no_lmdb_module(module: str) -> None:
    reached = reachable(module)
    assert "lmdb" not in _engines(reached), f"{module} reaches lmdb"
    assert not any(name.startswith("storage.lmdb") for name in reached), f"{module} imports the LMDB store"


def test_no_import_circle() -> None:
    """Tarjan's strongly connected components over product modules: every one a single module."""
    modules = product_modules()
    edges = {m: sorted(n for n in direct_imports(m) if _ours(n) and n != m and n not in _packages(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
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
                circles.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    assert circles == []


def test_a_server_process_loads_no_export_library() -> None:
    """pyarrow (and numpy behind it) costs a server process about 55 MiB of RSS it never uses: only
    the tools export or apply GC plans, so the server, its process group and the CLI import it lazily."""
    code = (
        "import sys, exhook_server.server, exhook_server.procs, exhook_server.cli; "
        "print(sorted(m for m in ('pyarrow', 'numpy', 'pyspark') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
