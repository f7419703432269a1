"""Static checks run as tests, so `make test` (and CI) fail on lint or type errors too."""

from __future__ import annotations

import subprocess

from testkit.harness import BIN, ROOT


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    """ruff lint passes on the whole tree."""
    out = _run(str(BIN / "ruff"), "check", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_on_the_packages() -> None:
    """mypy --strict (setup.cfg) passes on the product: exhook_server, storage and spark."""
    out = _run(str(BIN / "mypy"), "exhook_server", "storage", "spark")
    assert out.returncode == 0, out.stdout + out.stderr
