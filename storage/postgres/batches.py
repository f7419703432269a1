"""Write operations of the PostgreSQL store, one transaction each, with the LMDB ops' results.

Each function takes an asyncpg connection, runs one transaction and returns what its twin in
`storage.lmdb.batches` / `storage.lmdb.cancel` returns for the same store contents. Rows are written with one
`INSERT ... SELECT FROM unnest(...) ON CONFLICT DO UPDATE` per batch; every multi-row statement
goes in VIN order (one lock order, so concurrent transactions never deadlock on rows); outcome
records and generation counts change in the same transaction as the rows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, cast

import asyncpg

from storage.errors import StorageError
from storage.model import PLAIN, BatchWritten, CancelChunk, Duplicate, Outcome, RowSpec, RowsPut, sha1_of
from storage.postgres import outcomes
from storage.postgres.constants import LockClass
from storage.postgres.outcomes import Bumps, Ended
from storage.postgres.types import Connection, Record, fetch_one

T = TypeVar("T")

#: A blob's touched_ms is rewritten at most this often: every batch of a campaign names the same
#: blob, and an update would hold its row lock to each commit, one batch after another. GC's
#: grace period (minutes) dwarfs it.
TOUCH_EVERY_MS = 1_000
#: Times a batch is retried when a concurrent one created a row between our read and our upsert.
RACE_RETRIES = 5
#: The cut of a cancel that names its VINs: every row (the largest bigint).
_NO_CUT = 2**63 - 1


class Raced(Exception):
    """A concurrent transaction created a row this one had read as absent: retry from the start."""


async def retrying(conn: Connection, what: str, body: Callable[[], Awaitable[T]]) -> T:
    """Run `body` in a transaction of `conn`, again from the start as `retrying_call` says."""

    async def in_a_transaction() -> T:
        async with conn.transaction():
            return await body()

    return await retrying_call(what, in_a_transaction)


async def retrying_call(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, a transaction (a function of sql/functions/batches.sql is one by itself), again from the start (at
    most RACE_RETRIES times) when it raises `Raced` or serialization_failure (a concurrent write
    changed what it had read), or when PostgreSQL aborted it to break a deadlock (its documented
    remedy: run the transaction again; nothing of a failed try committed)."""
    for _ in range(RACE_RETRIES):
        try:
            return await call()
        except (Raced, asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError):
            continue
    raise StorageError(f"{what} kept racing concurrent writes ({RACE_RETRIES} tries)")


class _Undo(Exception):
    """Ends a preview's transaction (rolled back) with what its statement returned."""

    def __init__(self, out: object) -> None:
        self.out = out


async def undone(conn: Connection, call: Callable[[], Awaitable[T]]) -> T:
    """`call()` (a batch's or a trigger's write) in a transaction of `conn` that is rolled back:
    what it would do now, its own decision, writing nothing (a preview)."""
    try:
        async with conn.transaction():
            raise _Undo(await call())
    except _Undo as undo:
        return cast(T, undo.out)


async def store_batch(
    conn: Connection,
    vins: Sequence[str],
    request_id: str,
    blob: bytes,
    now_ms: int,
    batch_id: str | None = None,
    spec: RowSpec = PLAIN,
    *,
    dry_run: bool = False,
) -> BatchWritten | Duplicate:
    """The blob once, then one row per VIN; nothing if `batch_id` was stored (`ops.store_batch`).
    `vins` are distinct (the hook layer folds duplicates). One round trip: `sdv_store_batch`
    (sql/functions/batches.sql) is the whole transaction. With `dry_run` the same statement runs
    in a transaction that is rolled back: what the batch would do now, its own decision."""
    sha1 = sha1_of(blob)
    args = _store_args(vins, request_id, blob, sha1, now_ms, batch_id, spec)

    def store() -> Awaitable[Record]:
        return fetch_one(conn, _STORE_BATCH, *args)

    what = f"{'preview' if dry_run else 'batch'} of {request_id}"
    out = await retrying_call(what, (lambda: undone(conn, store)) if dry_run else store)
    return _written(vins, request_id, sha1, batch_id, out)


def _store_args(
    vins: Sequence[str], request_id: str, blob: bytes, sha1: bytes, now_ms: int, batch_id: str | None, spec: RowSpec
) -> tuple[object, ...]:
    """`sdv_store_batch`'s arguments, in its order."""
    return (
        list(vins),
        request_id,
        blob,
        sha1,
        now_ms,
        batch_id,
        spec.expires_ms,
        spec.flags,
        spec.max_pending,
        TOUCH_EVERY_MS,
    )


def _written(
    vins: Sequence[str], request_id: str, sha1: bytes, batch_id: str | None, out: Record
) -> BatchWritten | Duplicate:
    if batch_id is not None and not out["taken"]:
        return _duplicate(batch_id, out)
    refused = tuple(out["refused"])
    gone = set(refused)
    stored = tuple(v for v in vins if v not in gone)
    superseded = frozenset(bytes(s) for s in out["superseded"])
    return BatchWritten(request_id, sha1, stored, out["replaced"], out["new_blob"], superseded, refused=refused)


