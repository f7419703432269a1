"""Retention and GC on a real LMDB store: what goes, what stays, and the mark/delete race."""

from __future__ import annotations

import functools
import hashlib
import random
import threading

from storage.lmdb import batches, gc, keys, parked
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from testkit.harness import put

HOUR = 3_600_000
DAY = 24 * HOUR
NOW = 100 * DAY


def run(store: Store, writer: GroupCommitter, *, dry_run: bool = False, now: int = NOW) -> gc.GcReport:
    return gc.collect(
        store, writer.submit, now_ms=now, retention_ms=7 * DAY, grace_ms=HOUR, early_ttl_ms=HOUR, dry_run=dry_run
    )


def dangling_rows(store: Store) -> list[str]:
    with store.read() as txn:
        return [
            f"{r.vin}/{r.request_id}"
            for r in (keys.decode_row(k, v) for k, v in txn.cursor(store.tables.ids))
            if txn.get(r.sha1, db=store.tables.data) is None
        ]


def test_rows_past_retention_go_younger_stay(env: tuple[Store, GroupCommitter]) -> None:
    """Rows older than the retention are deleted with their expiry entries; younger rows stay."""
    store, writer = env
    put(writer, store, ["OLD1", "OLD2"], "task_a_1", b"old", NOW - 8 * DAY)
    put(writer, store, ["NEW1"], "task_a_1", b"new", NOW - 6 * DAY)
    report = run(store, writer)
    assert report.rows_expired == 2
    assert store.pending("OLD1") == [] and len(store.pending("NEW1")) == 1
    with store.read() as txn:
        assert txn.stat(store.tables.expiry)["entries"] == 1


def test_blob_of_expired_rows_is_collected_in_the_same_pass(env: tuple[Store, GroupCommitter]) -> None:
    """A blob whose last rows expired is removed; a shared blob still referenced stays."""
    store, writer = env
    put(writer, store, ["A"], "task_a_1", b"only-old", NOW - 8 * DAY)
    put(writer, store, ["B"], "task_a_1", b"shared", NOW - 8 * DAY)
    put(writer, store, ["C"], "task_a_2", b"shared", NOW - 2 * DAY)
    report = run(store, writer)
    assert (report.rows_expired, report.blobs_deleted, report.blob_bytes_freed) == (2, 1, len(b"only-old"))
    assert store.blob(hashlib.sha1(b"shared").digest()) == b"shared"
    assert store.blob(hashlib.sha1(b"only-old").digest()) is None


def test_unreferenced_blob_within_grace_is_kept(env: tuple[Store, GroupCommitter]) -> None:
    """A blob nobody refers to survives while it is younger than the grace period."""
    store, writer = env
    put(writer, store, ["A"], "task_a_1", b"acked-recently", NOW - 10 * 60_000)
    digest = hashlib.sha1(b"acked-recently").digest()
    writer.submit(
        functools.partial(batches.delete_row_if, t=store.tables, vin="A", request_id="task_a_1", sha1=digest)
    ).result()
    assert run(store, writer).blobs_kept_recent == 1
    assert store.blob(digest) is not None
    assert run(store, writer, now=NOW + 2 * HOUR).blobs_deleted == 1


def test_blob_reused_between_mark_and_delete_is_kept(env: tuple[Store, GroupCommitter]) -> None:
    """The GC race: a batch reusing a garbage blob after the mark keeps it (touch rechecked)."""
    store, writer = env
    put(writer, store, ["A"], "task_a_1", b"reused", NOW - 8 * DAY)
    writer.submit(functools.partial(gc.expire_rows, t=store.tables, cutoff_ms=NOW - 7 * DAY, limit=100)).result()
    marked = gc.unreferenced_blobs(store)
    assert marked == [hashlib.sha1(b"reused").digest()]
    put(writer, store, ["B"], "task_a_1", b"reused", NOW)  # dedup hit: touches the blob
    deleted, _, kept = writer.submit(
        functools.partial(gc.delete_blobs, t=store.tables, candidates=marked, cutoff_ms=NOW - HOUR)
    ).result()
    assert (deleted, kept) == (0, 1)
    assert dangling_rows(store) == []


def test_alias_keeps_its_blob_until_it_expires(env: tuple[Store, GroupCommitter]) -> None:
    """Plugin-format data waiting for triggers is kept while its alias lives."""
    store, writer = env
    writer.submit(
        functools.partial(parked.store_data, t=store.tables, data_id="d1", blob=b"data", now_ms=NOW - 2 * DAY)
    ).result()
    assert run(store, writer).blobs_deleted == 0
    report = run(store, writer, now=NOW + 6 * DAY)
    assert (report.aliases_expired, report.blobs_deleted) == (1, 1)


def test_dry_run_changes_nothing_and_predicts_the_real_run(env: tuple[Store, GroupCommitter]) -> None:
    """--dry-run reports what a real pass then does, without deleting anything."""
    store, writer = env
    rng = random.Random(7)
    for n in range(200):
        put(
            writer,
            store,
            [f"V{rng.randrange(50)}"],
            f"task_a_{n % 7}",
            rng.choice([b"a", b"b", bytes([n])]),
            NOW - rng.randrange(10 * DAY),
        )
    before = store.stats()
    dry = run(store, writer, dry_run=True)
    assert store.stats() == before
    real = run(store, writer)
    assert (dry.rows_expired, dry.blobs_deleted, dry.aliases_expired) == (
        real.rows_expired,
        real.blobs_deleted,
        real.aliases_expired,
    )
    assert real.rows_expired > 0 and real.blobs_deleted > 0
    assert dangling_rows(store) == []


def test_gc_during_concurrent_ingest_never_orphans_a_row(env: tuple[Store, GroupCommitter]) -> None:
    """GC passes racing with ingest that reuses old blobs leave no row without its blob."""
    store, writer = env
    blobs = [bytes([i]) * 10 for i in range(20)]
    for i, blob in enumerate(blobs):
        put(writer, store, [f"OLD{i}"], "task_a_1", blob, NOW - 8 * DAY)
    stop = threading.Event()

    def ingest() -> None:
        rng = random.Random(1)
        n = 0
        while not stop.is_set() and n < 2000:
            put(writer, store, [f"V{rng.randrange(100)}"], f"task_b_{n % 5}", rng.choice(blobs), NOW)
            n += 1

    threads = [threading.Thread(target=ingest) for _ in range(3)]
    for th in threads:
        th.start()
    try:
        for _ in range(20):
            run(store, writer, now=NOW + HOUR // 2)
            assert dangling_rows(store) == []
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert dangling_rows(store) == []
