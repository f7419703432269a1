"""One GC pass, the same test bodies on LMDB (`storage.lmdb.gc.collect`) and PostgreSQL
(`storage.postgres.gc.collect`): what it deletes and keeps, the dry run, the blob re-check, and counts
that still equal a recount plus what GC forgot. Then both stores side by side after random work,
and (PostgreSQL alone) two passes at once racing ingest.

The sides of test_store_parity_more.py gain `collect(**kw)` and a view of the tables GC empties
(blobs, aliases, batch ids, parked triggers). Expired rows' outcomes are stamped with the wall
clock on both stores; the tests pin it to the pass's `now`.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from storage import plan
from storage.lmdb import gc, keys
from storage.lmdb import plan as lmdb_plan
from storage.lmdb.batches import sha1_of as sha1
from storage.lmdb.export import export as export_lmdb
from storage.lmdb.gc import ApplyReport, GcReport
from storage.lmdb.outcomes import Outcome
from storage.postgres import batches, expiry
from storage.postgres import export as pg_export
from storage.postgres import gc as pg_gc
from storage.postgres import plan as pg_plan
from tests.plan_reference import reference_plan, write_plan
from tests.unit import test_store_parity as parity
from tests.unit import test_store_parity_more as more

HOUR = 3_600_000
DAY = 24 * HOUR
NOW = 100 * DAY
#: The settings of every pass below.
SETTINGS: dict[str, Any] = {
    "retention_ms": 7 * DAY,
    "outcome_retention_ms": 3 * DAY,
    "grace_ms": HOUR,
    "early_ttl_ms": HOUR,
}
#: What a view of the store holds: blobs (sha1), aliases (data_id, sha1, ts), batch ids, parked triggers.
View = tuple[set[bytes], set[tuple[str, bytes, int]], set[str], list[tuple[str, str, int]]]


class LmdbSide(more.LmdbSide):
    def submit(self, op: Any) -> Future[Any]:
        done: Future[Any] = Future()
        done.set_result(self._write(lambda txn, _t: op(txn)))
        return done

    def collect(self, **kw: Any) -> GcReport:
        return gc.collect(self.store, self.submit, **kw)

    def mark(self) -> list[bytes]:
        return gc.unreferenced_blobs(self.store)

    def delete_blobs(self, candidates: list[bytes], cutoff_ms: int) -> tuple[int, int, int]:
        return self._write(gc.delete_blobs, candidates=candidates, cutoff_ms=cutoff_ms)  # type: ignore[no-any-return]

    def export(self, out: Path) -> None:
        export_lmdb(self.store, out)

    def apply(self, path: Path) -> ApplyReport:
        return lmdb_plan.apply_plan(self.store, self.submit, path)

    def view(self) -> View:
        t = self.store.tables
        with self.store.read() as txn:
            blobs = {bytes(k) for k in txn.cursor(t.data).iternext(values=False)}
            aliases = {(bytes(k).decode(), *keys.decode_alias(v)) for k, v in txn.cursor(t.aliases)}
            batch_ids = {bytes(k).decode() for k in txn.cursor(t.batches).iternext(values=False)}
            triggers = [(keys.early_data_id(bytes(k)), orjson.loads(v)) for k, v in txn.cursor(t.early)]
        parked = sorted((data_id, str(trig["request_id"]), int(trig["ts"])) for data_id, trig in triggers)
        return blobs, aliases, batch_ids, parked


class PgSide(more.PgSide):
    def collect(self, **kw: Any) -> GcReport:
        return self._run(pg_gc.collect(self.conn, **kw))

    def mark(self) -> list[bytes]:
        return self._run(pg_gc.unreferenced_blobs(self.conn))

    def delete_blobs(self, candidates: list[bytes], cutoff_ms: int) -> tuple[int, int, int]:
        return self._run(pg_gc.delete_blobs(self.conn, candidates, cutoff_ms))

    def export(self, out: Path) -> None:
        self._run(pg_export.export(self.conn, out))

    def apply(self, path: Path) -> ApplyReport:
        return plan.apply_plan_to(pg_plan.PgTarget(self.loop, self.conn), path)

    def view(self) -> View:
        fetch = self.conn.fetch
        blobs = {bytes(r[0]) for r in self._run(fetch("SELECT sha1 FROM blobs"))}
        aliases = {(r[0], bytes(r[1]), r[2]) for r in self._run(fetch("SELECT data_id, sha1, ts_ms FROM aliases"))}
        batch_ids = {r[0] for r in self._run(fetch("SELECT batch_id FROM batches"))}
        parked = sorted(
            (r[0], r[1], r[2]) for r in self._run(fetch("SELECT data_id, request_id, ts_ms FROM early_triggers"))
        )
        return blobs, aliases, batch_ids, parked


Side = LmdbSide | PgSide


def _empty_pg(dsn: str) -> PgSide:
    side = PgSide(dsn)
    side._run(side.conn.execute(f"TRUNCATE {parity._TABLES}"))
    return side


@pytest.fixture
def store(
    request: pytest.FixtureRequest, each_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Side]:
    """Each store in turn, empty, with the clock of retention's outcomes pinned to NOW."""
    monkeypatch.setattr(gc, "clock_ms", lambda: NOW)
    monkeypatch.setattr(expiry, "clock_ms", lambda: NOW)
    side: Side = LmdbSide(tmp_path / "lmdb") if each_store == "lmdb" else _empty_pg(request.getfixturevalue("pg_dsn"))
    yield side
    side.close()


