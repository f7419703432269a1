"""Fixtures for tests that use the store directly (no server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Store, GroupCommitter]]:
    """A fresh store on tmp_path and its group committer, both closed after the test."""
    store = Store(tmp_path / "db")
    writer = GroupCommitter(store)
    yield store, writer
    writer.close()
    store.close()
