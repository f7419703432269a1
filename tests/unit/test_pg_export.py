"""`storage.postgres.export` writes what `storage.lmdb.export` writes: the same data on LMDB and on PostgreSQL
(the sides of the store parity tests) exports to the same Parquet tables, types and manifest.

The PostgreSQL side runs on the session's throwaway cluster, in this module's migrated database.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import storage.export_format as export_format
import storage.lmdb.export as lmdb_export
from storage.errors import StorageError
from storage.lmdb import keys
from storage.lmdb import policies as lmdb_policies
from storage.lmdb.batches import sha1_of
from storage.lmdb.export import export as export_lmdb
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import SCHEMA_VERSION as LMDB_SCHEMA_VERSION
from storage.postgres import batches as pg_batches
from storage.postgres import export as pg_export
from storage.postgres import policies as pg_policies
from storage.postgres.migrate import SCHEMA_VERSION as PG_SCHEMA_VERSION
from testkit.harness import BIN
from testkit.pg_cluster import PgCluster
from tests.unit import test_store_parity as parity
from tests.unit import test_store_parity_more as more

TABLES = ("rows", "blobs", "aliases", "outcomes", "generations", "policies")
STEP = 2_000  # > TOUCH_EVERY_MS: PostgreSQL rewrites a blob's touched_ms at most once a second
HOUR = 3_600_000
DAY = 24 * HOUR
T0 = 1_000_000
LONG_ANSWER = bytes(range(256)) * 20  # 5,120 bytes, not UTF-8: past INLINE_ANSWER_BYTES


@pytest.fixture
def sides(tmp_path: Path, pg_dsn: str) -> Iterator[tuple[more.LmdbSide, more.PgSide]]:
    """An empty LMDB store and the emptied PostgreSQL database."""
    lmdb_side, pg_side = more.LmdbSide(tmp_path / "lmdb"), more.PgSide(pg_dsn)
    pg_side._run(pg_side.conn.execute(f"TRUNCATE {parity._TABLES}, policies"))
    yield lmdb_side, pg_side
    lmdb_side.close()
    pg_side.close()


PACED = b'{"max_per_minute":600,"ramp":{"start_per_minute":60,"factor":2.0,"every_s":60}}'
GUARDED = b'{"abort":[{"outcome":"failed","ratio":0.1,"min_finished":10}]}'
ABORTED = b'{"criterion":{"outcome":"failed","ratio":0.1,"min_finished":10},"counts":{"finished":10},"at_ms":7}'


def set_policy(store: more.Side, rid: str, doc: bytes, now: int, aborted: bytes | None = None) -> None:
    """`rid`'s campaign policy `doc` set at `now`, and aborted with `aborted` (its JSON) if given."""
    if isinstance(store, more.LmdbSide):
        store._write(lmdb_policies.set_policy, request_id=rid, doc=doc, now_ms=now, max_count=10)
        if aborted is not None:
            assert store._write(lmdb_policies.abort, request_id=rid, doc=aborted, now_ms=now, max_rows=10)
    else:
        store._run(pg_policies.set_policy(store.conn, rid, doc, now, 10))
        if aborted is not None:
            assert store._run(pg_batches.abort(store.conn, rid, aborted, now, 10))


