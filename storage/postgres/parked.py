"""The plugin format on PostgreSQL: data messages, triggers, and triggers parked until their data.

Each function runs one transaction and returns what its twin in `storage.lmdb.parked` returns. A data
message and the triggers of its data_id meet under an advisory lock on the data_id: a trigger
holds it shared while it looks the data up and parks, a data message (and a completion chunk)
holds it exclusive. A trigger therefore either sees the data, or is parked before the data's
transaction looks for parked triggers: none is left waiting for data that is there.
"""

from __future__ import annotations

from collections.abc import Sequence

from storage.errors import EarlyTriggersFull
from storage.model import (
    PLAIN,
    BatchWritten,
    DataWritten,
    Duplicate,
    EarlyCompleted,
    EarlyExpired,
    RowSpec,
    TriggerWritten,
    sha1_of,
)
from storage.postgres import batches
from storage.postgres.constants import LockClass
from storage.postgres.types import Connection, Record, fetch_one

_KNOWN_DATA = """
SELECT a.sha1, length(b.data) AS size FROM aliases a JOIN blobs b ON b.sha1 = a.sha1 WHERE a.data_id = $1
"""
_RECORD_BATCH = """
INSERT INTO batches (batch_id, request_id, sha1, rows, refused, ts_ms) VALUES ($1, $2, $3, $4, $5::text[], $6)
ON CONFLICT (batch_id) DO UPDATE SET request_id = EXCLUDED.request_id, sha1 = EXCLUDED.sha1, rows = EXCLUDED.rows,
    refused = EXCLUDED.refused
"""
_TRIGGER_COLUMNS = "seq, request_id, vins, ts_ms, batch_id, correlation_id, expires_ms, flags"


async def _lock_data(conn: Connection, data_id: str, *, shared: bool) -> None:
    fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    await conn.execute(f"SELECT {fn}($1, hashtext($2))", LockClass.DATA, data_id)


def _stored(vins: Sequence[str], refused: tuple[str, ...]) -> tuple[str, ...]:
    gone = set(refused)
    return tuple(v for v in vins if v not in gone)


async def store_data(
    conn: Connection, data_id: str, blob: bytes, now_ms: int, max_rows: int = 10_000, max_pending: int = 0
) -> DataWritten:
    """A `$SDV-FANOUT/data/<data_id>` payload: the blob, the alias, and the triggers waiting for it
    up to `max_rows` rows (`more`: some still wait, see `complete_early`), as `storage.lmdb.parked.store_data`."""

    async def body() -> DataWritten:
        await _lock_data(conn, data_id, shared=False)
        sha1 = sha1_of(blob)
        new_blob = await batches.put_blob(conn, sha1, blob, now_ms)
        await conn.execute(
            "INSERT INTO aliases (data_id, sha1, ts_ms) VALUES ($1, $2, $3)"
            " ON CONFLICT (data_id) DO UPDATE SET sha1 = EXCLUDED.sha1, ts_ms = EXCLUDED.ts_ms",
            data_id,
            sha1,
            now_ms,
        )
        done = await _complete(conn, data_id, sha1, len(blob), now_ms, max_rows, max_pending)
        return DataWritten(data_id, sha1, new_blob, done.completed, done.more, done.expired)

    return await batches.retrying(conn, f"data {data_id}", body)


async def complete_early(
    conn: Connection, data_id: str, now_ms: int, max_rows: int, max_pending: int = 0
) -> EarlyCompleted:
    """One more chunk of the triggers waiting for `data_id`, whose data has arrived: oldest first,
    at most `max_rows` rows but at least one trigger (`storage.lmdb.parked.complete_early`)."""

    async def body() -> EarlyCompleted:
        await _lock_data(conn, data_id, shared=False)
        known = await conn.fetchrow(_KNOWN_DATA, data_id)
        if known is None:
            return EarlyCompleted((), False)  # expired or collected meanwhile: the sweeper drops them
        sha1 = bytes(known["sha1"])
        if not await batches.touch_blob(conn, sha1, now_ms):
            raise batches.Raced
        return await _complete(conn, data_id, sha1, known["size"], now_ms, max_rows, max_pending)

    return await batches.retrying(conn, f"early triggers of {data_id}", body)


