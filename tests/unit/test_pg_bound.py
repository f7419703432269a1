"""The backlog bound on PostgreSQL (storage/postgres/sql/functions/bound.sql, schema 8): a bound above 64 counts the
vehicles listed in `crowded` on every new row and the others on a random sample of rows, so a
vehicle is listed on its way up from half the bound and refused exactly once listed; a bound of 64
or less counts every vehicle's queue on every new row. The vehicles-at-bound gauge counts the listed
vehicles. random() is seeded per connection (setseed):
each test's draws are the same on every run."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
import pytest

from storage.lmdb.batches import BatchWritten, RowSpec
from storage.postgres import batches, migrate, reads
from testkit.pg_cluster import PgCluster

T = TypeVar("T")
_names = itertools.count()


@pytest.fixture
def dsn(pg_cluster: PgCluster) -> str:
    return pg_cluster.new_database(f"bound_{next(_names)}")


def _with_conn(dsn: str, body: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    async def go() -> T:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate.migrate(conn)
            await conn.execute("SELECT setseed(0.25)")
            return await body(conn)
        finally:
            await conn.close()

    return asyncio.run(go())


async def _put(conn: asyncpg.Connection, vins: list[str], request_id: str, max_pending: int) -> tuple[str, ...]:
    """One batch of `vins`; the VINs it refused."""
    out = await batches.store_batch(conn, vins, request_id, b"p", 1_000, None, RowSpec(0, 0, max_pending))
    assert isinstance(out, BatchWritten)
    return out.refused


async def _fill(conn: asyncpg.Connection, vin: str, n: int) -> None:
    """`n` pending rows for `vin` written behind the store's back: no count, no listing."""
    await conn.execute(
        "INSERT INTO rows (vin, request_id, ts_ms, sha1, size)"
        " SELECT $1, 'task_fill_' || i, i, '\\x00'::bytea, 1 FROM generate_series(1, $2) AS i",
        vin,
        n,
    )


async def _listed(conn: asyncpg.Connection) -> list[str]:
    return [r[0] for r in await conn.fetch("SELECT vin FROM crowded ORDER BY vin")]


def test_a_vehicle_climbing_to_a_large_bound_is_listed_and_refused_at_it(dsn: str) -> None:
    """Bound 128 (half of the rows counted): one vehicle gets a new request per batch beside a
    vehicle that gets one request in all. It is listed on the way up, holds exactly 128 rows when
    the 129th request comes, and that one is refused; the other vehicle is never listed."""

    async def body(conn: asyncpg.Connection) -> tuple[list[tuple[str, ...]], list[str], int, int]:
        refusals = [
            await _put(conn, ["V_FULL"] + (["V_ONE"] if i == 0 else []), f"task_a_{i}", 128) for i in range(129)
        ]
        rows = await conn.fetchval("SELECT count(*) FROM rows WHERE vin = 'V_FULL'")
        return refusals, await _listed(conn), rows, await reads.vehicles_at(conn, 128)

    refusals, listed, rows, gauge = _with_conn(dsn, body)
    assert refusals[:128] == [()] * 128
    assert refusals[128] == ("V_FULL",)
    assert listed == ["V_FULL"] and rows == 128
    assert gauge == 1  # the vehicles-at-bound gauge counts the listed vehicles


def test_a_listed_vehicle_is_counted_on_every_row_and_unlisted_once_drained(dsn: str) -> None:
    """Bound 1000 (64 rows in 1000 counted): a listed vehicle one row short of the bound takes one
    more row and is refused the next; drained to under a quarter of the bound, its next row takes
    it off the list."""

    async def body(conn: asyncpg.Connection) -> tuple[tuple[str, ...], tuple[str, ...], list[str], list[str]]:
        await _fill(conn, "V1", 999)
        await conn.execute("INSERT INTO crowded (vin) VALUES ('V1')")
        last = await _put(conn, ["V1"], "task_b_1", 1_000)
        over = await _put(conn, ["V1"], "task_b_2", 1_000)
        still = await _listed(conn)
        await conn.execute("DELETE FROM rows WHERE vin = 'V1' AND request_id LIKE 'task_fill_%' AND ts_ms > 200")
        await _put(conn, ["V1"], "task_b_3", 1_000)
        return last, over, still, await _listed(conn)

    last, over, still, after = _with_conn(dsn, body)
    assert last == () and over == ("V1",)
    assert still == ["V1"] and after == []