_STORE_BATCH = """
SELECT * FROM sdv_store_batch($1::text[], $2::text, $3::bytea, $4::bytea, $5::int8, $6::text, $7::int8, $8::int2,
                              $9::int4, $10::int8)
"""


def _duplicate(batch_id: str, first: Record) -> Duplicate:
    sha1 = None if first["first_sha1"] is None else bytes(first["first_sha1"])
    return Duplicate(
        batch_id, first["first_request_id"], sha1, first["first_rows"], first["first_ts"], tuple(first["first_refused"])
    )


async def claim_batch_id(conn: Connection, batch_id: str, request_id: str, now_ms: int) -> Duplicate | None:
    """Take `batch_id` for this transaction, or the receipt of whoever took it first
    (`sdv_claim_batch_id`)."""
    out = await fetch_one(conn, "SELECT * FROM sdv_claim_batch_id($1, $2, $3)", batch_id, request_id, now_ms)
    return None if out["taken"] else _duplicate(batch_id, out)


async def put_blob(conn: Connection, sha1: bytes, blob: bytes, now_ms: int) -> bool:
    """Store `blob` under its sha1 unless it is there; True when written (`sdv_put_blob`: a
    present blob is touched, for GC)."""
    return bool(await conn.fetchval("SELECT sdv_put_blob($1, $2, $3, $4)", sha1, blob, now_ms, TOUCH_EVERY_MS))


async def touch_blob(conn: Connection, sha1: bytes, now_ms: int) -> bool:
    """Record that a write refers to the blob `sha1` now, for GC's grace period (`sdv_touch_blob`);
    False when the blob is gone."""
    return bool(await conn.fetchval("SELECT sdv_touch_blob($1, $2, $3)", sha1, now_ms, TOUCH_EVERY_MS))


async def refuse_aborted(conn: Connection, request_id: str) -> None:
    """In the caller's transaction: RequestAborted (through `errors.as_storage_error`) when
    `request_id` stands aborted (`sdv_refuse_aborted`)."""
    await conn.execute("SELECT sdv_refuse_aborted($1)", request_id)


async def put_rows(
    conn: Connection,
    vins: Sequence[str],
    request_id: str,
    sha1: bytes,
    size: int,
    now_ms: int,
    spec: RowSpec,
) -> RowsPut:
    """`ops.put_rows` in the caller's transaction (`sdv_put_rows`): a row per VIN; one of another
    generation ends superseded (or cancelled, when a cancel of every vehicle in progress had taken
    it); a VIN at the bound is refused."""
    out = await fetch_one(
        conn,
        "SELECT * FROM sdv_put_rows($1::text[], $2, $3, $4, $5, $6, $7::int2, $8)",
        list(vins),
        request_id,
        sha1,
        size,
        now_ms,
        spec.expires_ms,
        spec.flags,
        spec.max_pending,
    )
    superseded = frozenset(bytes(s) for s in out["superseded"])
    return RowsPut(out["replaced"], superseded, tuple(out["refused"]))


async def delete_row_if(
    conn: Connection,
    vin: str,
    request_id: str,
    sha1: bytes,
    now_ms: int = 0,
    outcome: Outcome = Outcome.DELIVERED,
    attempts: int = 0,
    response: bytes = b"",
) -> bool:
    """End the (vin, request_id) row with `outcome` only if it still holds `sha1`; else amend a
    `cancelled` outcome of that pair to this one (`ops.delete_row_if`). True when either did. One
    statement (`sdv_end_row`, sql/functions/outcomes.sql; a vehicle event's save runs the same function)."""
    args = (vin, request_id, sha1, now_ms, int(outcome), min(attempts, outcomes.MAX_ATTEMPTS), response)
    return bool(await retrying(conn, f"end of {request_id} for {vin}", lambda: conn.fetchval(_END_ROW, *args)))


_END_ROW = "SELECT sdv_end_row($1::text, $2::text, $3::bytea, $4::int8, $5::int2, $6::int4, $7::bytea)"


async def _cancel_rows(
    conn: Connection, request_id: str, vins: Sequence[str], now_ms: int, cut: int | None
) -> list[Ended]:
    """End `cancelled` the pending rows of `request_id` for `vins` (stored by `cut`, if given)."""
    if not vins:
        return []
    deleted = await conn.fetch(
        """WITH doomed AS (
               SELECT vin FROM rows WHERE request_id = $1 AND vin = ANY($2::text[]) AND ts_ms <= $3
               ORDER BY vin FOR UPDATE)
           DELETE FROM rows r USING doomed d WHERE r.request_id = $1 AND r.vin = d.vin
           RETURNING r.vin, r.sha1, r.ts_ms""",
        request_id,
        sorted(vins),
        _NO_CUT if cut is None else cut,
    )
    ended = [Ended(r["vin"], request_id, bytes(r["sha1"]), r["ts_ms"], Outcome.CANCELLED) for r in deleted]
    bumps = Bumps()
    await outcomes.end_pairs(conn, ended, now_ms, bumps)
    await bumps.write(conn, now_ms)
    return ended