def campaign(store: more.Side, t0: int = T0) -> None:
    """Every kind of record an export holds: pending rows (expiring, awaiting an answer, taken by
    a cancel-all left half done), blobs, aliases, and outcomes of each kind (a cancelled pair
    amended by its PUBACK, answers empty, short and long) with their generation counts, a policy
    in force and an aborted one; one trigger stays parked (not exported)."""
    clock = iter(range(t0, t0 + 1_000 * STEP, STEP))
    opened = sha1_of(b"open")
    store.batch(["V1", "V2", "V3", "V4"], "task_ota_1", b"fw1", next(clock), "batch-1")
    store.batch(["V2"], "task_ota_1", b"fw2", next(clock))  # V2's fw1 superseded
    store.batch(["V9"], "manual", b"x", next(clock), flags=keys.FLAG_HIGH_PRIORITY)
    expires = t0 + 100 * STEP
    await_it = keys.FLAG_AWAIT_RESPONSE
    store.batch(["V1", "V5", "V6", "V7"], "task_unlock_1", b"open", next(clock), expires_ms=expires, flags=await_it)
    store.batch(["V8"], "task_unlock_2", b"lock", next(clock), expires_ms=expires + 10**9, flags=await_it)
    assert store.end("V1", "task_ota_1", b"fw1", next(clock), Outcome.DELIVERED, attempts=2)
    assert store.end("V3", "task_ota_1", b"fw1", next(clock), Outcome.FAILED, attempts=3)
    assert store.end("V1", "task_unlock_1", b"open", next(clock), Outcome.RESPONDED, 1, b"unlocked \xff")
    assert store.end("V6", "task_unlock_1", b"open", next(clock), Outcome.RESPONDED, 1, LONG_ANSWER)
    assert store.end("V7", "task_unlock_1", b"open", next(clock), Outcome.RESPONDED, 2, b"")
    assert store.cancel_vins("task_ota_1", ["V4"], next(clock)).total == 1
    store.batch(["V10", "V11"], "task_c_1", b"c", next(clock))
    store.cancel_vins("task_c_1", ["V10", "V11"], next(clock))
    assert store.end("V10", "task_c_1", b"c", next(clock), Outcome.DELIVERED, attempts=1)  # amends `cancelled`
    assert store.op("expire_due", now_ms=expires + 1, limit=10) == [("V5", "task_unlock_1", opened)]
    store.batch([f"W{n}" for n in range(6)], "task_all_1", b"all", next(clock))
    assert store.cancel_all("task_all_1", next(clock), max_rows=2).more  # left half done, as by a crash
    store.op("store_data", data_id="d1", blob=b"payload-d1", now_ms=next(clock))
    more.trigger(store, "d1", ["V1", "V2"], "task_d_1", next(clock), batch_id="batch-d")
    assert more.trigger(store, "d2", ["V3"], "task_e_1", next(clock)).early  # parked: its data never came
    set_policy(store, "task_ota_1", PACED, next(clock))
    set_policy(store, "task_gone_1", GUARDED, next(clock), ABORTED)  # no rows left: the abort cuts none


def tables(out: Path) -> dict[str, pa.Table]:
    return {name: pq.read_table(out / name / "part-00000.parquet") for name in TABLES}


def sorted_records(table: pa.Table) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in table.to_pylist())


def export_both(
    lmdb_side: more.LmdbSide, pg_side: more.PgSide, tmp_path: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, pa.Table], dict[str, pa.Table]]:
    from_lmdb = export_lmdb(lmdb_side.store, tmp_path / "lmdb-export")
    from_pg = pg_side._run(pg_export.export(pg_side.conn, tmp_path / "pg-export"))
    return from_lmdb, from_pg, tables(tmp_path / "lmdb-export"), tables(tmp_path / "pg-export")


#: What a manifest says about its store rather than the data: which store, its own schema
#: version, and the snapshot's time.
STORE_KEYS = ("snapshot_ms", "store", "schema_version")


