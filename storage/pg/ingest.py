"""Write operations of the PostgreSQL store, one transaction each, with the LMDB ops' results.

Each function takes an asyncpg connection, runs one transaction and returns what its twin in
`storage.ops` / `storage.cancel` returns for the same store contents. Rows are written with one
`INSERT ... SELECT FROM unnest(...) ON CONFLICT DO UPDATE` per batch; every multi-row statement
goes in VIN order (one lock order, so concurrent transactions never deadlock on rows); outcome
records and generation counts change in the same transaction as the rows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from storage.cancel import CancelChunk
from storage.errors import StorageError
from storage.ops import PLAIN, BatchWritten, Duplicate, RowSpec, RowsPut, sha1_of
from storage.outcomes import Outcome
from storage.pg import counts
from storage.pg.counts import Bumps, Ended

T = TypeVar("T")

#: A blob's touched_ms is rewritten at most this often: every batch of a campaign names the same
#: blob, and an update would hold its row lock to each commit, one batch after another. GC's
#: grace period (minutes) dwarfs it.
TOUCH_EVERY_MS = 1_000
#: Advisory lock class of a request id (with hashtext(request_id)): batches hold it shared, the
#: start of a cancel of every vehicle exclusive, so a batch commits wholly before or after a cut.
REQUEST_LOCK = 0x5344
#: Times a batch is retried when a concurrent one created a row between our read and our upsert.
RACE_RETRIES = 5
#: The cut of a cancel that names its VINs: every row (the largest bigint).
_NO_CUT = 2**63 - 1

_OLD_ROWS = """
SELECT vin, sha1, ts_ms FROM rows WHERE request_id = $1 AND vin = ANY($2::text[]) ORDER BY vin FOR UPDATE
"""
# Rows of each VIN, counted up to $2 (the bound) through the vehicle's queue index: a VIN with a
# huge backlog costs no more than one at the bound.
_BACKLOGS = """
SELECT v, (SELECT count(*) FROM (SELECT 1 FROM rows r WHERE r.vin = v LIMIT $2) s)
FROM unnest($1::text[]) AS v
"""
_UPSERT = """
INSERT INTO rows (vin, request_id, ts_ms, sha1, size, expires_ms, flags)
SELECT v, $2::text, $3::int8, $4::bytea, $5::int4, $6::int8, $7::int2 FROM unnest($1::text[]) AS v
ON CONFLICT (vin, request_id) DO UPDATE SET ts_ms = EXCLUDED.ts_ms, sha1 = EXCLUDED.sha1, size = EXCLUDED.size,
    expires_ms = EXCLUDED.expires_ms, flags = EXCLUDED.flags