def counted(report: GcReport) -> dict[str, Any]:
    """The report without its run time."""
    return {k: v for k, v in report.as_dict().items() if k != "seconds"}


def assert_recount_plus_forgotten(store: Side, forgotten: set[parity.Record]) -> None:
    """Stored counts equal a recount plus the outcome records GC deleted: the counts keep those."""
    expected = store.recount()
    for _, rid, sha, *_, code, _ in forgotten:
        slot = expected.setdefault((rid, sha), dict.fromkeys(keys.COUNT_NAMES, 0))
        slot[Outcome(code).label] += 1
        slot["total"] += 1
    stored = {k: c for k, (_, _, c) in store.generations().items() if c["total"]}
    expected = {k: c for k, c in expected.items() if k in stored or c["pending"]}
    assert stored == expected


def _populate(store: Side) -> None:
    """Something of every kind GC looks at, either side of each cutoff (NOW - 7 days for rows,
    aliases and batch ids; NOW - 3 days for outcomes and generations; NOW - 1 hour for blobs
    and parked triggers)."""
    store.batch(["OLD1", "OLD2"], "task_old_1", b"old-only", NOW - 8 * DAY, batch_id="b-old")
    store.batch(["OLD3"], "task_old_2", b"shared", NOW - 8 * DAY)
    store.batch(["NEW1"], "task_new_1", b"shared", NOW - 6 * DAY, batch_id="b-new")
    store.batch(["D1"], "task_done_1", b"done", NOW - 5 * DAY)  # delivered long ago: all of it goes
    store.end("D1", "task_done_1", b"done", NOW - 4 * DAY, Outcome.DELIVERED, attempts=1)
    store.batch(["M1", "M2", "M3"], "task_mixed_1", b"mixed", NOW - 5 * DAY)
    store.end("M1", "task_mixed_1", b"mixed", NOW - 4 * DAY, Outcome.FAILED, attempts=9)  # record goes
    store.end("M2", "task_mixed_1", b"mixed", NOW - DAY, Outcome.RESPONDED, attempts=1, response=b"ok")  # stays
    store.op("store_data", data_id="d-old", blob=b"alias-old", now_ms=NOW - 8 * DAY)
    store.op("store_data", data_id="d-new", blob=b"alias-new", now_ms=NOW - 2 * DAY)
    store.batch(["G1"], "task_grace_1", b"in-grace", NOW - 30 * 60_000)
    store.end("G1", "task_grace_1", b"in-grace", NOW - 20 * 60_000)
    store.batch(["G2"], "task_grace_2", b"out-of-grace", NOW - 3 * HOUR)
    store.end("G2", "task_grace_2", b"out-of-grace", NOW - 2 * HOUR)
    more.trigger(store, "d-late", ["E1"], "task_early_1", NOW - 2 * HOUR, batch_id="b-early")
    more.trigger(store, "d-soon", ["E2"], "task_early_2", NOW - 10 * 60_000)