def same_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest without what differs between stores (STORE_KEYS)."""
    return {k: v for k, v in manifest.items() if k not in STORE_KEYS}


def assert_same_export(
    from_lmdb: dict[str, Any],
    from_pg: dict[str, Any],
    lmdb_tables: dict[str, pa.Table],
    pg_tables: dict[str, pa.Table],
    drop: Callable[[str, pa.Table], pa.Table] = lambda name, table: table,
) -> None:
    assert same_manifest(from_pg) == same_manifest(from_lmdb)
    for name in TABLES:
        assert pg_tables[name].schema == lmdb_tables[name].schema, name
        assert sorted_records(drop(name, pg_tables[name])) == sorted_records(drop(name, lmdb_tables[name])), name


def test_both_stores_export_the_same_tables_and_manifest(
    sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path
) -> None:
    """The same campaign on both stores: the same manifest (but its time), schemas and records,
    and records in the same (key) order too."""
    lmdb_side, pg_side = sides
    campaign(lmdb_side)
    campaign(pg_side)
    from_lmdb, from_pg, lmdb_tables, pg_tables = export_both(lmdb_side, pg_side, tmp_path)
    assert_same_export(from_lmdb, from_pg, lmdb_tables, pg_tables)
    for name in TABLES:
        assert pg_tables[name].equals(lmdb_tables[name]), name
    assert from_pg["format_version"] == lmdb_export.FORMAT_VERSION == 3
    high = [(r["vin"], r["request_id"]) for r in pg_tables["rows"].to_pylist() if r["high_priority"]]
    assert high == [("V9", "manual")]  # the batch's own flag, as stored
    # Each names its store and that store's real schema version: the database's, not LMDB's.
    database_version = pg_side._run(pg_side.conn.fetchval("SELECT max(version) FROM schema_version"))
    assert (from_pg["store"], from_pg["schema_version"]) == ("postgresql", database_version)
    assert database_version == PG_SCHEMA_VERSION
    assert (from_lmdb["store"], from_lmdb["schema_version"]) == ("lmdb", LMDB_SCHEMA_VERSION)
    assert from_pg["counts"] == {
        "rows": 9,
        "blobs": 8,
        "aliases": 1,
        "outcomes": 12,
        "generations": 8,
        "policies": 2,
    }
    assert pg_tables["policies"].to_pylist() == [
        {
            "request_id": "task_gone_1",
            "policy": GUARDED.decode(),
            "set_ms": T0 + 20 * STEP,
            "aborted": ABORTED.decode(),
        },
        {"request_id": "task_ota_1", "policy": PACED.decode(), "set_ms": T0 + 19 * STEP, "aborted": None},
    ]
    assert json.loads((tmp_path / "pg-export" / "manifest.json").read_text()) == from_pg
    ended = {(r["vin"], r["request_id"]): r for r in pg_tables["outcomes"].to_pylist()}
    assert {r["outcome"] for r in ended.values()} == {
        "delivered",
        "superseded",
        "cancelled",
        "expired",
        "failed",
        "responded",
    }
    assert (ended["V6", "task_unlock_1"]["response"], ended["V6", "task_unlock_1"]["response_bytes"]) == (
        LONG_ANSWER,
        len(LONG_ANSWER),
    )
    assert (ended["V7", "task_unlock_1"]["response"], ended["V7", "task_unlock_1"]["response_bytes"]) == (b"", 0)
    assert (ended["V2", "task_ota_1"]["response"], ended["V2", "task_ota_1"]["response_bytes"]) == (None, None)
    rows = {(r["vin"], r["request_id"]): r for r in pg_tables["rows"].to_pylist()}
    assert (rows["V8", "task_unlock_2"]["expires_at_ms"], rows["V8", "task_unlock_2"]["await_response"]) == (
        1_000_000 + 100 * STEP + 10**9,
        True,
    )
    assert (rows["V9", "manual"]["expires_at_ms"], rows["V9", "manual"]["await_response"]) == (None, False)


def test_random_work_exports_alike(sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path) -> None:
    """The parity tests' random work (batches, acks, answers, cancels of some and of all) on both:
    the same export. Blobs' touched_ms aside: its steps are milliseconds apart, and PostgreSQL
    rewrites a touch at most once a second (storage.postgres.batches.TOUCH_EVERY_MS)."""
    lmdb_side, pg_side = sides
    for _ in zip(
        parity._random_work(lmdb_side, random.Random(5), 300),
        parity._random_work(pg_side, random.Random(5), 300),
        strict=True,
    ):
        pass
    from_lmdb, from_pg, lmdb_tables, pg_tables = export_both(lmdb_side, pg_side, tmp_path)
    assert from_pg["counts"]["outcomes"] > 0 and from_pg["counts"]["rows"] > 0
    assert_same_export(
        from_lmdb,
        from_pg,
        lmdb_tables,
        pg_tables,
        lambda name, table: table.drop_columns(["touched_ms"]) if name == "blobs" else table,
    )


def test_batches_stay_bounded_by_the_answers_they_hold(
    sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long answers are read per batch, not through the cursor, and batches close at BATCH_BYTES of
    answers as on LMDB: the same row groups, the same answers."""
    monkeypatch.setattr(export_format, "BATCH_BYTES", 10_000)
    monkeypatch.setattr(pg_export, "FETCH_ROWS", 5)
    monkeypatch.setattr(pg_export, "INLINE_ANSWER_BYTES", 100)
    vins = [f"V{n:02d}" for n in range(12)]
    for side in sides:
        side.batch(vins, "task_unlock_1", b"open", 1_000, flags=keys.FLAG_AWAIT_RESPONSE)
        for n, vin in enumerate(vins):
            side.end(
                vin, "task_unlock_1", b"open", 2_000 + n, Outcome.RESPONDED, 1, bytes([n]) * (4096 if n % 4 else 7)
            )
    from_lmdb, from_pg, lmdb_tables, pg_tables = export_both(*sides, tmp_path)
    assert_same_export(from_lmdb, from_pg, lmdb_tables, pg_tables)
    groups = [
        pq.ParquetFile(tmp_path / d / "outcomes" / "part-00000.parquet").num_row_groups
        for d in ("lmdb-export", "pg-export")
    ]
    assert groups[0] == groups[1] == 3  # 7 + 3 x 4,096 bytes of answers reach 10,000


