"""PostgreSQL: applying a Spark GC plan (`storage.plan.apply_plan_to`) with LMDB's rules.

A row is deleted only if it still carries the planned ts, and ends `expired` with its outcome record
and counts, as retention ends it; an alias only if not rewritten since; a blob only if not created or
touched since the plan's snapshot minus its grace (`storage.postgres.gc.delete_blobs`). Each chunk is
one transaction locking rows in key order; a row another transaction holds is skipped, never waited
for, and counted as kept (the next plan looks at it again). `PgTarget` is synchronous, as the plan
walk is: it runs each delete on an event loop, its own or (`threadsafe`) one running in another thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import TypeVar

from storage.model import now_ms as clock_ms
from storage.postgres import batches, expiry
from storage.postgres import gc as pg_gc
from storage.postgres.types import Connection

T = TypeVar("T")

# The planned rows still at their planned ts, locked in key order, skipping any another
# transaction holds; the join is re-checked on the latest version of a row changed meanwhile (READ
# COMMITTED), so a row replaced since the export is not deleted.
_DELETE_PLANNED_ROWS = """
WITH planned AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[]) AS p(vin, request_id, ts)
), doomed AS (
    SELECT r.vin, r.request_id FROM rows r JOIN planned p
        ON r.vin = p.vin AND r.request_id = p.request_id AND r.ts_ms = p.ts
    ORDER BY r.vin, r.request_id FOR UPDATE OF r SKIP LOCKED
)
DELETE FROM rows r USING doomed d WHERE r.vin = d.vin AND r.request_id = d.request_id
RETURNING r.vin, r.request_id, r.sha1, r.ts_ms
"""
# After the delete: the planned pairs still there, replaced since the export or skipped (locked).
_KEPT_ROWS = """
SELECT count(*) FROM rows r JOIN unnest($1::text[], $2::text[]) AS p(vin, request_id)
    ON r.vin = p.vin AND r.request_id = p.request_id
"""
_DELETE_PLANNED_ALIASES = """
DELETE FROM aliases a USING unnest($1::text[], $2::int8[]) AS p(data_id, ts)
WHERE a.data_id = p.data_id AND a.ts_ms = p.ts
"""


async def delete_planned_rows(conn: Connection, planned: Sequence[tuple[str, str, int]]) -> tuple[int, int]:
    """End `expired` the planned (VIN, request id, ts) rows still at that ts: (deleted, kept
    because replaced since or held by another transaction), as `storage.lmdb.gc.delete_planned_rows`."""
    vins, rids, tss = ([p[i] for p in planned] for i in range(3))

    async def body() -> tuple[int, int]:
        deleted = await conn.fetch(_DELETE_PLANNED_ROWS, vins, rids, tss)
        await expiry.end_expired(conn, deleted, clock_ms())
        return len(deleted), int(await conn.fetchval(_KEPT_ROWS, vins, rids))

    return await batches.retrying(conn, "gc apply", body)


async def delete_planned_aliases(conn: Connection, planned: Sequence[tuple[str, int]]) -> int:
    """Delete the planned (data_id, ts) aliases not rewritten since; how many."""
    status = await conn.execute(_DELETE_PLANNED_ALIASES, [p[0] for p in planned], [p[1] for p in planned])
    return int(status.rsplit(" ", 1)[1])


class PgTarget:
    """`storage.plan.PlanTarget` on one asyncpg connection, driven by `loop`: not running, or
    with `threadsafe` running in another thread than the walk's."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: Connection, *, threadsafe: bool = False) -> None:
        self._loop, self._conn, self._threadsafe = loop, conn, threadsafe

    def _run(self, work: Coroutine[object, None, T]) -> T:
        if self._threadsafe:
            return asyncio.run_coroutine_threadsafe(work, self._loop).result()
        return self._loop.run_until_complete(work)

    def delete_rows(self, planned: Sequence[tuple[str, str, int]]) -> tuple[int, int]:
        return self._run(delete_planned_rows(self._conn, planned))

    def delete_aliases(self, planned: Sequence[tuple[str, int]]) -> int:
        return self._run(delete_planned_aliases(self._conn, planned))

    def delete_blobs(self, sha1s: Sequence[bytes], cutoff_ms: int) -> tuple[int, int, int]:
        return self._run(pg_gc.delete_blobs(self._conn, sha1s, cutoff_ms))