def test_an_unlisted_vehicle_past_the_bound_is_caught_by_a_counted_row(dsn: str) -> None:
    """A vehicle put at the bound behind the store's back (unlisted): of its next rows, each is
    counted with probability 64/1000; the first counted one is refused and lists it, and every row
    after that is refused."""

    async def body(conn: asyncpg.Connection) -> list[tuple[str, ...]]:
        await _fill(conn, "V1", 1_000)
        return [await _put(conn, ["V1"], f"task_c_{i}", 1_000) for i in range(200)]

    refusals = _with_conn(dsn, body)
    first = refusals.index(("V1",))
    assert all(r == ("V1",) for r in refusals[first:])
    assert all(r == () for r in refusals[:first])


def test_a_small_bound_counts_every_vehicle_on_every_row(dsn: str) -> None:
    """Bound 3: the fourth request of a vehicle is refused however random() draws; the vehicle is
    listed from half the bound on, the vehicles with one row are not."""

    async def body(conn: asyncpg.Connection) -> tuple[list[tuple[str, ...]], list[str], int]:
        refusals = [await _put(conn, ["V1", f"W{i}"], f"task_d_{i}", 3) for i in range(5)]
        return refusals, await _listed(conn), await reads.vehicles_at(conn, 3)

    refusals, listed, gauge = _with_conn(dsn, body)
    assert refusals == [(), (), (), ("V1",), ("V1",)]
    assert listed == ["V1"] and gauge == 1  # the gauge counts every vehicle's rows then


def test_the_migration_lists_the_backlogs_stored_before_it(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database at schema 7 holding a vehicle at its bound of 1000 and a vehicle with a few rows:
    migrated to 8, the full one is listed (refused from its next row on, counted by the gauge),
    the other not."""

    async def go() -> tuple[list[str], tuple[str, ...], int]:
        conn = await asyncpg.connect(dsn)
        try:
            with monkeypatch.context() as m:
                m.setattr(migrate, "MIGRATIONS", tuple(v for v in migrate.MIGRATIONS if v[0] < 8))
                await migrate.migrate(conn)
            await _fill(conn, "V_FULL", 1_000)
            await _fill(conn, "V_FEW", 3)
            assert await migrate.migrate(conn) == [v for v, _ in migrate.MIGRATIONS if v >= 8]
            await conn.execute("SELECT setseed(0.25)")
            return (
                await _listed(conn),
                await _put(conn, ["V_FEW", "V_FULL"], "task_e_1", 1_000),
                await reads.vehicles_at(conn, 1_000),
            )
        finally:
            await conn.close()

    listed, refused, gauge = asyncio.run(go())
    assert listed == ["V_FULL"] and refused == ("V_FULL",) and gauge == 1


#: A session waits for another's transaction: the lock a row lock or a unique check waits on.
_WAITING = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted)"


@pytest.mark.parametrize("bound", [3, 1_000])
def test_two_batches_adding_to_a_vehicle_one_row_short_of_its_bound_store_one_row(dsn: str, bound: int) -> None:
    """A vehicle one row short of its bound (listed, for the sampled bound), two batches adding to
    it at once: the second waits for the first to commit (on its listing of the vehicle, or on
    the listing's row lock), then counts the first one's row and is refused. The vehicle ends at
    its bound, not past it."""

    async def go() -> tuple[bool, tuple[str, ...], int]:
        first = await asyncpg.connect(dsn)
        second = await asyncpg.connect(dsn)
        try:
            await migrate.migrate(first)
            await _fill(first, "V1", bound - 1)
            if bound > 64:
                await first.execute("INSERT INTO crowded (vin) VALUES ('V1')")
            tx = first.transaction()
            await tx.start()
            stored = await first.fetchrow(
                "SELECT * FROM sdv_put_rows($1::text[], 'task_f_1', '\\x01'::bytea, 1, 1000, 0, 0::int2, $2)",
                ["V1"],
                bound,
            )
            assert list(stored["refused"]) == []
            racing = asyncio.create_task(_put(second, ["V1"], "task_f_2", bound))
            waited = False
            deadline = asyncio.get_running_loop().time() + 10
            while not waited and asyncio.get_running_loop().time() < deadline:
                waited = await first.fetchval(_WAITING)
                await asyncio.sleep(0.01)
            assert not racing.done()
            await tx.commit()
            refused = await racing
            return waited, refused, await first.fetchval("SELECT count(*) FROM rows WHERE vin = 'V1'")
        finally:
            await first.close()
            await second.close()

    waited, refused, rows = asyncio.run(go())
    assert waited and refused == ("V1",) and rows == bound
