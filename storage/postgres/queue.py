"""A vehicle's queue on PostgreSQL: its pending rows, the next one to deliver, its backlog.

The answers of `Store.pending`, `Store.oldest` and `Store.backlog` (storage/lmdb/store.py). Delivery
order: rows whose batch asked high priority first, then by store time, then by request id (byte
order: the columns are COLLATE "C"); dispatch adds the requests whose policy says high.
A row is deliverable unless it is past its expires_at or a cancel of every vehicle in progress
took it by its cut (`Store._visible_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping

from storage import model
from storage.model import now_ms as clock_ms
from storage.postgres.types import Connection, Record

_COLUMNS = "r.request_id, r.ts_ms, r.sha1, r.size, r.expires_ms, r.flags"
# Not hidden: $2/$3 are the request ids and sha1s of rows acked but not deleted yet.
_NOT_HIDDEN = """NOT EXISTS (SELECT 1 FROM unnest($2::text[], $3::bytea[]) AS h(rid, sha1)
                 WHERE h.rid = r.request_id AND h.sha1 = r.sha1)"""
# The first deliverable row with the count of them all (one snapshot), its payload read for it alone.
_OLDEST = f"""
SELECT q.*, (SELECT data FROM blobs b WHERE b.sha1 = q.sha1) AS data FROM (
    SELECT {_COLUMNS}, count(*) OVER () AS n
    FROM rows r LEFT JOIN cancels c ON c.request_id = r.request_id
    WHERE r.vin = $1 AND NOT (r.expires_ms > 0 AND r.expires_ms <= $4)
        AND (c.cut_ms IS NULL OR r.ts_ms > c.cut_ms) AND {_NOT_HIDDEN}
    ORDER BY (r.flags & 2) = 0, r.ts_ms, r.request_id LIMIT 1) q
"""
# Its blob is gone (lost data, never the normal case): the first deliverable row that has one.
_OLDEST_WITH_BLOB = f"""
SELECT {_COLUMNS}, b.data
FROM rows r JOIN blobs b ON b.sha1 = r.sha1 LEFT JOIN cancels c ON c.request_id = r.request_id
WHERE r.vin = $1 AND NOT (r.expires_ms > 0 AND r.expires_ms <= $4)
    AND (c.cut_ms IS NULL OR r.ts_ms > c.cut_ms) AND {_NOT_HIDDEN}
ORDER BY (r.flags & 2) = 0, r.ts_ms, r.request_id LIMIT 1
"""


def _row(vin: str, r: Record) -> model.Row:
    return model.Row(vin, r["request_id"], r["ts_ms"], bytes(r["sha1"]), r["size"], r["expires_ms"], r["flags"])


async def pending(conn: Connection, vin: str) -> list[model.Row]:
    """The vehicle's pending rows in delivery order (deliverable or not)."""
    query = f"SELECT {_COLUMNS} FROM rows r WHERE r.vin = $1 ORDER BY (r.flags & 2) = 0, r.ts_ms, r.request_id"
    found = await conn.fetch(query, vin)
    return [_row(vin, r) for r in found]


async def oldest(
    conn: Connection, vin: str, hidden: Mapping[str, bytes] | None = None, now_ms: int | None = None
) -> tuple[tuple[model.Row, bytes] | None, int]:
    """The vehicle's next deliverable row and its payload (None when there is none), and how many
    deliverable rows it has besides the `hidden` ones (request id -> sha1 of rows acked, their
    delete not committed yet). `now_ms` (default: the wall clock) decides what is past its
    expires_at. A row whose blob is missing is skipped."""
    hide = dict(hidden or {})
    args = (vin, list(hide), list(hide.values()), clock_ms() if now_ms is None else now_ms)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        first = await conn.fetchrow(_OLDEST, *args)
        if first is None:
            return None, 0
        count = int(first["n"])
        if first["data"] is None:
            first = await conn.fetchrow(_OLDEST_WITH_BLOB, *args)
            if first is None:
                return None, count
    return (_row(vin, first), bytes(first["data"])), count


async def backlog(conn: Connection, vin: str) -> int:
    """The vehicle's pending rows, deliverable or not."""
    return int(await conn.fetchval("SELECT count(*) FROM rows WHERE vin = $1", vin))
