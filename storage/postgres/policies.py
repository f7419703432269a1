"""PostgreSQL: campaign policies, one per request id in the `policies` table (sql/schema.sql).

A policy is set or cleared in one statement (its own transaction): every instance reads the same
row, so a policy holds across instances. Its `aborted` column holds the abort of the request under
it (batches.abort); setting or clearing the policy removes it, re-opening the request. The store
keeps the policy's JSON as given and never reads it: exhook_server/policy.py validated it before,
and reads it back.
"""

from __future__ import annotations

from storage.errors import PoliciesFull
from storage.model import StoredPolicy
from storage.postgres.types import Connection, Record

# One statement: a new request id's policy only while fewer than $4 are in force (concurrent
# first sets of different ids on several instances may pass the count together: the bound is
# exact per instance, about right across them). xmax <> 0: the row was there and is updated.
_SET = """
INSERT INTO policies (request_id, doc, set_ms)
SELECT $1, $2, $3
WHERE EXISTS (SELECT 1 FROM policies WHERE request_id = $1) OR (SELECT count(*) FROM policies) < $4
ON CONFLICT (request_id) DO UPDATE SET doc = EXCLUDED.doc, set_ms = EXCLUDED.set_ms, aborted = NULL
RETURNING xmax <> 0 AS had
"""


async def set_policy(conn: Connection, request_id: str, doc: bytes | None, now_ms: int, max_count: int) -> bool:
    """Store `doc` as the policy of `request_id` (None: clear it); True if one was in force before.
    PoliciesFull when `max_count` policies of other requests are in force."""
    if doc is None:
        return await conn.fetchval("DELETE FROM policies WHERE request_id = $1 RETURNING true", request_id) is True
    had = await conn.fetchval(_SET, request_id, doc, now_ms, max_count)
    if had is None:
        raise PoliciesFull(f"{max_count} campaign policies are in force (max_policies)")
    return bool(had)


async def policy(conn: Connection, request_id: str) -> StoredPolicy | None:
    """The policy of `request_id`, or None."""
    row = await conn.fetchrow("SELECT doc, set_ms, aborted FROM policies WHERE request_id = $1", request_id)
    return None if row is None else _stored(request_id, row)


def _stored(request_id: str, row: Record) -> StoredPolicy:
    aborted = row["aborted"]
    return StoredPolicy(request_id, bytes(row["doc"]), int(row["set_ms"]), None if aborted is None else bytes(aborted))


async def pending_vins(conn: Connection, request_id: str, after: str, limit: int) -> list[str]:
    """Up to `limit` VINs holding a pending row of `request_id`, in VIN order past `after`
    (the `rows_request` index)."""
    rows = await conn.fetch(
        "SELECT vin FROM rows WHERE request_id = $1 AND vin > $2 ORDER BY vin LIMIT $3", request_id, after, limit
    )
    return [r["vin"] for r in rows]


async def all_policies(conn: Connection) -> list[StoredPolicy]:
    """Every policy in force, by request id."""
    rows = await conn.fetch("SELECT request_id, doc, set_ms, aborted FROM policies ORDER BY request_id")
    return [_stored(r["request_id"], r) for r in rows]
