"""The PostgreSQL schema is created once under its advisory lock, however many instances start at
once; migrating again changes nothing, and a database newer than the code is refused."""

from __future__ import annotations

import asyncio
import itertools

import asyncpg
import pytest

from storage.postgres import migrate
from testkit.pg_cluster import PgCluster

_names = itertools.count()

TABLES = {
    "blobs",
    "rows",
    "aliases",
    "early_triggers",
    "generations",
    "outcomes",
    "batches",
    "cancels",
    "crowded",
    "vin_state",
    "presence",
    "gen_deltas",
    "policies",
    "answer_failures",
    "pacing_buckets",
    "gen_latency",
}


async def _connect(dsn: str, n: int) -> list[asyncpg.Connection]:
    return [await asyncpg.connect(dsn, timeout=10) for _ in range(n)]


def test_concurrent_starts_create_the_schema_exactly_once(pg_cluster: PgCluster) -> None:
    """Six connections migrate a fresh database at the same moment: one applies every version,
    the others find it done; every table is there, its text keys in byte-order collation."""
    dsn = pg_cluster.new_database(f"migrate_{next(_names)}")

    async def go() -> tuple[list[list[int]], list[int], set[str], set[tuple[str, str]]]:
        conns = await _connect(dsn, 6)
        try:
            applied = await asyncio.gather(*(migrate.migrate(c) for c in conns))
            versions = [r[0] for r in await conns[0].fetch("SELECT version FROM schema_version")]
            tables = {r[0] for r in await conns[0].fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
            collations = {
                (r[0], r[1])
                for r in await conns[0].fetch(
                    "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'"
                    " AND data_type = 'text' AND collation_name IS DISTINCT FROM 'C'"
                )
            }
            return list(applied), versions, tables, collations
        finally:
            for c in conns:
                await c.close()

    applied, versions, tables, collations = asyncio.run(go())
    every = [v for v, _ in migrate.MIGRATIONS]
    assert sorted(applied) == [[], [], [], [], [], every]
    assert sorted(versions) == every and every[-1] == migrate.SCHEMA_VERSION
    assert tables == TABLES | {"schema_version"}
    # Every text key compares bytes, as LMDB keys do; only the echoed correlation ids do not need to.
    assert collations == {("early_triggers", "correlation_id"), ("cancels", "correlation_id")}


def test_migrating_again_changes_nothing(pg_cluster: PgCluster) -> None:
    """A second migrate of a migrated database applies nothing and keeps its rows."""
    dsn = pg_cluster.new_database(f"migrate_{next(_names)}")

    async def go() -> tuple[list[int], list[int], int, int]:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            first = await migrate.migrate(conn)
            await conn.execute("INSERT INTO blobs VALUES ('\\x01'::bytea, 'x', 1, 1)")
            second = await migrate.migrate(conn)
            return first, second, await migrate.schema_version(conn), await conn.fetchval("SELECT count(*) FROM blobs")
        finally:
            await conn.close()

    every = [v for v, _ in migrate.MIGRATIONS]
    assert asyncio.run(go()) == (every, [], migrate.SCHEMA_VERSION, 1)


def test_a_database_newer_than_the_code_is_refused(pg_cluster: PgCluster) -> None:
    """A schema version this release does not know raises SchemaTooNew and applies nothing."""
    dsn = pg_cluster.new_database(f"migrate_{next(_names)}")

    async def go() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            assert await migrate.schema_version(conn) == 0
            await migrate.migrate(conn)
            await conn.execute("INSERT INTO schema_version VALUES ($1, 0)", migrate.SCHEMA_VERSION + 1)
            with pytest.raises(migrate.SchemaTooNew):
                await migrate.migrate(conn)
        finally:
            await conn.close()

    asyncio.run(go())
