"""The LMDB store on its own: group commit, map growth, failure isolation, read-only access."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

import lmdb
import pytest

from storage.errors import StorageFull
from storage.lmdb import batches
from storage.lmdb.store import SCHEMA_VERSION, Store
from storage.lmdb.writer import GroupCommitter


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = Store(tmp_path / "db", map_size_bytes=1 << 20, map_max_bytes=1 << 26)
    yield s
    s.close()


def batch_op(store: Store, vins: list[str], rid: str, blob: bytes, now: int = 1) -> batches.Op:  # type: ignore[name-defined]
    return functools.partial(batches.store_batch, t=store.tables, vins=vins, request_id=rid, blob=blob, now_ms=now)


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
        batches.store_batch(txn, store.tables, ["BAD1"], "task_a_1", b"half", 1)
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
    assert again.stats().rows == 2 and again.schema_version == SCHEMA_VERSION
    again.close()


def test_readonly_open_of_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    """`stats` on a directory without a store says so instead of creating one."""
    from storage.errors import StorageError

    with pytest.raises(StorageError, match="no sdv-fanout data"):
        Store(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()


def _index_matches_rows(store: Store) -> tuple[set[bytes], set[bytes]]:
    """(expiry keys, expiry keys the ids rows call for) from one snapshot."""
    from storage.lmdb import keys

    with store.read() as txn:
        index = {bytes(k) for k, _ in txn.cursor(store.tables.expiry)}
        wanted = {keys.expiry_key(keys.row_ts(v), bytes(k)) for k, v in txn.cursor(store.tables.ids)}
    return index, wanted


def test_expiry_index_matches_rows_whatever_the_timestamps(store: Store) -> None:
    """Same-millisecond, older (clock stepped back), replacing and duplicate-VIN batches leave one
    expiry entry per row, at the row's timestamp, and nothing else."""
    writer = GroupCommitter(store)
    plan = [
        (["B", "D", "F"], "task_a_1", 100),
        (["A", "C", "E", "G"], "task_a_2", 100),  # same ms, keys interleave with the previous batch
        (["A", "Z"], "task_a_3", 50),  # clock stepped back: all below the last expiry key
        (["C", "Y"], "task_a_1", 120),  # C is new for task_a_1, Y new, at a later time
        (["B", "D"], "task_a_1", 90),  # replaces B and D of task_a_1 with an older timestamp
        (["Q", "Q", "R"], "task_a_4", 130),  # a repeated VIN (the parser folds these; ops must not break)
    ]
    for vins, rid, at in plan:
        writer.submit(batch_op(store, vins, rid, b"p", now=at)).result(10)
    writer.close()
    index, wanted = _index_matches_rows(store)
    assert index == wanted
    assert len(index) == store.row_count() == 13
    assert [r.ts_ms for r in store.pending("B")] == [90]


def test_replacement_is_counted_once_per_existing_row(store: Store) -> None:
    """A batch reusing (VIN, request_id) pairs reports how many rows it replaced."""
    writer = GroupCommitter(store)
    first = writer.submit(batch_op(store, ["V1", "V2"], "task_a_1", b"one", now=10)).result(10)
    again = writer.submit(batch_op(store, ["V2", "V3", "V1"], "task_a_1", b"two", now=20)).result(10)
    writer.close()
    assert (first.replaced, again.replaced) == (0, 2)
    assert again.vins == ("V2", "V3", "V1")
    assert {r.vin: r.ts_ms for r in (store.pending("V1") + store.pending("V2") + store.pending("V3"))} == {
        "V1": 20,
        "V2": 20,
        "V3": 20,
    }


def test_lazy_ops_wait_for_company_then_commit_alone(store: Store) -> None:
    """Lazy ops share one commit: they join the next durable group at once, or go together
    once the oldest has waited the delay; close() commits what is still parked."""
    # The 50 submits, and the durable submit behind `parked`, must each fit in the delay: 1 s,
    # so that a loaded machine pausing this thread does not split them into two commits.
    writer = GroupCommitter(store, lazy_delay_s=1.0)
    lazy = [writer.submit(batch_op(store, [f"L{i}"], "task_a_1", b"x"), lazy=True) for i in range(50)]
    done = [f.result(10) for f in lazy]  # the delay passes: committed without any durable op
    assert [d.rows for d in done] == [1] * 50
    assert writer.commits == 1, "50 lazy ops, one commit"

    parked = writer.submit(batch_op(store, ["P"], "task_a_1", b"y"), lazy=True)
    durable = writer.submit(batch_op(store, ["D"], "task_a_1", b"z"))
    assert durable.result(10).rows == 1
    assert parked.done(), "a lazy op rides along with the durable group behind it"
    assert writer.commits == 2

    last = GroupCommitter(store, lazy_delay_s=60)
    late = last.submit(batch_op(store, ["LATE"], "task_a_1", b"w"), lazy=True)
    assert not late.done()
    last.close()
    assert late.result(0).rows == 1
    writer.close()
    assert store.stats().rows == 53


