"""PostgreSQL: campaign policies, one per request id in the `policies` table (sql/schema.sql).

A policy is set or cleared in one statement (its own transaction): every instance reads the same
row, so a policy holds across instances. The statement also NOTIFYs `CHANNEL` (delivered at its
commit, to every session LISTENing in this database) with `notice(request_id, ms)`, so instances
read the row again at once (exhook_server/backends/postgres/policy_sync.py). Its `aborted` column
holds the abort of the request under it (batches.abort); setting or clearing the policy removes it,
re-opening the request. The store keeps the policy's JSON as given and never reads it:
exhook_server/policy.py validated it before, and reads it back.
"""

from __future__ import annotations

from storage.errors import PoliciesFull
from storage.model import StoredPolicy
from storage.postgres.types import Connection, Record

#: The channel a stored or cleared policy is announced on (NOTIFY reaches this database only).
CHANNEL = "sdv_fanout_policy"
#: The channel the instances' listeners answer on: "ready", "here", "ack " + a notice.
ACK_CHANNEL = "sdv_fanout_policy_ack"

# One statement: a new request id's policy only while fewer than $4 are in force (concurrent
# first sets of different ids on several instances may pass the count together: the bound is
# exact per instance, about right across them). xmax <> 0: the row was there and is updated.
# The NOTIFY ($5: `notice`) only when the row was written: a refused policy announces nothing.
_SET = f"""
WITH s AS (
    INSERT INTO policies (request_id, doc, set_ms)
    SELECT $1, $2, $3
    WHERE EXISTS (SELECT 1 FROM policies WHERE request_id = $1) OR (SELECT count(*) FROM policies) < $4
    ON CONFLICT (request_id) DO UPDATE SET doc = EXCLUDED.doc, set_ms = EXCLUDED.set_ms, aborted = NULL
    RETURNING xmax <> 0 AS had
)
SELECT had, pg_notify('{CHANNEL}', $5) FROM s
"""

# A clear is announced whether or not a policy was there: an instance may still hold one.
_CLEAR = f"""
WITH d AS (DELETE FROM policies WHERE request_id = $1 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM d) AS had, pg_notify('{CHANNEL}', $2)
"""


def notice(request_id: str, ms: int) -> str:
    """The payload announcing the policy of `request_id` set (or cleared) at `ms`: well under
    NOTIFY's 8000 bytes (a request id has at most 256)."""
    return f"{ms} {request_id}"


def read_notice(payload: str) -> tuple[str, int]:
    """(request id, ms) of a `notice`; ValueError if it is not one."""
    ms, request_id = payload.split(" ", 1)
    return request_id, int(ms)


async def set_policy(conn: Connection, request_id: str, doc: bytes | None, now_ms: int, max_count: int) -> bool:
    """Store `doc` as the policy of `request_id` (None: clear it), announced on `CHANNEL`; True if
    one was in force before. PoliciesFull when `max_count` policies of other requests are in force."""
    if doc is None:
        return await conn.fetchval(_CLEAR, request_id, notice(request_id, now_ms)) is True
    had = await conn.fetchval(_SET, request_id, doc, now_ms, max_count, notice(request_id, now_ms))
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


async def amend_abort(conn: Connection, request_id: str, before: bytes, after: bytes) -> bool:
    """Replace the abort record `before` of `request_id` with `after`; False, writing nothing,
    when the record is not `before`. Twin: lmdb/policies.amend_abort."""
    sql = "UPDATE policies SET aborted = $3 WHERE request_id = $1 AND aborted = $2 RETURNING true"
    return await conn.fetchval(sql, request_id, before, after) is True


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


async def announce(conn: Connection, message: str) -> None:
    """NOTIFY `message` on `ACK_CHANNEL` from this session (its backend pid names the sender)."""
    await conn.execute("SELECT pg_notify($1, $2)", ACK_CHANNEL, message)


async def connected(conn: Connection, pids: list[int], application_name: str) -> set[int]:
    """Which of the sessions `pids` are still connected under `application_name` (a pid of an
    ended session may be reused by another)."""
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1::int[]) AND application_name = $2", pids, application_name
    )
    return {int(r["pid"]) for r in rows}
