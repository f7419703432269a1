"""The docs cite only what is in the repository: paths, `module.attr` names, SQL functions, and
other docs; the README's project layout names every module."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from storage.postgres import constants
from testkit.harness import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Top-level folders whose paths the docs cite in `code font`.
TOP = ("bench", "demo", "deploy", "docs", "exhook_server", "proto", "spark", "storage", "tests")
PACKAGES = ("exhook_server", "storage")
#: Where a doc may be cited from (code, SQL, docs, manifests).
SOURCES = ("*.py", "*.md", "*.sql", "*.yaml", "*.conf", "*.toml")
#: The background notes beside the repository (spelled so this file does not match itself).
OUTSIDE = "/".join(("shared", "docs"))
#: What the README's project layout lists one line each.
MODULES = (
    "exhook_server/*.py",
    "exhook_server/dispatch/*.py",
    "storage/*.py",
    "storage/postgres/*.py",
    "storage/postgres/sql/*.sql",
    "storage/postgres/sql/*/*.sql",
)
SKIP_DIRS = {".git", ".venv", "node_modules", "var", "__pycache__"}


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\s]+)`", text)


def _repo_files(pattern: str) -> list[Path]:
    return [p for p in ROOT.rglob(pattern) if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)]


def _resolves(dotted: str) -> bool | None:
    """True/False whether `pkg.module.attr...` exists; None when it is no code name (a package
    plus one word, e.g. a YAML key like `storage.size`)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        if cut == 1 and len(parts) == 2 and not hasattr(obj, parts[1]):
            return None
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_paths_exist(doc: Path) -> None:
    """Every repo path in `code font` and every relative markdown link exists."""
    text = doc.read_text()
    missing = []
    for span in _code_spans(text):
        path_like = span.split("/")[0] in TOP and "/" in span and not re.search(r"[<{$]", span)
        if path_like and not list(ROOT.glob(span.rstrip("/"))):
            missing.append(span)
    for link in re.findall(r"\]\(([^)#\s]+)", re.sub(r"`[^`]*`", "", text)):
        if not link.startswith(("http://", "https://", "mailto:")) and not (doc.parent / link).exists():
            missing.append(link)
    assert not missing, f"{doc.name} cites what is not in the repository: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_code_names_exist(doc: Path) -> None:
    """Every `exhook_server.…` / `storage.…` name resolves; every `sdv_*` SQL function (not the
    `sdv_fanout_*` metrics) is defined."""
    text = doc.read_text()
    sql = "\n".join([*(p.read_text() for p in (ROOT / "storage").rglob("*.sql")), constants.function_sql()])
    defined = set(re.findall(r"FUNCTION\s+(sdv_\w+)", sql))
    bad = [
        span
        for span in _code_spans(text)
        if re.fullmatch(rf"(?:{'|'.join(PACKAGES)})(?:\.\w+)+", span) and _resolves(span) is False
    ]
    bad += [span for span in _code_spans(text) if re.fullmatch(r"sdv_(?!fanout_)\w+", span) and span not in defined]
    assert not bad, f"{doc.name} names code that does not exist: {bad}"


def test_every_cited_doc_is_in_the_repository() -> None:
    """A `something.md` named in code, SQL, manifests or docs is a file of the repository, and
    nothing points outside it (the background notes next to the repository are not part of it)."""
    docs = {p.name for p in _repo_files("*.md")}
    bad = []
    for pattern in SOURCES:
        for path in _repo_files(pattern):
            text = path.read_text(errors="replace")
            rel = path.relative_to(ROOT)
            if path == Path(__file__):
                continue
            if OUTSIDE in text:
                bad.append(f"{rel}: cites {OUTSIDE}")
            for name in set(re.findall(r"[\w.-]+\.md\b", text)):
                if Path(name).name not in docs:
                    bad.append(f"{rel}: {name}")
    assert not bad, bad


def test_readme_layout_lists_every_module() -> None:
    """The README's project layout has a line for every product module."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Project layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([\w/]+\.(?:py|sql))`", layout))
    modules = [
        p.relative_to(ROOT).as_posix()
        for pattern in MODULES
        for p in ROOT.glob(pattern)
        if p.name != "__init__.py"  # a package is listed as its folder
    ]
    missing = sorted(m for m in modules if m not in listed)
    assert not missing, f"README project layout lacks {missing}"
