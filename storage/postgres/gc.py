"""PostgreSQL: retention and GC; one pass does what `storage.lmdb.gc.collect` does, in the same order
(rows, outcome records, generations, batch ids, aliases, blobs, parked triggers), returns the same
`GcReport`, and works in transactions of at most `limit` rows (`blob_limit` blobs).

Instances may run passes at once: every delete picks its victims `FOR UPDATE SKIP LOCKED`, so no row
is deleted twice and GC never waits for ingest (a locked row is left to the next pass). A blob goes
only if nothing created or touched it within the grace period, re-checked on the locked row
(`delete_blobs`). `dry_run` reports what the LMDB dry run reports and writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from storage.model import BLOB_CHUNK, ROW_CHUNK, GcReport
from storage.postgres import expiry, outcomes, parked
from storage.postgres.types import Connection, fetch_one

_EXPIRE_OUTCOMES = """
WITH doomed AS (
    SELECT vin, request_id, sha1 FROM outcomes WHERE ended_ms < $1
    ORDER BY ended_ms, vin, request_id, sha1 LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM outcomes o USING doomed d WHERE o.vin = d.vin AND o.request_id = d.request_id AND o.sha1 = d.sha1
"""
_EXPIRE_GENERATIONS = """
WITH doomed AS (
    SELECT request_id, sha1 FROM generations WHERE pending = 0 AND last_ms < $1
    ORDER BY request_id, sha1 LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM generations g USING doomed d WHERE g.request_id = d.request_id AND g.sha1 = d.sha1
RETURNING g.request_id, g.sha1
"""
# A generation's latency counts go with it (in the same transaction).
_EXPIRE_LATENCY = """
DELETE FROM gen_latency l USING unnest($1::text[], $2::bytea[]) AS d(request_id, sha1)
WHERE l.request_id = d.request_id AND l.sha1 = d.sha1
"""
# A request's failed answers (the answer_failed abort criterion) go with its last generation.
_EXPIRE_ANSWERS = """
DELETE FROM answer_failures a USING unnest($1::text[]) AS d(request_id)
WHERE a.request_id = d.request_id AND NOT EXISTS (SELECT 1 FROM generations g WHERE g.request_id = d.request_id)
"""
_EXPIRE_BATCH_IDS = """
WITH doomed AS (
    SELECT batch_id FROM batches WHERE ts_ms < $1 ORDER BY ts_ms, batch_id LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM batches b USING doomed d WHERE b.batch_id = d.batch_id
"""
_EXPIRE_ALIASES = """
WITH doomed AS (
    SELECT data_id FROM aliases WHERE ts_ms < $1 ORDER BY ts_ms, data_id LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM aliases a USING doomed d WHERE a.data_id = d.data_id
"""
# The mark. Rows and aliases older than $1 count as gone already (a dry run predicting the pass).
_UNREFERENCED = """
SELECT b.sha1 FROM blobs b
WHERE NOT EXISTS (SELECT 1 FROM rows r WHERE r.sha1 = b.sha1 AND r.ts_ms >= $1)
  AND NOT EXISTS (SELECT 1 FROM aliases a WHERE a.sha1 = b.sha1 AND a.ts_ms >= $1)
ORDER BY b.sha1
"""
# The sweep of marked blobs: lock those still unused since $2, re-checked on the locked version.
_DELETE_BLOBS = """
WITH doomed AS (
    SELECT sha1 FROM blobs WHERE sha1 = ANY($1::bytea[]) AND greatest(created_ms, touched_ms) < $2
    ORDER BY sha1 FOR UPDATE SKIP LOCKED),
gone AS (DELETE FROM blobs b USING doomed d WHERE b.sha1 = d.sha1 RETURNING length(b.data) AS size)
SELECT count(*) AS n, coalesce(sum(size), 0) AS freed FROM gone
"""
_RECENT_BLOBS = """
SELECT count(*) FROM blobs WHERE sha1 = ANY($1::bytea[]) AND greatest(created_ms, touched_ms) >= $2
"""
_PREDICT_BLOBS = """
SELECT count(*) FILTER (WHERE greatest(created_ms, touched_ms) < $2) AS n,
       coalesce(sum(length(data)) FILTER (WHERE greatest(created_ms, touched_ms) < $2), 0) AS freed,
       count(*) FILTER (WHERE greatest(created_ms, touched_ms) >= $2) AS kept
FROM blobs WHERE sha1 = ANY($1::bytea[])
"""


def _deleted(status: str) -> int:
    """Rows a DELETE deleted, from its command tag ("DELETE n")."""
    return int(status.rsplit(" ", 1)[1])


async def _delete_old(conn: Connection, statement: str, cutoff_ms: int, limit: int) -> int:
    """One chunk of a time-ordered delete, its own transaction; how many rows it deleted."""
    return _deleted(await conn.execute(statement, cutoff_ms, limit))


async def expire_outcomes(conn: Connection, cutoff_ms: int, limit: int) -> int:
    """Up to `limit` outcome records that ended before `cutoff_ms`, oldest first (the counts of
    their generation keep them)."""
    return await _delete_old(conn, _EXPIRE_OUTCOMES, cutoff_ms, limit)


async def expire_generations(conn: Connection, cutoff_ms: int, limit: int) -> int:
    """Up to `limit` generations with nothing pending and no change since `cutoff_ms`, with their
    latency counts, and the failed answers of the requests left without any."""
    async with conn.transaction():
        gone = await conn.fetch(_EXPIRE_GENERATIONS, cutoff_ms, limit)
        if gone:
            await conn.execute(_EXPIRE_LATENCY, [r["request_id"] for r in gone], [r["sha1"] for r in gone])
            await conn.execute(_EXPIRE_ANSWERS, sorted({r["request_id"] for r in gone}))
    return len(gone)


async def expire_batch_ids(conn: Connection, cutoff_ms: int, limit: int) -> int:
    """Up to `limit` batch ids first stored before `cutoff_ms`: a retry after that is a new batch."""
    return await _delete_old(conn, _EXPIRE_BATCH_IDS, cutoff_ms, limit)


async def expire_aliases(conn: Connection, cutoff_ms: int, limit: int) -> int:
    """Up to `limit` aliases (platform data_ids) written before `cutoff_ms`."""
    return await _delete_old(conn, _EXPIRE_ALIASES, cutoff_ms, limit)


async def drain(chunk: Callable[[int], Awaitable[int]], limit: int) -> int:
    """Run `chunk(limit)` until one comes back short; the total it deleted."""
    total = 0
    while True:
        n = await chunk(limit)
        total += n
        if n < limit:
            return total


async def unreferenced_blobs(conn: Connection, expired_before_ms: int = 0) -> list[bytes]:
    """The mark: sha1s of blobs no row and no alias refers to, in sha1 order (rows and aliases
    older than `expired_before_ms` count as gone, as in `gc.unreferenced_blobs`)."""
    return [bytes(r[0]) for r in await conn.fetch(_UNREFERENCED, expired_before_ms)]


async def delete_blobs(conn: Connection, candidates: Sequence[bytes], cutoff_ms: int) -> tuple[int, int, int]:
    """Delete candidate blobs not created or touched since `cutoff_ms` (re-checked on the locked
    row); (deleted, bytes freed, kept because recently used), as `gc.delete_blobs`.

    Safe against a batch reusing a blob after the mark: the delete locks the blob and re-evaluates
    `greatest(created_ms, touched_ms) < cutoff` on the newest committed version (PostgreSQL
    re-checks a locked row's WHERE clause), so a touch committed first keeps the blob; a touch in
    progress holds the row lock and the blob is skipped; a touch that comes after the delete finds
    the blob gone and its batch retries and writes it again (`batches.touch_blob`, `Raced`). A reuse
    within `batches.TOUCH_EVERY_MS` of the last touch does not update the row, so the grace period
    must stay well above that second (plus clock skew between instances).
    """
    async with conn.transaction():
        gone = await fetch_one(conn, _DELETE_BLOBS, list(candidates), cutoff_ms)
        kept = await conn.fetchval(_RECENT_BLOBS, list(candidates), cutoff_ms)
    return int(gone["n"]), int(gone["freed"]), int(kept)


def _chunks(items: Sequence[bytes], size: int) -> list[Sequence[bytes]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _collect_blobs(conn: Connection, report: GcReport, cutoff_ms: int, limit: int) -> None:
    for chunk in _chunks(await unreferenced_blobs(conn), limit):
        deleted, freed, kept = await delete_blobs(conn, chunk, cutoff_ms)
        report.blobs_deleted += deleted
        report.blob_bytes_freed += freed
        report.blobs_kept_recent += kept


async def _predict(conn: Connection, report: GcReport, cutoff_ms: int, blob_cutoff_ms: int) -> None:
    """The dry run: what the pass would delete, read from one snapshot."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        report.rows_expired = await conn.fetchval("SELECT count(*) FROM rows WHERE ts_ms < $1", cutoff_ms)
        report.aliases_expired = await conn.fetchval("SELECT count(*) FROM aliases WHERE ts_ms < $1", cutoff_ms)
        candidates = await unreferenced_blobs(conn, cutoff_ms)
        found = await fetch_one(conn, _PREDICT_BLOBS, candidates, blob_cutoff_ms)
    report.blobs_deleted, report.blob_bytes_freed, report.blobs_kept_recent = found["n"], found["freed"], found["kept"]


async def collect(
    conn: Connection,
    *,
    now_ms: int,
    retention_ms: int,
    grace_ms: int,
    early_ttl_ms: int,
    early_limit: int = 10_000,
    outcome_retention_ms: int | None = None,
    dry_run: bool = False,
    limit: int = ROW_CHUNK,
    blob_limit: int = BLOB_CHUNK,
) -> GcReport:
    """One full GC pass on the asyncpg connection `conn` (`storage.lmdb.gc.collect`'s arguments; `limit`
    rows and `blob_limit` blobs per transaction).

    The steps: rows stored before the retention cutoff end `expired` (`expiry.expire_rows`); outcome
    records that ended before the outcome cutoff; generations with nothing pending and no change
    since then; batch ids and aliases older than the retention cutoff; blobs no row and no alias
    refers to (the mark, one statement, so one snapshot) unless created or touched within the grace
    period; parked triggers past their TTL, one chunk of `early_limit` (`parked.expire_early`).

    SKIP LOCKED rather than an advisory-lock leader: that would need a session-level lock held on
    one pooled connection for the whole pass (minutes for the mark), lost silently with that
    connection, and SKIP LOCKED is needed anyway so that GC never queues behind ingest's row locks
    (an alias being rewritten, a generation row of a busy campaign, a blob being touched). A chunk
    may so come back short while more is due, as the expiry sweeps do. Running passes at once costs
    one mark (a scan of `rows` and `aliases`) each: stagger the passes rather than lock them."""
    started = time.monotonic()
    report = GcReport(dry_run=dry_run)
    cutoff = now_ms - retention_ms
    outcome_cutoff = now_ms - (retention_ms if outcome_retention_ms is None else outcome_retention_ms)
    if dry_run:
        await _predict(conn, report, cutoff, now_ms - grace_ms)
    else:
        # Outcomes of expired rows are stamped with the wall clock, as `gc.expire_rows` does.
        report.rows_expired = await drain(lambda n: expiry.expire_rows(conn, cutoff, n), limit)
        report.outcomes_expired = await drain(lambda n: expire_outcomes(conn, outcome_cutoff, n), limit)
        # Appended count changes first, so that a generation's last change and pending count are
        # its own when it is judged (one appended later can only lower pending: still safe).
        await drain(lambda n: outcomes.fold(conn, n), limit)
        report.generations_expired = await drain(lambda n: expire_generations(conn, outcome_cutoff, n), limit)
        report.batch_ids_expired = await drain(lambda n: expire_batch_ids(conn, cutoff, n), limit)
        report.aliases_expired = await drain(lambda n: expire_aliases(conn, cutoff, n), limit)
        # Blobs after rows and aliases: those deleted above free theirs in this same pass.
        await _collect_blobs(conn, report, now_ms - grace_ms, blob_limit)
        report.expired_early = await parked.expire_early(conn, now_ms, early_ttl_ms, early_limit)
        report.early_expired = len(report.expired_early)
    report.seconds = time.monotonic() - started
    return report
