"""LMDB schema 5 adds the `policies` table: a version-4 data dir is refused by read-only tools until
a writer opens it, which adds the table empty and keeps every row."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from storage.errors import StorageError
from storage.lmdb import batches, policies
from storage.lmdb.store import SCHEMA_VERSION, Store


def test_a_schema_4_store_is_upgraded_with_no_policy(tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    with Store(path) as s, s.write() as txn:
        batches.store_batch(txn, s.tables, ["V1"], "task_a", b"a", 1)
    env = lmdb.open(str(path), max_dbs=32)  # as a schema-4 build left it: no policies table
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"policies", txn=txn), delete=True)
        txn.put(b"schema_version", b"4", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StorageError, match="predates schema 5"):
        Store(path, readonly=True)
    with Store(path) as s:
        assert s.schema_version == SCHEMA_VERSION >= 5
        assert [r.request_id for r in s.pending("V1")] == ["task_a"]
        with s.write() as txn:
            assert policies.all_policies(txn, s.tables) == []
            assert not policies.set_policy(txn, s.tables, request_id="task_a", doc=b"{}", now_ms=7, max_count=1)
    with Store(path, readonly=True) as s, s.read() as txn:
        [kept] = policies.all_policies(txn, s.tables)
        assert (kept.request_id, kept.doc, kept.set_ms) == ("task_a", b"{}", 7)
