"""The LMDB store on its own: group commit, map growth, failure isolation, read-only access."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

import lmdb
import pytest

from storage import ops
from storage.errors import StorageFull
from storage.store import Store
from storage.writer import GroupCommitter


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = Store(tmp_path / "db", map_size_bytes=1 << 20, map_max_bytes=1 << 26)
    yield s
    s.close()


def batch_op(store: Store, vins: list[str], rid: str, blob: bytes, now: int = 1) -> ops.Op:  # type: ignore[name-defined]
    return functools.partial(ops.store_batch, t=store.tables, vins=vins, request_id=rid, blob=blob, now_ms=now)


def test_concurrent_ops_share_commits(store: Store) -> None:
    """Ops submitted together are committed in fewer transactions than ops (group commit)."""
    writer = GroupCommitter(store)
    gate = threading.Event()
    # Hold the writer inside a first op so the others pile up behind it.
    first = writer.submit(lambda txn: gate.wait(10))
    futures = [writer.submit(batch_op(store, [f"V{i}"], "task_a_1", b"x")) for i in range(200)]
    gate.set()
    assert first.result(10)
    assert all(f.result(10).rows == 1 for f in futures)
    assert writer.ops_committed == 201
    assert writer.commits <= 3
    writer.close()
    assert store.stats().rows == 200


def test_failing_op_leaves_no_trace_and_spares_the_others(store: Store) -> None:
    """An op that raises half-way is rolled back alone; the ops grouped with it commit."""
    writer = GroupCommitter(store)
    gate = threading.Event()
    writer.submit(lambda txn: gate.wait(10))

    def half_then_fail(txn: lmdb.Transaction) -> None:
        ops.store_batch(txn, store.tables, ["BAD1"], "task_a_1", b"half", 1)
        raise RuntimeError("boom")

    good1 = writer.submit(batch_op(store, ["GOOD1"], "task_a_1", b"one"))
    bad = writer.submit(half_then_fail)
    good2 = writer.submit(batch_op(store, ["GOOD2"], "task_a_1", b"two"))
    gate.set()
    assert good1.result(10).rows == good2.result(10).rows == 1
    with pytest.raises(RuntimeError, match="boom"):
        bad.result(10)
    writer.close()
    assert store.pending("BAD1") == []
    assert store.blob(hashlib.sha1(b"half").digest()) is None
    assert store.stats().rows == 2


def test_map_grows_when_full(store: Store) -> None:
    """Writing more than the initial map holds grows the map instead of failing."""
    writer = GroupCommitter(store)
    start = store.map_size()
    for i in range(8):
        writer.submit(batch_op(store, [f"V{i}"], "task_a_1", os.urandom(400_000))).result(10)
    writer.close()
    assert store.map_size() > start
    assert store.stats().blobs == 8


def test_full_map_fails_cleanly(tmp_path: Path) -> None:
    """At map_max_bytes the op fails with StorageFull; the store stays usable for reads."""
    s = Store(tmp_path / "db", map_size_bytes=1 << 20, map_max_bytes=1 << 20)
    writer = GroupCommitter(s)
    writer.submit(batch_op(s, ["V0"], "task_a_1", b"small")).result(10)
    with pytest.raises(StorageFull):
        writer.submit(batch_op(s, ["V1"], "task_a_1", os.urandom(2 << 20))).result(10)
    writer.close()
    assert [r.request_id for r in s.pending("V0")] == ["task_a_1"]
    s.close()


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    """Data committed before close is there after reopening; the schema version is checked."""
    s = Store(tmp_path / "db")
    w = GroupCommitter(s)
    w.submit(batch_op(s, ["V1", "V2"], "task_a_1", b"keep")).result(10)
    w.close()
    s.close()
    again = Store(tmp_path / "db", readonly=True)
    assert again.stats().rows == 2 and again.schema_version == 1
    again.close()


def test_readonly_open_of_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    """`stats` on a directory without a store says so instead of creating one."""
    from storage.errors import StorageError

    with pytest.raises(StorageError, match="no sdv-fanout data"):
        Store(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()