RETURNING vin, xmax = 0 AS inserted
"""


class Raced(Exception):
    """A concurrent transaction created a row this one had read as absent: retry from the start."""


async def retrying(conn: Any, what: str, body: Callable[[], Awaitable[T]]) -> T:
    """Run `body` in a transaction of `conn`, again from the start (at most RACE_RETRIES times)
    when it raises `Raced`, or when PostgreSQL aborted it to break a deadlock or a serialization
    conflict (its documented remedy: run the transaction again; nothing of it was committed)."""
    for _ in range(RACE_RETRIES):
        try:
            async with conn.transaction():
                return await body()
        except (Raced, asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError):
            continue
    raise StorageError(f"{what} kept racing concurrent writes ({RACE_RETRIES} tries)")


async def store_batch(
    conn: Any,
    vins: Sequence[str],
    request_id: str,
    blob: bytes,
    now_ms: int,
    batch_id: str | None = None,
    spec: RowSpec = PLAIN,
) -> BatchWritten | Duplicate:
    """The blob once, then one row per VIN; nothing if `batch_id` was stored (`ops.store_batch`).
    `vins` are distinct (the hook layer folds duplicates)."""
    return await retrying(
        conn, f"batch of {request_id}", lambda: _store_batch(conn, vins, request_id, blob, now_ms, batch_id, spec)
    )


async def _store_batch(
    conn: Any,
    vins: Sequence[str],
    request_id: str,
    blob: bytes,
    now_ms: int,
    batch_id: str | None,
    spec: RowSpec,
) -> BatchWritten | Duplicate:
    if batch_id is not None and (dup := await claim_batch_id(conn, batch_id, request_id, now_ms)) is not None:
        return dup
    sha1 = sha1_of(blob)
    new_blob = await put_blob(conn, sha1, blob, now_ms)
    put = await put_rows(conn, vins, request_id, sha1, len(blob), now_ms, spec)
    if batch_id is not None:
        await conn.execute(
            "UPDATE batches SET sha1 = $2, rows = $3, refused = $4::text[] WHERE batch_id = $1",
            batch_id,
            sha1,
            len(vins) - len(put.refused),
            list(put.refused),
        )
    gone = set(put.refused)
    stored = tuple(v for v in vins if v not in gone)
    return BatchWritten(request_id, sha1, stored, put.replaced, new_blob, put.superseded, refused=put.refused)


async def claim_batch_id(conn: Any, batch_id: str, request_id: str, now_ms: int) -> Duplicate | None:
    """Take `batch_id` for this transaction, or the receipt of whoever took it first. The insert
    comes first: a concurrent retry of the same batch waits on it, then finds it a duplicate."""
    taken = await conn.fetchval(
        "INSERT INTO batches (batch_id, request_id, sha1, rows, ts_ms) VALUES ($1, $2, NULL, 0, $3)"
        " ON CONFLICT (batch_id) DO NOTHING RETURNING true",
        batch_id,
        request_id,
        now_ms,
    )
    if taken:
        return None
    first = await conn.fetchrow(
        "SELECT request_id, sha1, rows, ts_ms, refused FROM batches WHERE batch_id = $1", batch_id
    )
    if first is None:  # gone between the two statements (GC): the next try stores the batch
        raise Raced
    sha1 = None if first["sha1"] is None else bytes(first["sha1"])
    return Duplicate(batch_id, first["request_id"], sha1, first["rows"], first["ts_ms"], tuple(first["refused"]))


async def put_blob(conn: Any, sha1: bytes, blob: bytes, now_ms: int) -> bool:
    """Store `blob` under its sha1 unless it is there; True when written. A present blob is
    touched (for GC) without taking its row lock unless its touch is older than TOUCH_EVERY_MS."""
    if await conn.fetchval(
        "INSERT INTO blobs (sha1, data, created_ms, touched_ms) VALUES ($1, $2, $3, $3)"
        " ON CONFLICT (sha1) DO NOTHING RETURNING true",
        sha1,
        blob,
        now_ms,
    ):
        return True
    if not await touch_blob(conn, sha1, now_ms):
        raise Raced  # collected between the two statements: the next try writes it again
    return False


async def touch_blob(conn: Any, sha1: bytes, now_ms: int) -> bool:
    """Record that a write refers to the blob `sha1` now (for GC's grace period), taking its row
    lock only when its touch is older than TOUCH_EVERY_MS; False when the blob is gone."""
    touched = await conn.fetchval("SELECT touched_ms FROM blobs WHERE sha1 = $1", sha1)
    if touched is None:
        return False
    if touched < now_ms - TOUCH_EVERY_MS:
        status = await conn.execute("UPDATE blobs SET touched_ms = $2 WHERE sha1 = $1", sha1, now_ms)
        return bool(status != "UPDATE 0")
    return True


async def put_rows(
    conn: Any,
    vins: Sequence[str],
    request_id: str,
    sha1: bytes,
    size: int,
    now_ms: int,
    spec: RowSpec,
) -> RowsPut:
    """`ops.put_rows`: a row per VIN; one of another generation ends superseded (or cancelled,
    when a cancel of every vehicle in progress had taken it); a VIN at the bound is refused."""
    ordered = sorted(vins)
    if not ordered:
        return RowsPut(0, frozenset())
    # Shared: batches of one request never wait for each other, only for the start of a cancel.
    await conn.execute("SELECT pg_advisory_xact_lock_shared($1, hashtext($2))", REQUEST_LOCK, request_id)
    # FOR UPDATE: a row this batch replaces may end cancelled, counted in the job (`done`), and
    # the job's row is locked before any row, in the order a cancel chunk locks them.
    cut = await conn.fetchval("SELECT cut_ms FROM cancels WHERE request_id = $1 FOR UPDATE", request_id)
    if cut is not None and cut >= now_ms:
        now_ms = cut + 1  # a cancel in progress takes the rows stored up to its cut, not these
    known = bool(
        await conn.fetchval("SELECT true FROM generations WHERE request_id = $1 AND sha1 = $2", request_id, sha1)
    )
    old = {r["vin"]: r for r in await conn.fetch(_OLD_ROWS, request_id, ordered)}
    refused: list[str] = []
    if spec.max_pending:
        fresh = [v for v in ordered if v not in old]
        full = {v for v, n in await conn.fetch(_BACKLOGS, fresh, spec.max_pending) if n >= spec.max_pending}
        refused = [v for v in fresh if v in full]
    gone = set(refused)
    stored = [v for v in ordered if v not in gone]
    if not stored:
        return RowsPut(0, frozenset(), tuple(refused))
    replaced = 0
    taken = 0
    superseded: set[bytes] = set()
    ended: list[Ended] = []
    newly: list[str] = []
    for vin in stored:
        row = old.get(vin)
        if row is None:
            newly.append(vin)
            continue
        replaced += 1
        old_sha1 = bytes(row["sha1"])
        if old_sha1 == sha1:
            continue
        if cut is not None and row["ts_ms"] <= cut:
            ended.append(Ended(vin, request_id, old_sha1, row["ts_ms"], Outcome.CANCELLED))
            taken += 1
        else:
            ended.append(Ended(vin, request_id, old_sha1, row["ts_ms"], Outcome.SUPERSEDED))
            superseded.add(old_sha1)
        newly.append(vin)
    written = await conn.fetch(_UPSERT, stored, request_id, now_ms, sha1, size, spec.expires_ms, spec.flags)
    if any(r["inserted"] == (r["vin"] in old) for r in written):
        raise Raced  # a row appeared after our read (or one we locked was not found): not our view
    bumps = Bumps()
    await counts.end_pairs(conn, ended, now_ms, bumps)
    if taken:
        await conn.execute("UPDATE cancels SET done = done + $2 WHERE request_id = $1", request_id, taken)
    await counts.rows_pending(conn, newly, request_id, sha1, bumps, known=known)
    await bumps.write(conn, now_ms)
    return RowsPut(replaced, frozenset(superseded), tuple(refused))


async def delete_row_if(
    conn: Any,
    vin: str,
    request_id: str,
    sha1: bytes,
    now_ms: int = 0,
    outcome: Outcome = Outcome.DELIVERED,
    attempts: int = 0,
    response: bytes = b"",
) -> bool:
    """End the (vin, request_id) row with `outcome` only if it still holds `sha1`; else amend a
    `cancelled` outcome of that pair to this one (`ops.delete_row_if`). True when either did."""
    return await retrying(
        conn,
        f"end of {request_id} for {vin}",
        lambda: end_row_in(conn, vin, request_id, sha1, now_ms, outcome, attempts, response),
    )


async def end_row_in(
    conn: Any,
    vin: str,
    request_id: str,
    sha1: bytes,
    now_ms: int = 0,
    outcome: Outcome = Outcome.DELIVERED,
    attempts: int = 0,
    response: bytes = b"",
) -> bool:
    """`delete_row_if` inside the caller's transaction (a vehicle event of dispatch): no savepoint,
    no retry. It locks the row, then appends to gen_deltas, which nothing else locks, so it
    cannot be part of a deadlock."""
    bumps = Bumps()
    stored_ms = await conn.fetchval(
        "DELETE FROM rows WHERE vin = $1 AND request_id = $2 AND sha1 = $3 RETURNING ts_ms", vin, request_id, sha1
    )
    when = now_ms
    if stored_ms is None:
        done = await counts.amend_cancelled(conn, vin, request_id, sha1, outcome, now_ms, bumps, attempts, response)
    else:
        when = now_ms or stored_ms
        ended = Ended(vin, request_id, sha1, stored_ms, outcome, attempts, response)
        await counts.end_pairs(conn, [ended], when, bumps)
        done = True
    # Appended, not applied: the acks of one campaign must not queue on its generation row.
    await bumps.append(conn, when)
    return done


async def _cancel_rows(conn: Any, request_id: str, vins: Sequence[str], now_ms: int, cut: int | None) -> list[Ended]:
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
    await counts.end_pairs(conn, ended, now_ms, bumps)
    await bumps.write(conn, now_ms)
    return ended


async def cancel_vins(conn: Any, request_id: str, vins: Sequence[str], now_ms: int) -> CancelChunk:
    """Cancel `request_id` for these VINs, in one transaction (`cancel.cancel_vins`)."""
    ended = await retrying(conn, f"cancel of {request_id}", lambda: _cancel_rows(conn, request_id, vins, now_ms, None))
    by_vin = {e.vin: e.sha1 for e in ended}
    done = tuple((v, by_vin[v]) for v in dict.fromkeys(vins) if v in by_vin)
    return CancelChunk(request_id, done, len(done), False)


async def start_cancel_all(
    conn: Any, request_id: str, now_ms: int, max_rows: int, correlation_id: str | None = None
) -> CancelChunk:
    """Record a cancel of every vehicle of `request_id` and run its first chunk
    (`cancel.start_cancel_all`); a second one while the first runs moves the cut to now and starts
    the walk over, keeping the count."""

    async def body() -> CancelChunk:
        # Exclusive: batches of the request in progress commit first, later ones see the cut.
        await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", REQUEST_LOCK, request_id)
        await conn.execute(
            """INSERT INTO cancels AS c (request_id, cut_ms, after_vin, done, correlation_id)
               VALUES ($1, $2, '', 0, $3)
               ON CONFLICT (request_id) DO UPDATE SET cut_ms = greatest(c.cut_ms, EXCLUDED.cut_ms),
                   after_vin = '', correlation_id = EXCLUDED.correlation_id""",
            request_id,
            now_ms,
            correlation_id,
        )
        return await _cancel_chunk(conn, request_id, now_ms, max_rows)

    return await retrying(conn, f"cancel of {request_id}", body)


async def cancel_chunk(conn: Any, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
    """The next chunk of a cancel of every vehicle (`cancel.cancel_chunk`): up to `max_rows` of
    the request's pending VINs in VIN order past where the last chunk stopped."""
    return await retrying(conn, f"cancel of {request_id}", lambda: _cancel_chunk(conn, request_id, now_ms, max_rows))


async def _cancel_chunk(conn: Any, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
    job = await conn.fetchrow(
        "SELECT cut_ms, after_vin, done, correlation_id FROM cancels WHERE request_id = $1 FOR UPDATE", request_id
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
    return CancelChunk(request_id, done, total, more, job["correlation_id"])