# -- the same bodies on both stores ---------------------------------------------------------------


def test_one_pass_deletes_what_is_past_retention_and_keeps_the_rest(store: Side) -> None:
    _populate(store)
    counted_ms = [
        ("task_done_1", sha1(b"done"), "delivered", 40, 2),
        ("task_mixed_1", sha1(b"mixed"), "answered", 7, 1),
    ]
    store.op("add_latency", increments=counted_ms)
    store.op("add_latency", increments=counted_ms[1:])
    before = store.records()
    report = store.collect(now_ms=NOW, **SETTINGS)
    assert counted(report) == {
        "dry_run": False,
        "rows_expired": 3,  # OLD1, OLD2, OLD3
        "aliases_expired": 1,  # d-old
        "blobs_deleted": 4,  # old-only, done, alias-old, out-of-grace
        "blob_bytes_freed": len(b"old-only") + len(b"done") + len(b"alias-old") + len(b"out-of-grace"),
        "blobs_kept_recent": 1,  # in-grace
        "early_expired": 1,  # d-late's trigger
        "outcomes_expired": 2,  # D1's and M1's
        "generations_expired": 1,  # task_done_1
        "batch_ids_expired": 1,  # b-old
    }
    assert [(e.data_id, e.request_id, e.vins, e.batch_id) for e in report.expired_early] == [
        ("d-late", "task_early_1", 1, "b-early")
    ]
    assert [(r.vin, r.request_id) for r in store.rows()] == [
        ("M3", "task_mixed_1"),
        ("NEW1", "task_new_1"),
    ]
    blobs, aliases, batch_ids, parked = store.view()
    assert blobs == {sha1(b) for b in (b"shared", b"mixed", b"alias-new", b"in-grace")}
    assert aliases == {("d-new", sha1(b"alias-new"), NOW - 2 * DAY)}
    assert batch_ids == {"b-new"}  # b-early went with its trigger
    assert parked == [("d-soon", "task_early_2", NOW - 10 * 60_000)]
    assert {(r[0], r[1], r[6]) for r in store.records()} == {
        ("OLD1", "task_old_1", Outcome.EXPIRED),  # retention's outcomes, stamped NOW
        ("OLD2", "task_old_1", Outcome.EXPIRED),
        ("OLD3", "task_old_2", Outcome.EXPIRED),
        ("M2", "task_mixed_1", Outcome.RESPONDED),
        ("G1", "task_grace_1", Outcome.DELIVERED),
        ("G2", "task_grace_2", Outcome.DELIVERED),
    }
    assert ("task_done_1", sha1(b"done")) not in store.generations()
    assert store.op("latency", request_id="task_done_1") == {}  # gone with its generation
    assert store.op("latency", request_id="task_mixed_1") == {sha1(b"mixed"): {"answered": {7: 2}}}
    assert parity.counts_of(store, "task_mixed_1", b"mixed") == {"total": 3, "pending": 1, "failed": 1, "responded": 1}
    assert_recount_plus_forgotten(store, before - store.records())
    again = store.collect(now_ms=NOW, **SETTINGS)  # nothing left to do but keep the recent blob
    assert {k: v for k, v in counted(again).items() if v} == {"blobs_kept_recent": 1}


def test_a_dry_run_changes_nothing_and_predicts_the_pass(store: Side) -> None:
    """The dry run reports rows, aliases and blobs as the LMDB one does (the other counts stay 0)."""
    _populate(store)
    contents = (store.rows(), store.records(), store.generations(), store.view())
    dry = store.collect(now_ms=NOW, dry_run=True, **SETTINGS)
    assert (store.rows(), store.records(), store.generations(), store.view()) == contents
    real = store.collect(now_ms=NOW, **SETTINGS)
    predicted = ("rows_expired", "aliases_expired", "blobs_deleted", "blob_bytes_freed", "blobs_kept_recent")
    assert {k: counted(dry)[k] for k in predicted} == {k: counted(real)[k] for k in predicted}
    assert {k: v for k, v in counted(dry).items() if k not in predicted} == {
        "dry_run": True,
        "early_expired": 0,
        "outcomes_expired": 0,
        "generations_expired": 0,
        "batch_ids_expired": 0,
    }


