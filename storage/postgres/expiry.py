"""Rows that end `expired` on PostgreSQL: the expires_at sweep, and retention by store time.

Each function runs one transaction with the result of its twin (`storage.lmdb.queue.expire_due`,
`storage.lmdb.queue.first_deadline`, `storage.lmdb.gc.expire_rows`). Rows are picked `FOR UPDATE SKIP
LOCKED`: a row another transaction holds (an ack, a replacing batch) is left to the next sweep,
so several instances may sweep at once without waiting on each other or on ingest.
"""

from __future__ import annotations

from storage.model import Outcome
from storage.model import now_ms as clock_ms
from storage.postgres import batches, outcomes
from storage.postgres.outcomes import Bumps, Ended
from storage.postgres.types import Connection, Record

_EXPIRE_DUE = """
WITH due AS (
    SELECT vin, request_id FROM rows WHERE expires_ms > 0 AND expires_ms <= $1
    ORDER BY expires_ms, request_id, vin LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM rows r USING due d WHERE r.vin = d.vin AND r.request_id = d.request_id
RETURNING r.vin, r.request_id, r.sha1, r.ts_ms, r.expires_ms
"""
_EXPIRE_OLD = """
WITH old AS (
    SELECT vin, request_id FROM rows WHERE ts_ms < $1
    ORDER BY ts_ms, vin, request_id LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM rows r USING old o WHERE r.vin = o.vin AND r.request_id = o.request_id
RETURNING r.vin, r.request_id, r.sha1, r.ts_ms
"""


async def end_expired(conn: Connection, deleted: list[Record], now_ms: int) -> None:
    """Outcome records and counts for rows just deleted as `expired` (records with vin,
    request_id, sha1, ts_ms), in the caller's transaction."""
    ended = [Ended(r["vin"], r["request_id"], bytes(r["sha1"]), r["ts_ms"], Outcome.EXPIRED) for r in deleted]
    bumps = Bumps()
    await outcomes.end_pairs(conn, ended, now_ms, bumps)
    await bumps.write(conn, now_ms)


async def expire_due(conn: Connection, now_ms: int, limit: int) -> list[tuple[str, str, bytes]]:
    """End `expired` up to `limit` rows whose expires_at is at or before `now_ms`, soonest first
    (then request id, VIN); (VIN, request id, sha1) of each, in that order."""

    async def body() -> list[Record]:
        found = await conn.fetch(_EXPIRE_DUE, now_ms, limit)
        await end_expired(conn, found, now_ms)
        return found

    deleted = await batches.retrying(conn, "expiry sweep", body)
    deleted.sort(key=lambda r: (r["expires_ms"], r["request_id"].encode(), r["vin"].encode()))
    return [(r["vin"], r["request_id"], bytes(r["sha1"])) for r in deleted]


async def first_deadline(conn: Connection) -> int | None:
    """The soonest expires_at of any row (ms), None when no row has one."""
    found = await conn.fetchval("SELECT min(expires_ms) FROM rows WHERE expires_ms > 0")
    return None if found is None else int(found)


async def expire_rows(conn: Connection, cutoff_ms: int, limit: int, now_ms: int | None = None) -> int:
    """Retention: end `expired` up to `limit` rows stored before `cutoff_ms`, oldest first; how
    many. Their outcomes are stamped with the wall clock, as `gc.expire_rows` does (`now_ms`
    overrides it)."""
    when = clock_ms() if now_ms is None else now_ms

    async def body() -> int:
        found = await conn.fetch(_EXPIRE_OLD, cutoff_ms, limit)
        await end_expired(conn, found, when)
        return len(found)

    return await batches.retrying(conn, "retention", body)