def test_the_export_is_one_snapshot_while_writers_go_on(
    sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path, pg_dsn: str
) -> None:
    """A batch and an ack committed while the export runs (after it wrote `rows`): no table shows
    them, so the generation counts still equal the exported rows and outcomes."""
    _, pg_side = sides
    pg_side.batch(["V1", "V2"], "task_a_1", b"a", 1_000)
    done: list[int] = []

    def write_elsewhere() -> None:  # another connection, in a thread of its own (its own event loop)
        other = more.PgSide(pg_dsn)
        try:
            other.batch(["V3"], "task_a_1", b"a", 2_000)
            other.batch(["V1"], "task_b_1", b"b", 2_000)
            assert other.end("V1", "task_a_1", b"a", 2_001)
        finally:
            other.close()

    def progress(n: int) -> None:
        if not done:  # the first batch written: `rows`
            thread = threading.Thread(target=write_elsewhere)
            thread.start()
            thread.join()
        done.append(n)

    manifest = pg_side._run(pg_export.export(pg_side.conn, tmp_path / "out", progress=progress))
    assert manifest["counts"] == {"rows": 2, "blobs": 1, "aliases": 0, "outcomes": 0, "generations": 1, "policies": 0}
    got = tables(tmp_path / "out")
    assert [g["pending"] for g in got["generations"].to_pylist()] == [2]
    assert len(pg_side.rows()) == 3  # the writes did commit