def test_a_blob_reused_between_mark_and_delete_is_kept(store: Side) -> None:
    """The GC race: a batch naming a marked blob touches it, and the delete re-checks the touch."""
    store.batch(["A"], "task_a_1", b"reused", NOW - 8 * DAY)
    store.end("A", "task_a_1", b"reused", NOW - 8 * DAY)
    store.batch(["B"], "task_b_1", b"garbage", NOW - 8 * DAY)
    store.end("B", "task_b_1", b"garbage", NOW - 8 * DAY)
    marked = store.mark()
    assert marked == sorted([sha1(b"reused"), sha1(b"garbage")])
    store.batch(["C"], "task_a_1", b"reused", NOW)  # a dedup hit: touches the blob
    assert store.delete_blobs(marked, NOW - HOUR) == (1, len(b"garbage"), 1)
    assert store.view()[0] == {sha1(b"reused")}
    assert store.delete_blobs(marked, NOW - HOUR) == (0, 0, 1)


def test_a_blob_collected_comes_back_with_the_next_batch_naming_it(store: Side) -> None:
    """After its blob went, the same payload stores it again (new_blob), whole."""
    store.batch(["A"], "task_a_1", b"fw", NOW - 3 * HOUR)
    store.end("A", "task_a_1", b"fw", NOW - 3 * HOUR)
    assert store.collect(now_ms=NOW, **SETTINGS).blobs_deleted == 1
    assert store.batch(["A"], "task_a_1", b"fw", NOW).new_blob
    assert store.op("oldest", vin="A")[0][1] == b"fw"


# -- both stores side by side --------------------------------------------------------------------