async def cancel_vins(conn: Connection, request_id: str, vins: Sequence[str], now_ms: int) -> CancelChunk:
    """Cancel `request_id` for these VINs, in one transaction (`cancel.cancel_vins`)."""
    ended = await retrying(conn, f"cancel of {request_id}", lambda: _cancel_rows(conn, request_id, vins, now_ms, None))
    by_vin = {e.vin: e.sha1 for e in ended}
    done = tuple((v, by_vin[v]) for v in dict.fromkeys(vins) if v in by_vin)
    return CancelChunk(request_id, done, len(done), False)


async def start_cancel_all(
    conn: Connection, request_id: str, now_ms: int, max_rows: int, correlation_id: str | None = None
) -> CancelChunk:
    """Record a cancel of every vehicle of `request_id` and run its first chunk
    (`cancel.start_cancel_all`); a second one while the first runs moves the cut to now and starts
    the walk over, keeping the count."""
    return await retrying(
        conn,
        f"cancel of {request_id}",
        lambda: _start_cancel_all(conn, request_id, now_ms, max_rows, correlation_id, None),
    )


async def _start_cancel_all(
    conn: Connection, request_id: str, now_ms: int, max_rows: int, correlation_id: str | None, reason: str | None
) -> CancelChunk:
    # Exclusive: batches of the request in progress commit first, later ones see the cut.
    await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", LockClass.REQUEST, request_id)
    await conn.execute(
        """INSERT INTO cancels AS c (request_id, cut_ms, after_vin, done, correlation_id, reason)
           VALUES ($1, $2, '', 0, $3, $4)
           ON CONFLICT (request_id) DO UPDATE SET cut_ms = greatest(c.cut_ms, EXCLUDED.cut_ms),
               after_vin = '', correlation_id = EXCLUDED.correlation_id, reason = EXCLUDED.reason""",
        request_id,
        now_ms,
        correlation_id,
        reason,
    )
    return await _cancel_chunk(conn, request_id, now_ms, max_rows)


async def abort(conn: Connection, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> CancelChunk | None:
    """Record the abort `doc` of `request_id` under its policy in force and start its cancel of
    every vehicle (reason "aborted"), in one transaction; None when it has no policy or that
    policy was aborted already (by any instance: the conditional update lets one win). Twin:
    storage.lmdb.policies.abort. From its commit on, sdv_refuse_aborted refuses its batches."""

    async def body() -> CancelChunk | None:
        await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", LockClass.REQUEST, request_id)
        won = await conn.fetchval(
            "UPDATE policies SET aborted = $2 WHERE request_id = $1 AND aborted IS NULL RETURNING true", request_id, doc
        )
        if not won:
            return None
        return await _start_cancel_all(conn, request_id, now_ms, max_rows, None, "aborted")

    return await retrying(conn, f"abort of {request_id}", body)


async def cancel_chunk(conn: Connection, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
    """The next chunk of a cancel of every vehicle (`cancel.cancel_chunk`): up to `max_rows` of
    the request's pending VINs in VIN order past where the last chunk stopped."""
    return await retrying(conn, f"cancel of {request_id}", lambda: _cancel_chunk(conn, request_id, now_ms, max_rows))


async def _cancel_chunk(conn: Connection, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
    job = await conn.fetchrow(
        "SELECT cut_ms, after_vin, done, correlation_id, reason FROM cancels WHERE request_id = $1 FOR UPDATE",
        request_id,
    )
    if job is None:
        return CancelChunk(request_id, (), 0, False)
    walked = await conn.fetch(
        "SELECT vin FROM rows WHERE request_id = $1 AND vin > $2 ORDER BY vin LIMIT $3",
        request_id,
        job["after_vin"],
        max_rows + 1,
    )
    more = len(walked) > max_rows
    vins = [r["vin"] for r in walked[:max_rows]]
    ended = await _cancel_rows(conn, request_id, vins, now_ms, job["cut_ms"])
    total = int(job["done"]) + len(ended)
    if more:
        await conn.execute(
            "UPDATE cancels SET after_vin = $2, done = $3 WHERE request_id = $1", request_id, vins[-1], total
        )
    else:
        await conn.execute("DELETE FROM cancels WHERE request_id = $1", request_id)
    done = tuple(sorted((e.vin, e.sha1) for e in ended))
    return CancelChunk(request_id, done, total, more, job["correlation_id"], job["reason"])