def test_an_unmigrated_database_is_refused(pg_cluster: PgCluster, tmp_path: Path) -> None:
    dsn = pg_cluster.new_database("pg_export_empty")

    async def go() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await pg_export.export(conn, tmp_path / "out")
        finally:
            await conn.close()

    with pytest.raises(StorageError, match="db migrate"):
        asyncio.run(go())
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_cli_exports_from_postgresql_when_store_url_is_set(
    sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path, pg_dsn: str
) -> None:
    """`sdv-fanout export --out DIR --store-url URL` (or SDV_FANOUT_STORE_URL) reads PostgreSQL
    and ignores --data-dir; without a store_url it reads the LMDB store of --data-dir as before."""
    lmdb_side, pg_side = sides
    campaign(lmdb_side)
    campaign(pg_side)
    sdv = str(BIN / "sdv-fanout")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDV_FANOUT_")}

    def run(*argv: str, **extra: str) -> dict[str, Any]:
        done = subprocess.run(
            [sdv, "export", *argv], capture_output=True, text=True, timeout=60, env={**env, **extra}, check=False
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    lmdb_dir = str(tmp_path / "lmdb")
    flagged = run("--out", str(tmp_path / "a"), "--store-url", pg_dsn, "--data-dir", str(tmp_path / "nowhere"))
    from_env = run("--out", str(tmp_path / "b"), SDV_FANOUT_STORE_URL=pg_dsn)
    from_lmdb = run("--out", str(tmp_path / "c"), "--data-dir", lmdb_dir)
    for manifest in (flagged, from_env):
        assert same_manifest(manifest) == same_manifest(from_lmdb)
        assert (manifest["store"], manifest["schema_version"]) == ("postgresql", PG_SCHEMA_VERSION)
    for name in TABLES:
        assert sorted_records(tables(tmp_path / "a")[name]) == sorted_records(tables(tmp_path / "c")[name]), name
    bad = subprocess.run(
        [sdv, "export", "--out", str(tmp_path / "d"), "--store-url", "postgresql://sdv@127.0.0.1:1/sdv"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert bad.returncode == 2 and "store_url" in bad.stderr


def sdv_fanout(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI with `argv`, none of the caller's SDV_FANOUT_* settings in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDV_FANOUT_")}
    return subprocess.run(
        [str(BIN / "sdv-fanout"), *argv], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_cli_applies_a_gc_plan_to_postgresql_when_store_url_is_set(
    sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path, pg_dsn: str
) -> None:
    """`sdv-fanout gc apply PLAN --store-url URL` applies the plan to PostgreSQL, not to an LMDB
    store of data_dir (there is none here): the planned row ends `expired`, a live one stays;
    a directory that is not a plan and an unreachable database are clear errors (exit 2)."""
    from tests.plan_reference import reference_plan, write_plan

    _, pg_side = sides
    now = int(time.time() * 1000)
    pg_side.batch(["OLD1"], "task_old_1", b"old", now - 8 * DAY)
    pg_side.batch(["NEW1"], "task_new_1", b"new", now)
    pg_side._run(pg_export.export(pg_side.conn, tmp_path / "out"))
    write_plan(tmp_path / "plan", reference_plan(tmp_path / "out", 7 * DAY, HOUR), 7 * DAY, HOUR)

    def gc_apply(*argv: str) -> subprocess.CompletedProcess[str]:
        return sdv_fanout("gc", "apply", *argv, "--data-dir", str(tmp_path / "nowhere"), "--json")

    done = gc_apply(str(tmp_path / "plan"), "--store-url", pg_dsn)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["rows_deleted"], report["blobs_deleted"]) == (1, 1)
    assert [(r.vin, r.request_id) for r in pg_side.rows()] == [("NEW1", "task_new_1")]
    assert not (tmp_path / "nowhere").exists()
    not_a_plan = gc_apply(str(tmp_path), "--store-url", pg_dsn)
    assert not_a_plan.returncode == 2 and "plan" in not_a_plan.stderr
    unreachable = gc_apply(str(tmp_path / "plan"), "--store-url", "postgresql://sdv@127.0.0.1:1/sdv")
    assert unreachable.returncode == 2 and "store_url" in unreachable.stderr


def test_cli_cancels_on_postgresql_when_store_url_is_set(
    sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path, pg_dsn: str
) -> None:
    """`sdv-fanout cancel R [--vin V] --store-url URL` without a server ends the rows on PostgreSQL,
    not in an LMDB store of data_dir (there is none here): the named vehicle's row, then every
    other one, each counted `cancelled` in its generation; an unreachable database is a clear
    error (exit 2)."""
    _, pg_side = sides
    pg_side.batch(["C1", "C2", "C3"], "task_can_1", b"fw", 1_000)

    def cancel(*argv: str) -> subprocess.CompletedProcess[str]:
        return sdv_fanout("cancel", "task_can_1", *argv, "--data-dir", str(tmp_path / "nowhere"), "--json")

    one = cancel("--vin", "C2", "--store-url", pg_dsn)
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout) == {"request_id": "task_can_1", "cancelled": 1, "in_flight": None}
    assert [r.vin for r in pg_side.rows()] == ["C1", "C3"]
    rest = cancel("--store-url", pg_dsn)
    assert rest.returncode == 0, rest.stderr
    assert json.loads(rest.stdout)["cancelled"] == 2
    assert pg_side.rows() == []
    gen = pg_side._run(pg_side.conn.fetchrow("SELECT * FROM generation_counts WHERE request_id = 'task_can_1'"))
    assert (gen["cancelled"], gen["pending"]) == (3, 0)
    assert not (tmp_path / "nowhere").exists()
    unreachable = cancel("--store-url", "postgresql://sdv@127.0.0.1:1/sdv")
    assert unreachable.returncode == 2 and "store_url" in unreachable.stderr


def test_a_gc_plan_skips_a_row_another_session_holds(sides: tuple[more.LmdbSide, more.PgSide], pg_dsn: str) -> None:
    """A planned row whose vehicle's rows another session holds (FOR UPDATE) is kept and counted,
    not waited for: the chunk finishes at once with the other rows ended `expired`, and its locks
    never make other vehicles' writes wait behind the locked one."""
    from storage.postgres import plan as pg_plan

    _, pg_side = sides
    pg_side.batch(["V1", "V2", "V3"], "task_old_1", b"old", 1_000)
    planned = [(r.vin, r.request_id, r.ts_ms) for r in pg_side.rows()]

    async def apply_while_locked() -> tuple[int, int]:
        holder = await asyncpg.connect(pg_dsn, timeout=10)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM rows WHERE vin = 'V2' FOR UPDATE")
                async with asyncio.timeout(10):  # waiting on the lock would outlast it
                    return await pg_plan.delete_planned_rows(pg_side.conn, planned)
        finally:
            await holder.close()

    assert pg_side._run(apply_while_locked()) == (2, 1)
    assert [(r.vin, r.request_id) for r in pg_side.rows()] == [("V2", "task_old_1")]
    assert {(r[0], r[6]) for r in pg_side.records()} == {("V1", int(Outcome.EXPIRED)), ("V3", int(Outcome.EXPIRED))}
