"""A batch on PostgreSQL is one statement (storage/pg/batch.sql, schema 5), whatever it carries, and
concurrent batches racing for the same rows still leave counts that equal a recount (the function
raises serialization_failure and the statement runs again)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import asyncpg
import pytest

from storage.ops import Duplicate, RowSpec, sha1_of
from storage.pg import counts, ingest, migrate
from tests.pg_cluster import PgCluster

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
            await ingest.store_batch(conn, vins, "task_warm_1", b"w", 1_000)  # types introspected once
            seen: list[str] = []
            conn.add_query_logger(lambda q: seen.append(q.query))
            per_batch = []
            answers = []
            spec = RowSpec(0, 0, 10)
            for blob, batch_id in ((b"fw1", None), (b"fw2", "b-2"), (b"fw2", "b-2")):
                seen.clear()
                answers.append(await ingest.store_batch(conn, vins, "task_ota_1", blob, 2_000, batch_id, spec))
                await asyncio.sleep(0)  # asyncpg hands each logged query to call_soon: run those
                per_batch.append(list(seen))
            assert [type(a) is Duplicate for a in answers] == [False, False, True]
            stored, recount = await counts.all_generations(conn), await counts.recount(conn)
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
    row: each batch reads the rows it replaces, so rows another one creates meanwhile make it start
    over (a few times per run, measured with pg_stat_database.xact_rollback). Every batch lands
    and the counts equal a recount."""

    async def go() -> tuple[dict[Any, Any], dict[Any, Any], int]:
        conns = [await asyncpg.connect(dsn) for _ in range(4)]
        try:
            await migrate.migrate(conns[0])
            vins = [f"V{n:03d}" for n in range(120)]

            async def writer(k: int, conn: Any) -> None:
                for round_ in range(6):  # a new request each round: its rows are created by whoever is first
                    rid = f"task_race_{round_}"
                    await ingest.store_batch(conn, vins, rid, f"p{k}-{round_}".encode(), 1_000 + round_)

            await asyncio.gather(*(writer(k, c) for k, c in enumerate(conns)))
            stored = {(g.request_id, g.sha1): g.counts for g in await counts.all_generations(conns[0])}
            rows = int(await conns[0].fetchval("SELECT count(*) FROM rows"))
            return stored, await counts.recount(conns[0]), rows
        finally:
            for c in conns:
                await c.close()

    stored, recount, rows = asyncio.run(go())
    assert stored == recount and rows == 6 * 120
    assert sum(c["pending"] for c in stored.values()) == 6 * 120
    assert sum(c["superseded"] for c in stored.values()) == 6 * 3 * 120  # each round: the first inserts
