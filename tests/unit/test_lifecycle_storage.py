"""The lifecycle indexes (schema 3) always agree with the rows, whatever path ends them.

`by_request` names exactly the pending (request, VIN) pairs, `deadlines` exactly the rows with
an expiry, `backlogs` exactly each vehicle's row count; cancel, expiry, acks, replacement,
retention and the backlog bound all keep them so, and counts still equal a recount.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.lmdb import batches, cancel, gc, keys, outcomes, queue
from storage.lmdb.batches import RowSpec, sha1_of
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import SCHEMA_VERSION, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "lmdb") as s:
        yield s


def run(store: Store, op: Any, **kw: Any) -> Any:
    with store.write() as txn:
        return op(txn, t=store.tables, **kw)


def batch(store: Store, vins: list[str], rid: str, blob: bytes, now: int, **spec: Any) -> batches.BatchWritten:
    return run(  # type: ignore[no-any-return]
        store, batches.store_batch, vins=vins, request_id=rid, blob=blob, now_ms=now, spec=RowSpec(**spec)
    )


def assert_consistent(store: Store) -> None:
    """Every index entry matches a row and every row has its entries; counts equal a recount."""
    t = store.tables
    with store.read() as txn:
        rows = [keys.decode_row(k, v) for k, v in txn.cursor(t.ids)]
        by_request = {bytes(k) for k in txn.cursor(t.by_request).iternext(values=False)}
        deadlines = {bytes(k) for k in txn.cursor(t.deadlines).iternext(values=False)}
        backlogs = {bytes(k).decode(): queue.decode_count(v) for k, v in txn.cursor(t.backlogs)}
        expiry = {bytes(k) for k in txn.cursor(t.expiry).iternext(values=False)}
        recounted = outcomes.recount(txn, t)
        stored = {(g.request_id, g.sha1): g.counts for g in outcomes.all_generations(txn, t)}
    assert by_request == {keys.request_index_key(r.vin, r.request_id) for r in rows}
    assert deadlines == {keys.deadline_key(r.expires_ms, r.vin, r.request_id) for r in rows if r.expires_ms}
    assert expiry == {keys.expiry_key(r.ts_ms, keys.row_key(r.vin, r.request_id)) for r in rows}
    # A count for each vehicle with at least COUNTED_FROM rows, none for the others.
    assert backlogs == {v: n for v, n in Counter(r.vin for r in rows).items() if n >= queue.COUNTED_FROM}
    for vin, n in Counter(r.vin for r in rows).items():
        with store.read() as txn:
            assert queue.backlog(txn, t, vin.encode()) == n
    assert {k: v for k, v in stored.items() if v["total"]} == recounted


def test_random_work_keeps_every_index_exact(store: Store) -> None:
    """Batches (some expiring, some answering, some refused at the bound), acks, answers, cancels
    of some and of all (in chunks), expiry sweeps and retention: the indexes stay exact."""
    rng = random.Random(13)
    now = 1_000_000
    for step in range(500):
        now += rng.randint(1, 30)
        vins = [f"V{rng.randrange(12)}" for _ in range(rng.randint(1, 5))]
        rid = f"task_t_{rng.randrange(6)}"
        blob = bytes([rng.randrange(3)])
        roll = rng.random()
        if roll < 0.45:
            expires = now + rng.randint(1, 400) if rng.random() < 0.4 else 0
            batch(store, vins, rid, blob, now, expires_ms=expires, flags=rng.randrange(2), max_pending=4)
        elif roll < 0.65:
            outcome = rng.choice([Outcome.DELIVERED, Outcome.RESPONDED, Outcome.FAILED])
            run(
                store,
                batches.delete_row_if,
                vin=vins[0],
                request_id=rid,
                sha1=sha1_of(blob),
                now_ms=now,
                outcome=outcome,
            )
        elif roll < 0.75:
            run(store, cancel.cancel_vins, request_id=rid, vins=vins, now_ms=now)
        elif roll < 0.82:
            chunk = run(store, cancel.start_cancel_all, request_id=rid, now_ms=now, max_rows=3)
            while chunk.more and rng.random() < 0.8:  # sometimes left half done, as by a crash
                chunk = run(store, cancel.cancel_chunk, request_id=rid, now_ms=now, max_rows=3)
        elif roll < 0.95:
            run(store, queue.expire_due, now_ms=now, limit=rng.randint(1, 10))
        else:
            run(store, gc.expire_rows, cutoff_ms=now - 2_000, limit=50)
        if step % 50 == 0:
            assert_consistent(store)
    assert_consistent(store)


def test_the_bound_refuses_new_rows_but_not_replacements(store: Store) -> None:
    """At max_pending a VIN gets no new row (and nothing of it is written); a new version of a
    request it holds replaces in place."""
    batch(store, ["V1"], "task_a_1", b"a", 1, max_pending=2)
    batch(store, ["V1"], "task_b_1", b"b", 2, max_pending=2)
    written = batch(store, ["V1", "V2"], "task_c_1", b"c", 3, max_pending=2)
    assert written.refused == ("V1",) and written.vins == ("V2",)
    replaced = batch(store, ["V1"], "task_b_1", b"b2", 4, max_pending=2)
    assert replaced.refused == () and replaced.replaced == 1
    assert store.backlog("V1") == 2 and store.vehicles_at(2) == 1
    assert_consistent(store)


def test_an_expiring_row_is_invisible_to_the_queue_once_past(store: Store) -> None:
    """The queue passes over a row past its expires_at at once; the sweep then ends it expired."""
    far = 10_000_000_000_000  # year 2286: the store's wall clock is before it
    batch(store, ["V1"], "task_a_1", b"a", 1_000, expires_ms=far)
    found, _ = store.oldest("V1")
    assert found is not None and found[0].expires_ms == far  # not yet past by the wall clock
    past = batch(store, ["V2"], "task_b_1", b"b", 1_000, expires_ms=1_001)
    assert past.rows == 1
    assert store.oldest("V2") == (None, 0)
    ended = run(store, queue.expire_due, now_ms=2_000, limit=10)
    assert ended == [("V2", "task_b_1", sha1_of(b"b"))]
    assert_consistent(store)


def test_a_cancel_takes_rows_stored_up_to_its_cut_and_not_later_ones(store: Store) -> None:
    """A cancel of every vehicle in progress: a batch of the same request stored after it is
    stamped past the cut, so later chunks leave it alone, and the queue offers it."""
    batch(store, [f"V{n}" for n in range(6)], "task_a_1", b"old", 1_000)
    first = run(store, cancel.start_cancel_all, request_id="task_a_1", now_ms=1_000, max_rows=2)
    assert first.more and len(first.cancelled) == 2
    assert store.oldest("V5") == (None, 0)  # still pending, but the cancel in progress hides it
    batch(store, ["V4", "V5"], "task_a_1", b"new", 1_000)  # same ms as the cut
    chunk = first
    while chunk.more:
        chunk = run(store, cancel.cancel_chunk, request_id="task_a_1", now_ms=1_001, max_rows=2)
    # All six old rows end cancelled: V0..V3 by the walk, V4 and V5 when the new version replaced
    # them (the cut had taken them already); the new version, stored after the cut, stays.
    assert chunk.total == 6
    assert store.outcome("V5", "task_a_1", sha1_of(b"old")) is Outcome.CANCELLED
    assert [r.request_id for r in store.pending("V5")] == ["task_a_1"]
    assert store.oldest("V5")[0] is not None
    assert_consistent(store)


def test_a_puback_of_a_cancelled_delivery_amends_its_outcome(store: Store) -> None:
    """Cancelled while out, then PUBACKed: the outcome becomes delivered, counted so."""
    batch(store, ["V1"], "task_a_1", b"a", 1_000)
    run(store, cancel.cancel_vins, request_id="task_a_1", vins=["V1"], now_ms=1_001)
    assert store.outcome("V1", "task_a_1", sha1_of(b"a")) is Outcome.CANCELLED
    assert run(store, batches.delete_row_if, vin="V1", request_id="task_a_1", sha1=sha1_of(b"a"), now_ms=1_002)
    assert store.outcome("V1", "task_a_1", sha1_of(b"a")) is Outcome.DELIVERED
    # A second PUBACK changes nothing more.
    assert not run(store, batches.delete_row_if, vin="V1", request_id="task_a_1", sha1=sha1_of(b"a"), now_ms=1_003)
    assert_consistent(store)


def test_a_schema_2_store_is_upgraded_with_its_indexes_built(tmp_path: Path) -> None:
    """Opening a version-2 store for writing fills by_request and backlogs from its rows."""
    path = tmp_path / "lmdb"
    with Store(path) as s:
        batch(s, ["V1", "V2"], "task_a_1", b"a", 1_000)
        batch(s, ["V1"], "task_b_1", b"b", 1_001)
        with s.write() as txn:
            for table in (s.tables.by_request, s.tables.backlogs):
                txn.drop(table, delete=False)
            txn.put(b"schema_version", b"2", db=s.tables.meta)
    with Store(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert s.backlog("V1") == 2 and s.backlog("V2") == 1
        assert_consistent(s)


def test_cancelling_a_cancelled_pair_again_changes_no_count(store: Store) -> None:
    """delete_row_if(outcome=cancelled) on a pair already cancelled amends nothing (the counts
    once moved a pair from cancelled to cancelled and lost the decrement)."""
    batch(store, ["V1"], "task_a_1", b"a", 1_000)
    run(store, cancel.cancel_vins, request_id="task_a_1", vins=["V1"], now_ms=1_001)
    args = {"vin": "V1", "request_id": "task_a_1", "sha1": sha1_of(b"a"), "now_ms": 1_002}
    assert not run(store, batches.delete_row_if, outcome=Outcome.CANCELLED, **args)
    assert_consistent(store)


def test_a_long_queue_is_counted_from_counted_from_on_and_bounded_exactly(store: Store) -> None:
    """Below COUNTED_FROM a vehicle's rows are counted where they lie; from it on in `backlogs`;
    the bound holds either way, and the count goes away again as the queue drains."""
    n = queue.COUNTED_FROM
    for i in range(n + 8):
        written = batch(store, ["V1", "V2"], f"task_t_{i}", b"x", 1_000 + i, max_pending=n + 5)
        assert written.refused == (("V1", "V2") if i >= n + 5 else ())
    assert store.backlog("V1") == n + 5 and store.vehicles_at(n + 5) == 2 and store.vehicles_at(3) == 2
    assert_consistent(store)
    for i in range(10):
        run(store, batches.delete_row_if, vin="V1", request_id=f"task_t_{i}", sha1=sha1_of(b"x"), now_ms=5_000)
    assert store.backlog("V1") == n - 5
    with store.read() as txn:
        assert txn.get(b"V1", db=store.tables.backlogs) is None  # below COUNTED_FROM: no entry
    assert_consistent(store)


def test_the_lost_blob_fallback_passes_over_expired_rows_too(store: Store) -> None:
    """When the oldest row's blob is gone (lost data), the queue walk that follows still skips a
    row past its expires_at, as the first pass does."""
    batch(store, ["V1"], "task_a_1", b"lost", 1_000)
    batch(store, ["V1"], "task_b_1", b"stale", 1_001, expires_ms=1_002)
    batch(store, ["V1"], "task_c_1", b"good", 1_003)
    with store.write() as txn:
        txn.delete(sha1_of(b"lost"), db=store.tables.data)
    found, _ = store.oldest("V1")
    assert found is not None and found[0].request_id == "task_c_1"