async def _complete(
    conn: Connection, data_id: str, sha1: bytes, size: int, now_ms: int, max_rows: int, max_pending: int
) -> EarlyCompleted:
    sizes = await conn.fetch(
        "SELECT seq, cardinality(vins) AS n FROM early_triggers WHERE data_id = $1 ORDER BY seq FOR UPDATE", data_id
    )
    picked: list[int] = []
    rows = 0
    more = False
    for seq, n in sizes:
        if picked and rows + n > max_rows:
            more = True
            break
        rows += n
        picked.append(seq)
    if not picked:
        return EarlyCompleted((), False)
    taken = await conn.fetch(
        f"DELETE FROM early_triggers WHERE data_id = $1 AND seq = ANY($2::int8[]) RETURNING {_TRIGGER_COLUMNS}",
        data_id,
        picked,
    )
    triggers = sorted(taken, key=lambda t: t["seq"])
    live = [t for t in triggers if not 0 < t["expires_ms"] <= now_ms]
    await _lock_ahead(conn, live)
    completed: list[BatchWritten] = []
    expired: list[EarlyExpired] = []
    for trig in triggers:
        rid, vins, batch_id = trig["request_id"], list(trig["vins"]), trig["batch_id"]
        if 0 < trig["expires_ms"] <= now_ms:  # its data came too late for it
            if batch_id is not None:
                await conn.execute("DELETE FROM batches WHERE batch_id = $1", batch_id)
            age = now_ms - trig["ts_ms"]
            expired.append(EarlyExpired(data_id, rid, len(vins), age, batch_id, trig["correlation_id"], "expired"))
            continue
        spec = RowSpec(trig["expires_ms"], trig["flags"], max_pending)
        put = await batches.put_rows(conn, vins, rid, sha1, size, now_ms, spec)
        if batch_id is not None:
            await conn.execute(
                _RECORD_BATCH, batch_id, rid, sha1, len(vins) - len(put.refused), list(put.refused), now_ms
            )
        completed.append(
            BatchWritten(
                rid,
                sha1,
                _stored(vins, put.refused),
                put.replaced,
                False,
                put.superseded,
                batch_id,
                trig["correlation_id"],
                put.refused,
            )
        )
    return EarlyCompleted(tuple(completed), more, tuple(expired))


async def _lock_ahead(conn: Connection, triggers: Sequence[Record]) -> None:
    """Take, up front and in the store's lock order, what completing `triggers` one after another
    would lock in trigger order: the request locks, cancel jobs (request order), then the rows
    (VIN order). Two triggers of a chunk may name the same VINs in other orders."""
    if not triggers:
        return
    rids = sorted({t["request_id"] for t in triggers})
    await conn.execute(
        "SELECT pg_advisory_xact_lock_shared($1, hashtext(r)) FROM unnest($2::text[]) AS r", LockClass.REQUEST, rids
    )
    await conn.execute("SELECT 1 FROM cancels WHERE request_id = ANY($1::text[]) ORDER BY request_id FOR UPDATE", rids)
    pairs = sorted({(v, t["request_id"]) for t in triggers for v in t["vins"]})
    await conn.execute(
        """SELECT 1 FROM rows WHERE (vin, request_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))
           ORDER BY vin, request_id FOR UPDATE""",
        [v for v, _ in pairs],
        [r for _, r in pairs],
    )


async def store_trigger(
    conn: Connection,
    data_id: str,
    vins: Sequence[str],
    request_id: str,
    now_ms: int,
    early_max: int,
    early_max_rows: int = 1_000_000,
    batch_id: str | None = None,
    correlation_id: str | None = None,
    spec: RowSpec = PLAIN,
    *,
    dry_run: bool = False,
) -> TriggerWritten | Duplicate:
    """A trigger: rows now if its data is known, else parked until the data comes (at most
    `early_max` triggers naming at most `early_max_rows` rows, else EarlyTriggersFull and nothing
    written); nothing if `batch_id` was stored or parked before (`storage.lmdb.parked.store_trigger`).
    With `dry_run` the same transaction is rolled back (`batches.undone`): what it would do now."""

    async def body() -> TriggerWritten | Duplicate:
        if batch_id is not None and (dup := await batches.claim_batch_id(conn, batch_id, request_id, now_ms)):
            return dup
        await batches.refuse_aborted(conn, request_id)
        await _lock_data(conn, data_id, shared=True)
        known = await conn.fetchrow(_KNOWN_DATA, data_id)
        if known is not None:
            sha1 = bytes(known["sha1"])
            if not await batches.touch_blob(conn, sha1, now_ms):
                raise batches.Raced
            put = await batches.put_rows(conn, vins, request_id, sha1, known["size"], now_ms, spec)
            if batch_id is not None:
                await conn.execute(
                    _RECORD_BATCH, batch_id, request_id, sha1, len(vins) - len(put.refused), list(put.refused), now_ms
                )
            stored = _stored(vins, put.refused)
            written = BatchWritten(request_id, sha1, stored, put.replaced, False, put.superseded, refused=put.refused)
            return TriggerWritten(data_id, request_id, written, False)
        await _park(conn, data_id, vins, request_id, now_ms, early_max, early_max_rows, batch_id, correlation_id, spec)
        return TriggerWritten(data_id, request_id, None, True)

    if dry_run:
        return await batches.retrying_call(f"trigger preview of {request_id}", lambda: batches.undone(conn, body))
    return await batches.retrying(conn, f"trigger of {request_id}", body)