def test_acked_row_is_hidden_until_its_lazy_delete_commits(store: Store) -> None:
    """StoreRows over the real store: an ack hides the row from `oldest` at once, so the next
    row is served before the delete commits; a duplicate ack starts nothing; a row replaced
    by another payload since is not hidden."""
    from exhook_server.backends.lmdb.rows import StoreRows

    writer = GroupCommitter(store, lazy_delay_s=60)  # nothing lazy commits before close()
    for rid, blob, ts in (("task_a_1", b"one", 1), ("task_a_2", b"two", 2), ("task_a_3", b"three", 3)):
        writer.submit(batch_op(store, ["VIN1"], rid, blob, now=ts)).result(10)
    rows = StoreRows(store, writer)
    first = rows.oldest("VIN1")
    assert first is not None and first[0].request_id == "task_a_1"
    digest = hashlib.sha1(b"one").digest()
    assert rows.ack("VIN1", "task_a_1", digest) is True
    assert rows.ack("VIN1", "task_a_1", digest) is False, "duplicate PUBACK"
    assert rows.ack("VIN1", "task_a_2", hashlib.sha1(b"other").digest()) is False, "not that payload"
    nxt = rows.oldest("VIN1")
    assert nxt is not None and nxt[0].request_id == "task_a_2"
    assert store.row("VIN1", "task_a_1") is not None, "the delete is not committed yet"
    # The platform re-sends task_a_1 with new data before the delete commits: deliver it.
    writer.submit(batch_op(store, ["VIN1"], "task_a_1", b"new", now=0)).result(10)
    again = rows.oldest("VIN1")
    assert again is not None and again[0].request_id == "task_a_1" and again[1] == b"new"
    writer.close()
    assert store.row("VIN1", "task_a_1") is not None, "the replaced row survives the old ack"
    assert rows.deleting() == 0


def test_queue_head_is_the_prefix_of_the_sorted_queue(store: Store) -> None:
    """The one pass of `queue_head` agrees with the sorted queue, whatever the mix of
    timestamps and request ids (non-ASCII ones too)."""
    import random

    rng = random.Random(7)
    writer = GroupCommitter(store)
    rids = [f"task_{c}_{n}" for c in ("a", "b", "ü", "z") for n in range(6)]
    for step in range(60):
        rid = rng.choice(rids)
        blob = f"blob {rng.randrange(5)}".encode()
        writer.submit(batch_op(store, ["VIN1", "VIN2"], rid, blob, now=rng.randrange(4))).result(10)
        queue = store.pending("VIN1")
        for n in (1, 3, 100):
            assert store.queue_head("VIN1", n) == (queue[:n], len(queue)), f"step {step}"
    assert store.queue_head("VIN0", 5) == ([], 0)
    writer.close()


def test_long_queue_drains_in_order_with_a_pass_per_head(store: Store) -> None:
    """A vehicle with 200 pending rows is drained oldest first with a pass over its queue per
    quarter of it, not one per delivery; rows stored meanwhile go after, a row replaced meanwhile
    goes at its new place, and a row expired meanwhile is skipped."""
    from exhook_server.backends.lmdb.rows import StoreRows

    writer = GroupCommitter(store, lazy_delay_s=0.0)
    for i in range(200):
        writer.submit(batch_op(store, ["VIN1"], f"task_a_{i:03d}", f"p{i % 7}".encode(), now=1000 + i)).result(10)
    rows = StoreRows(store, writer)
    delivered: list[str] = []
    for step in range(400):
        found = rows.oldest("VIN1")
        if found is None:
            break
        row, payload = found
        delivered.append(row.request_id)
        assert rows.ack("VIN1", row.request_id, hashlib.sha1(payload).digest())
        if step == 10:
            writer.submit(batch_op(store, ["VIN1"], "task_new_1", b"late", now=5000)).result(10)
            writer.submit(batch_op(store, ["VIN1"], "task_a_020", b"again", now=5001)).result(10)
            writer.submit(
                functools.partial(
                    batches.delete_row_if,
                    t=store.tables,
                    vin="VIN1",
                    request_id="task_a_030",
                    sha1=hashlib.sha1(b"p2").digest(),
                )
            ).result(10)
    expected = [f"task_a_{i:03d}" for i in range(200) if i not in (20, 30)] + ["task_new_1", "task_a_020"]
    assert delivered == expected
    # A pass per delivery would read ~20,000 rows (200 + 199 + ...); two passes per head (a
    # quarter of the queue) read each row a few times, plus the short tail (at most 32 rows
    # per delivery).
    assert rows.rows_scanned <= 4 * 200 + 32 * 32, rows.rows_scanned
    writer.close()
    assert store.row_count() == 0


def test_a_kept_queue_head_is_overtaken_by_high_priority_rows(store: Store) -> None:
    """A long queue's kept head is read again when a high-priority row is stored (its batch asked
    it) or the requests whose policy says high change: the high rows go next, oldest first, and
    the normal rows follow in their order."""
    from exhook_server.backends.lmdb.rows import StoreRows
    from storage.model import FLAG_HIGH_PRIORITY, RowSpec

    writer = GroupCommitter(store, lazy_delay_s=0.0)
    for i in range(100):
        writer.submit(batch_op(store, ["VIN1"], f"task_a_{i:03d}", f"p{i}".encode(), now=1000 + i)).result(10)
    rows = StoreRows(store, writer)
    delivered: list[str] = []
    high = frozenset[str]()

    def deliver() -> None:
        found = rows.oldest("VIN1", None, high)
        assert found is not None
        delivered.append(found[0].request_id)
        assert rows.ack("VIN1", found[0].request_id, hashlib.sha1(found[1]).digest())

    for _ in range(3):
        deliver()
    spec = RowSpec(flags=FLAG_HIGH_PRIORITY)
    op = functools.partial(
        batches.store_batch, t=store.tables, vins=["VIN1"], request_id="task_r_1", blob=b"r", spec=spec
    )
    writer.submit(functools.partial(op, now_ms=5000)).result(10)
    deliver()
    high = frozenset({"task_a_090"})  # its policy says high now
    deliver()
    deliver()
    assert delivered == ["task_a_000", "task_a_001", "task_a_002", "task_r_1", "task_a_090", "task_a_003"]
    assert store.high_rows_stored() == 1
    writer.close()
    assert [r.request_id for r in store.pending("VIN1")][:1] == ["task_a_004"]
