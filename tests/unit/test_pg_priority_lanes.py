"""PostgreSQL's next-row read with the priority lanes (sdv_vin_load_many through
storage.postgres.dispatch.load_many): each vehicle's rows come high priority first (its batch's
flag or its request in `high`), oldest first, and a vehicle event reads the head of each lane by
index, never a vehicle's whole queue (counted by the table's own statistics)."""

from __future__ import annotations

import asyncio

import asyncpg

from storage.model import FLAG_HIGH_PRIORITY, RowSpec
from storage.postgres import batches, migrate
from storage.postgres import dispatch as pgd
from testkit.pg_cluster import PgCluster

VINS = [f"VIN{n:03d}" for n in range(20)]
QUEUE = 300


async def rows_read(conn: asyncpg.Connection) -> int:
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    found = await conn.fetchval(
        "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'rows'"
    )
    return int(found)


def test_a_vehicle_event_reads_each_lanes_head_not_the_whole_queue(pg_cluster: PgCluster) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(pg_cluster.new_database("priority_lanes"))
        try:
            await migrate.migrate(conn)
            for i in range(QUEUE):
                spec = RowSpec(flags=FLAG_HIGH_PRIORITY) if i == QUEUE - 1 else RowSpec()
                await batches.store_batch(conn, VINS, f"task_{i:04d}", b"p%d" % (i % 3), 1000 + i, spec=spec)
            await conn.execute("ANALYZE")
            before = await rows_read(conn)
            loaded = await pgd.load_many(conn, VINS, 10**13, 3, (), frozenset({"task_0007"}))
            read = await rows_read(conn) - before
            for vin in VINS:
                # task_0007 by its policy, then the flagged one (newer), then the oldest normal one.
                assert [r.request_id for r, _ in loaded[vin].rows] == [
                    "task_0007",
                    f"task_{QUEUE - 1:04d}",
                    "task_0000",
                ]
            # A few rows per vehicle and lane, against QUEUE rows per vehicle for a whole pass.
            assert read <= len(VINS) * 12, read
        finally:
            await conn.close()

    asyncio.run(go())
