"""PostgreSQL writes nobody waits for any more (storage/postgres/writes.PgWrites.settle): a write whose
caller was cancelled keeps running (its wait was shielded), and the backend settles it before the
pool closes, so no task is left pending on a loop that closes."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from storage.postgres.writes import PgWrites


def test_a_write_left_by_its_caller_is_settled_before_the_pool_closes(pg_dsn: str) -> None:
    async def body() -> None:
        pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
        writes = PgWrites(pool, timeout_s=30.0)
        held = await pool.acquire()  # the only connection: the write waits for it
        caller = asyncio.ensure_future(writes.store_batch(["VIN1"], "task_a_1", b"x", 1))
        await asyncio.sleep(0)  # let the write start
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert await writes.settle(0.2) == 1  # still waiting for the connection: cancelled
        assert await writes.settle(0.2) == 0
        await pool.release(held)
        await asyncio.wait_for(pool.close(), 10)
        assert await pool_rows(pg_dsn) == 0  # the cancelled write never ran

    asyncio.run(body())


def test_a_write_that_can_finish_is_waited_for(pg_dsn: str) -> None:
    async def body() -> None:
        pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
        writes = PgWrites(pool, timeout_s=30.0)
        held = await pool.acquire()
        caller = asyncio.ensure_future(writes.store_batch(["VIN2"], "task_b_1", b"y", 1))
        await asyncio.sleep(0)
        caller.cancel()
        asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(pool.release(held)))
        assert await writes.settle(10) == 0  # it got the connection and committed
        await asyncio.wait_for(pool.close(), 10)
        assert await pool_rows(pg_dsn) == 1

    asyncio.run(body())


async def pool_rows(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM rows"))
    finally:
        await conn.close()