def test_both_stores_collect_alike_after_random_work(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same random work on both, then GC passes with cutoffs inside the work's time span:
    equal reports, equal contents after each, counts equal a recount plus what GC forgot."""
    lmdb_side, pg_side = LmdbSide(tmp_path / "lmdb"), _empty_pg(pg_dsn)
    try:
        for side in (lmdb_side, pg_side):
            for _ in parity._random_work(side, random.Random(11), 300):
                pass
        end = max(r.ts_ms for r in lmdb_side.rows())
        forgotten: set[parity.Record] = set()
        for now in (end - 400, end - 50, end + 3_000):
            monkeypatch.setattr(gc, "clock_ms", lambda now=now: now)
            monkeypatch.setattr(expiry, "clock_ms", lambda now=now: now)
            before = lmdb_side.records()
            # The first pass keeps every blob: PostgreSQL records a blob's touches to the second
            # (batches.TOUCH_EVERY_MS), so a grace cutoff among the work's last uses could differ.
            grace = 10 * DAY if now < end else 300
            kw = {"retention_ms": 100, "outcome_retention_ms": 1_000, "grace_ms": grace, "early_ttl_ms": 100}
            on_lmdb = lmdb_side.collect(now_ms=now, **kw)
            on_pg = pg_side.collect(now_ms=now, limit=7, blob_limit=2, **kw)  # small chunks: many transactions
            assert counted(on_lmdb) == counted(on_pg), now
            assert lmdb_side.rows() == pg_side.rows()
            assert lmdb_side.records() == pg_side.records()
            assert lmdb_side.generations() == pg_side.generations()
            assert lmdb_side.view()[:3] == pg_side.view()[:3]
            forgotten |= before - lmdb_side.records()
            for side in (lmdb_side, pg_side):
                assert_recount_plus_forgotten(side, forgotten)
        assert lmdb_side.rows() == [] and lmdb_side.view()[0] == set()
    finally:
        lmdb_side.close()
        pg_side.close()


# -- PostgreSQL alone: several instances at once --------------------------------------------------


def test_two_passes_at_once_racing_ingest_delete_each_thing_once_on_postgresql(pg_dsn: str) -> None:
    """Two GC passes (as two instances, small chunks) while two connections store batches reusing
    old blobs: every old row ends once, no row loses its blob, and the counts hold."""
    side = _empty_pg(pg_dsn)
    blobs = [bytes([i]) * 10 for i in range(12)]
    for i, blob in enumerate(blobs):
        side.batch([f"OLD{i}", f"OLD{i}b"], f"task_old_{i}", blob, NOW - 8 * DAY, batch_id=f"b{i}")
    before = side.records()

    async def ingest_(conn: asyncpg.Connection, seed: int) -> None:
        rng = random.Random(seed)
        for n in range(30):
            await batches.store_batch(conn, [f"V{rng.randrange(20)}"], f"task_b_{n % 3}", rng.choice(blobs), NOW)

    async def go() -> list[Any]:
        conns = [await asyncpg.connect(pg_dsn, timeout=10) for _ in range(4)]
        try:
            passes = [pg_gc.collect(c, now_ms=NOW, limit=3, blob_limit=1, **SETTINGS) for c in conns[:2]]
            return list(await asyncio.gather(*passes, ingest_(conns[2], 1), ingest_(conns[3], 2)))
        finally:
            for c in conns:
                await c.close()

    try:
        first, second, *_ = side._run(go())
        third = side.collect(now_ms=NOW, **SETTINGS)  # what SKIP LOCKED left for the next pass
        assert first.rows_expired + second.rows_expired + third.rows_expired == 2 * len(blobs)
        assert first.batch_ids_expired + second.batch_ids_expired + third.batch_ids_expired == len(blobs)
        ended = collections.Counter((r[1].startswith("task_old"), r[6]) for r in side.records())
        assert ended[True, Outcome.EXPIRED] == 2 * len(blobs) == ended.total() - ended[False, Outcome.SUPERSEDED]
        held = {r.sha1 for r in side.rows()}
        assert held <= side.view()[0]  # no row without its blob
        assert_recount_plus_forgotten(side, before - side.records())
    finally:
        side.close()


def test_a_spark_plan_applies_alike_on_both_stores(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gc apply` of a plan (tests/plan_reference.py computes what spark/gc_job.py does) on each
    store's own export, after the store moved on: OLD2's row was replaced and its blob reused, the
    alias d-old rewritten. Rows still at their planned ts end `expired` (outcome records and
    counts, as retention ends them), what changed stays, and both stores end the same: report,
    rows, outcome records, counts, blobs and aliases. Applying it again deletes nothing."""
    for module in (gc, expiry, pg_plan):
        monkeypatch.setattr(module, "clock_ms", lambda: NOW)
    ends = []
    for side in (LmdbSide(tmp_path / "lmdb"), _empty_pg(pg_dsn)):
        try:
            _populate(side)
            out = tmp_path / f"export-{type(side).__name__}"
            side.export(out)
            manifest = orjson.loads((out / "manifest.json").read_bytes())
            (out / "manifest.json").write_bytes(orjson.dumps({**manifest, "snapshot_ms": NOW}))  # the test's clock
            path = tmp_path / f"plan-{type(side).__name__}"
            write_plan(path, reference_plan(out, SETTINGS["retention_ms"], SETTINGS["grace_ms"]), 7 * DAY, HOUR)
            side.batch(["OLD2"], "task_old_1", b"old-only", NOW)
            side.op("store_data", data_id="d-old", blob=b"alias-old", now_ms=NOW)
            report, again = side.apply(path), side.apply(path)
            ends.append((report, again, side.rows(), side.records(), side.generations(), side.view()))
            assert_recount_plus_forgotten(side, set())
        finally:
            side.close()
    (report, again, rows, *_), pg_end = ends[0], ends[1]
    assert ends[0][:2] == pg_end[:2] and ends[0][2:] == pg_end[2:]
    assert (report.rows_deleted, report.rows_kept_changed, report.aliases_deleted) == (2, 1, 0)  # OLD1, OLD3
    freed = len(b"done") + len(b"out-of-grace")  # old-only and alias-old were used again since the export
    assert (report.blobs_deleted, report.blob_bytes_freed, report.blobs_kept_recent) == (2, freed, 2)
    assert (again.rows_deleted, again.aliases_deleted, again.blobs_deleted) == (0, 0, 0)
    assert [(r.vin, r.ts_ms) for r in rows if r.request_id == "task_old_1"] == [("OLD2", NOW)]
