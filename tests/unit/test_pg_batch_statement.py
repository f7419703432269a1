"""A batch on PostgreSQL is one statement (storage/postgres/sql/functions/batches.sql; rows.sql writes the new
rows first), whatever it carries; concurrent batches racing for the same rows still leave counts
that equal a recount; a row ended between the batch's insert and its lock makes the function raise
serialization_failure, and the statement runs again."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import asyncpg
import pytest

from exhook_server.backends.postgres import pgmode
from exhook_server.config import Config
from storage.lmdb.batches import Duplicate, RowSpec, sha1_of
from storage.postgres import batches, migrate, outcomes
from testkit.pg_cluster import SUPERUSER, PgCluster

_names = itertools.count()


@pytest.fixture
def dsn(pg_cluster: PgCluster) -> str:
    return pg_cluster.new_database(f"batch_stmt_{next(_names)}")


def test_a_batch_is_one_statement_with_its_id_bound_replacements_and_duplicate(dsn: str) -> None:
    """One round trip per batch: a fresh one, one that replaces rows of an older payload under the
    backlog bound with a batch id, and its retry (a duplicate)."""

    async def go() -> list[list[str]]:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate.migrate(conn)
            vins = [f"V{n:03d}" for n in range(50)]
            await batches.store_batch(conn, vins, "task_warm_1", b"w", 1_000)  # types introspected once
            seen: list[str] = []
            conn.add_query_logger(lambda q: seen.append(q.query))
            per_batch = []
            answers = []
            spec = RowSpec(0, 0, 10)
            for blob, batch_id in ((b"fw1", None), (b"fw2", "b-2"), (b"fw2", "b-2")):
                seen.clear()
                answers.append(await batches.store_batch(conn, vins, "task_ota_1", blob, 2_000, batch_id, spec))
                await asyncio.sleep(0)  # asyncpg hands each logged query to call_soon: run those
                per_batch.append(list(seen))
            assert [type(a) is Duplicate for a in answers] == [False, False, True]
            stored, recount = await outcomes.all_generations(conn), await outcomes.recount(conn)
            assert {(g.request_id, g.sha1): g.counts for g in stored} == recount
            fw1 = recount[("task_ota_1", sha1_of(b"fw1"))]
            assert (fw1["superseded"], fw1["pending"]) == (50, 0)
            return per_batch
        finally:
            await conn.close()

    for statements in asyncio.run(go()):
        assert len(statements) == 1 and "sdv_store_batch" in statements[0], statements


def test_batches_racing_for_the_same_rows_keep_counts_exact(dsn: str) -> None:
    """Four connections store payloads of one request to the same VINs at once, six requests in a
    row: a batch inserting a pair another one is inserting waits for it, then replaces that row.
    Every batch lands and the counts equal a recount."""

    async def go() -> tuple[dict[Any, Any], dict[Any, Any], int]:
        conns = [await asyncpg.connect(dsn) for _ in range(4)]
        try:
            await migrate.migrate(conns[0])
            vins = [f"V{n:03d}" for n in range(120)]

            async def writer(k: int, conn: Any) -> None:
                for round_ in range(6):  # a new request each round: its rows are created by whoever is first
                    rid = f"task_race_{round_}"
                    await batches.store_batch(conn, vins, rid, f"p{k}-{round_}".encode(), 1_000 + round_)

            await asyncio.gather(*(writer(k, c) for k, c in enumerate(conns)))
            stored = {(g.request_id, g.sha1): g.counts for g in await outcomes.all_generations(conns[0])}
            rows = int(await conns[0].fetchval("SELECT count(*) FROM rows"))
            return stored, await outcomes.recount(conns[0]), rows
        finally:
            for c in conns:
                await c.close()

    stored, recount, rows = asyncio.run(go())
    assert stored == recount and rows == 6 * 120
    assert sum(c["pending"] for c in stored.values()) == 6 * 120
    assert sum(c["superseded"] for c in stored.values()) == 6 * 3 * 120  # each round: the first inserts


def test_a_row_ended_between_insert_and_lock_makes_the_batch_start_over(dsn: str) -> None:
    """A batch finds (V1, task_a_1) present, so it must lock and replace it; another transaction
    holds that row and deletes it meanwhile. The batch's lock then finds no row: it raises
    serialization_failure (seen by asyncpg's query logger), runs again, and stores a fresh row."""

    async def go() -> tuple[Any, Any, list[BaseException]]:
        holder, writer, watcher = [await asyncpg.connect(dsn) for _ in range(3)]
        try:
            await migrate.migrate(holder)
            await batches.store_batch(holder, ["V1"], "task_a_1", b"old", 1_000)
            tx = holder.transaction()
            await tx.start()
            await holder.execute("SELECT 1 FROM rows WHERE vin = 'V1' AND request_id = 'task_a_1' FOR UPDATE")
            failed: list[BaseException] = []
            writer.add_query_logger(lambda q: failed.append(q.exception) if q.exception else None)
            batch = asyncio.ensure_future(batches.store_batch(writer, ["V1", "V2"], "task_a_1", b"new", 2_000))
            waiting = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            deadline = time.monotonic() + 30  # until the batch waits on the held row
            while not await watcher.fetchval(waiting):
                if time.monotonic() > deadline:
                    raise AssertionError("the batch never waited for the held row")
                await asyncio.sleep(0.01)
            await holder.execute("DELETE FROM rows WHERE vin = 'V1' AND request_id = 'task_a_1'")
            await tx.commit()
            written = await asyncio.wait_for(batch, 10)
            row = await watcher.fetchrow("SELECT sha1, ts_ms FROM rows WHERE vin = 'V1' AND request_id = 'task_a_1'")
            return written, row, failed
        finally:
            for c in (holder, writer, watcher):
                await c.close()

    written, row, failed = asyncio.run(go())
    assert written.replaced == 0 and set(written.vins) == {"V1", "V2"}  # the second try found no row
    assert bytes(row["sha1"]) == sha1_of(b"new") and row["ts_ms"] == 2_000
    assert [type(e) for e in failed] == [asyncpg.exceptions.SerializationError], failed


def test_a_later_pair_that_exists_undoes_the_plain_insert_and_replaces_it(dsn: str) -> None:
    """The batch's first VIN (V1) has no row, so the plain INSERT runs; V3 has one, so it fails
    (unique_violation) and is undone, and the ON CONFLICT form stores the batch: V1 and V2 new, V3
    replaced and its old payload superseded; counts equal a recount."""

    async def go() -> tuple[Any, dict[Any, Any], dict[Any, Any], int]:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate.migrate(conn)
            await batches.store_batch(conn, ["V3"], "task_a_1", b"old", 1_000)
            written = await batches.store_batch(conn, ["V3", "V1", "V2"], "task_a_1", b"new", 2_000)
            stored = {(g.request_id, g.sha1): g.counts for g in await outcomes.all_generations(conn)}
            rows = int(await conn.fetchval("SELECT count(*) FROM rows WHERE sha1 = $1", sha1_of(b"new")))
            return written, stored, await outcomes.recount(conn), rows
        finally:
            await conn.close()

    written, stored, recount, rows = asyncio.run(go())
    assert written.replaced == 1 and written.superseded == frozenset({sha1_of(b"old")})
    assert rows == 3 and stored == recount
    assert stored[("task_a_1", sha1_of(b"new"))]["pending"] == 3


def test_no_jit_for_the_instance_nor_for_a_batch_whoever_calls(pg_cluster: PgCluster) -> None:
    """JIT compiling the backlog probe took 7 ms per batch (its estimate over a table without
    statistics passes jit_above_cost): the instance's sessions run with jit off, and sdv_put_rows
    sets it off for itself, so even a caller with JIT forced on (jit_above_cost 0) gets none for
    the probe (auto_explain's plan of it has no JIT section; a query of the caller's own does)."""

    name = f"batch_stmt_{next(_names)}"
    dsn = pg_cluster.new_database(name)

    async def go() -> tuple[str, str, str]:
        pool = await pgmode.create_pool(Config(store_url=dsn, store_pool_size=1))
        try:
            async with pool.acquire() as conn:
                await migrate.migrate(conn)
                instance = await conn.fetchval("SHOW jit")
        finally:
            await pool.close()
        settings = {"jit": "on", "jit_above_cost": "0"}  # auto_explain needs a superuser to load
        eager = await asyncpg.connect(pg_cluster.dsn_for(name, SUPERUSER), server_settings=settings)
        try:
            await eager.execute("LOAD 'auto_explain'")
            await eager.execute("SET auto_explain.log_min_duration = 0")
            await eager.execute("SET auto_explain.log_nested_statements = on")
            await eager.execute("SET auto_explain.log_level = 'notice'")
            notes: list[str] = []
            eager.add_log_listener(lambda _c, msg: notes.append(msg.message))
            await batches.store_batch(
                eager, [f"V{n}" for n in range(20)], "task_jit_1", b"p", 1_000, None, RowSpec(0, 0, 5)
            )
            await eager.execute("SELECT 1")  # after the batch's notices have arrived
            inside = "\n".join(n for n in notes if "LIMIT p_max_pending + 1" in n)  # the backlog count
            notes.clear()
            await eager.fetchval("SELECT count(*) FROM rows")
            outside = "\n".join(notes)
            return instance, inside, outside
        finally:
            await eager.close()

    instance, inside, outside = asyncio.run(go())
    assert instance == "off"
    assert "Index Only Scan" in inside or "Index Scan" in inside, inside  # the probe's plan was logged
    assert "JIT:" not in inside and "JIT:" in outside