async def _park(
    conn: Connection,
    data_id: str,
    vins: Sequence[str],
    request_id: str,
    now_ms: int,
    early_max: int,
    early_max_rows: int,
    batch_id: str | None,
    correlation_id: str | None,
    spec: RowSpec,
) -> None:
    """Park a trigger (its batch_id was claimed with no sha1: the receipt of a parked trigger)."""
    parked, parked_rows = await fetch_one(
        conn, "SELECT count(*), coalesce(sum(cardinality(vins)), 0) FROM early_triggers"
    )
    if parked >= early_max:
        raise EarlyTriggersFull(f"{early_max} triggers already wait for their data")
    if parked_rows + len(vins) > early_max_rows:
        raise EarlyTriggersFull(f"{parked_rows} rows already wait for their data (early_max_rows {early_max_rows})")
    await conn.execute(
        """INSERT INTO early_triggers (data_id, request_id, vins, ts_ms, batch_id, correlation_id, expires_ms, flags)
           VALUES ($1, $2, $3::text[], $4, $5, $6, $7, $8)""",
        data_id,
        request_id,
        list(vins),
        now_ms,
        batch_id,
        correlation_id,
        spec.expires_ms,
        spec.flags,
    )


async def expire_early(conn: Connection, now_ms: int, ttl_ms: int, limit: int) -> list[EarlyExpired]:
    """Drop up to `limit` parked triggers at least `ttl_ms` old, in (data_id, arrival) order, and
    forget their batch ids (`storage.lmdb.parked.expire_early`). Triggers another transaction is completing are
    passed over (SKIP LOCKED), so several instances may sweep at once."""
    async with conn.transaction():
        gone = await conn.fetch(
            """WITH doomed AS (
                   SELECT data_id, seq FROM early_triggers WHERE ts_ms <= $1::int8 - $2::int8
                   ORDER BY data_id, seq LIMIT $3 FOR UPDATE SKIP LOCKED)
               DELETE FROM early_triggers e USING doomed d WHERE e.data_id = d.data_id AND e.seq = d.seq
               RETURNING e.data_id, e.seq, e.request_id, cardinality(e.vins) AS n, e.ts_ms, e.batch_id,
                   e.correlation_id""",
            now_ms,
            ttl_ms,
            limit,
        )
        gone = sorted(gone, key=lambda t: (t["data_id"].encode(), t["seq"]))
        batch_ids = [t["batch_id"] for t in gone if t["batch_id"] is not None]
        if batch_ids:  # a retry after the expiry is a new trigger, not a duplicate
            await conn.execute("DELETE FROM batches WHERE batch_id = ANY($1::text[])", batch_ids)
    return [
        EarlyExpired(t["data_id"], t["request_id"], t["n"], now_ms - t["ts_ms"], t["batch_id"], t["correlation_id"])
        for t in gone
    ]


async def waiting_data_ids(conn: Connection) -> list[str]:
    """data_ids that parked triggers wait for although their data is stored: what a crash left
    between two completion chunks (`storage.lmdb.parked.waiting_data_ids`)."""
    found = await conn.fetch(
        "SELECT DISTINCT e.data_id FROM early_triggers e JOIN aliases a ON a.data_id = e.data_id ORDER BY 1"
    )
    return [r[0] for r in found]
