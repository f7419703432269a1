"""Who may import which engine: the shared vocabulary imports neither `lmdb` nor `asyncpg`, and
the PostgreSQL store imports no module of the LMDB store.

Read from the source with `ast` (every import of a module, lazy ones included), following
`storage.*` imports transitively, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STORAGE = ROOT / "storage"
ENGINES = frozenset({"lmdb", "asyncpg"})
#: Modules both stores build on: neither engine may be reachable from them.
SHARED = ("storage.model", "storage.errors", "storage.port", "storage.export_format")


def _path(module: str) -> Path | None:
    """The file of a module of the repository, or None for a third-party one."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _packages(module: str) -> list[str]:
    """`module` and the packages importing it imports first (storage.pg.x: storage, storage.pg)."""
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
                if _path(sub) is not None:  # `from storage import keys` imports storage.keys
                    found.add(sub)
    found.discard(module)
    return frozenset(found)


@functools.cache
def reachable(module: str) -> frozenset[str]:
    """Every module importing `module` may import: repository modules followed, others as leaves."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in direct_imports(todo.pop()):
            if name in seen:
                continue
            seen.add(name)
            if name.startswith("storage") and _path(name) is not None:
                todo.append(name)
    return frozenset(seen)


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def storage_modules() -> list[str]:
    return sorted(_module(p) for p in STORAGE.rglob("*.py"))


def engines_of(module: str) -> set[str]:
    return {name.split(".")[0] for name in reachable(module)} & ENGINES


def lmdb_modules() -> set[str]:
    """Modules of the LMDB store: the storage modules outside storage.pg that reach `lmdb`."""
    return {
        m for m in storage_modules() if not m.startswith("storage.pg") and m != "storage" and "lmdb" in engines_of(m)
    }


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_import_no_engine(module: str) -> None:
    assert _path(module) is not None, module
    assert engines_of(module) == set(), f"{module} reaches {sorted(engines_of(module))}"


def test_the_lmdb_store_is_found() -> None:
    # A check that found no LMDB module would prove nothing below.
    lmdb = lmdb_modules()
    assert {"storage.store", "storage.ops", "storage.outcomes", "storage.writer"} <= lmdb
    assert lmdb.isdisjoint(SHARED)


@pytest.mark.parametrize("module", [m for m in storage_modules() if m.startswith("storage.pg")])
def test_postgres_store_imports_no_lmdb_module(module: str) -> None:
    reached = reachable(module)
    assert "lmdb" not in {name.split(".")[0] for name in reached}, f"{module} reaches lmdb"
    assert reached.isdisjoint(lmdb_modules()), f"{module} imports {sorted(reached & lmdb_modules())}"
