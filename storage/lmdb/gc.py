"""LMDB: retention and garbage collection, in short chunks so ingest and dispatch never wait long.

What goes: rows older than the retention period (oldest first through the `expiry` index; a row
replaced since its expiry entry was read is left alone), aliases older than it, blobs that no row and
no alias refers to (one read snapshot's mark) and nothing created or touched within the grace period,
and early triggers past their own TTL. Every write that refers to a blob touches it and the delete
re-checks the touch time in its own write transaction, so a batch reusing a blob after the mark keeps
it. `plan_*` functions only read; `apply_*` functions are write ops for the group committer.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import lmdb

from storage.lmdb import keys, latency, outcomes, parked, queue
from storage.lmdb.store import Store
from storage.lmdb.store import now_ms as clock_ms
from storage.lmdb.tables import Db, Tables
from storage.model import BLOB_CHUNK as BLOB_CHUNK
from storage.model import ROW_CHUNK as ROW_CHUNK
from storage.model import ApplyReport as ApplyReport
from storage.model import GcReport as GcReport
from storage.model import Outcome

Submit = Callable[[Callable[[lmdb.Transaction], Any]], "Future[Any]"]


# -- rows ------------------------------------------------------------------------------


def expire_rows(txn: lmdb.Transaction, t: Tables, cutoff_ms: int, limit: int) -> int:
    """Delete up to `limit` rows whose expiry timestamp is before `cutoff_ms`; returns how many."""
    cur = txn.cursor(t.expiry)
    doomed: list[tuple[bytes, bytes, int]] = []
    if cur.first():
        for ekey in cur.iternext(keys=True, values=False):
            ekey = bytes(ekey)
            ts = keys.decode_u64(ekey[:8])
            if ts >= cutoff_ms or len(doomed) >= limit:
                break
            doomed.append((ekey, ekey[8:], ts))
    now = clock_ms()
    for ekey, rkey, ts in doomed:
        txn.delete(ekey, db=t.expiry)
        value = txn.get(rkey, db=t.ids)
        # A row replaced after this expiry entry was written has a newer ts and its own entry.
        if value is not None and keys.row_ts(value) == ts:
            queue.end_row(txn, t, rkey, bytes(value), Outcome.EXPIRED, now)
    return len(doomed)


def _expire_timed(txn: lmdb.Transaction, index: Db, table: Db, cutoff_ms: int, limit: int) -> int:
    """Delete up to `limit` entries of `table` whose time index entry (ts + key) is before
    `cutoff_ms`, oldest first, with their index entries."""
    cur = txn.cursor(index)
    doomed: list[bytes] = []
    if cur.first():
        for ikey in cur.iternext(keys=True, values=False):
            ikey = bytes(ikey)
            if keys.decode_u64(ikey[:8]) >= cutoff_ms or len(doomed) >= limit:
                break
            doomed.append(ikey)
    for ikey in doomed:
        txn.delete(ikey, db=index)
        txn.delete(ikey[8:], db=table)
    return len(doomed)


def expire_outcomes(txn: lmdb.Transaction, t: Tables, cutoff_ms: int, limit: int) -> int:
    """Outcome records that ended before `cutoff_ms` (their generation's counts keep them)."""
    return _expire_timed(txn, t.outcome_expiry, t.outcomes, cutoff_ms, limit)


def expire_batch_ids(txn: lmdb.Transaction, t: Tables, cutoff_ms: int, limit: int) -> int:
    """Batch ids first stored before `cutoff_ms`: a retry after that is a new batch."""
    return _expire_timed(txn, t.batch_expiry, t.batches, cutoff_ms, limit)


def expire_generations(txn: lmdb.Transaction, t: Tables, cutoff_ms: int, limit: int) -> int:
    """Counts of generations with nothing pending and no change since `cutoff_ms`, and the failed
    answers of the requests left without any."""
    doomed = []
    for key, value in txn.cursor(t.gens):
        _, last_ms, counts = keys.decode_gen(value)
        if counts[1] == 0 and last_ms < cutoff_ms:
            doomed.append(bytes(key))
            if len(doomed) >= limit:
                break
    for key in doomed:
        txn.delete(key, db=t.gens)
        latency.forget(txn, t, key)
    for request_id in {keys.split_gen_key(key)[0] for key in doomed}:
        outcomes.forget_answers(txn, t, request_id)  # once none of its generations is left
    return len(doomed)


def _drain(submit: Submit, op: Callable[..., int], **kw: Any) -> int:
    """Run a chunked delete op until a chunk comes back short; the total it deleted."""
    total = 0
    while True:
        n: int = submit(functools.partial(op, limit=ROW_CHUNK, **kw)).result()
        total += n
        if n < ROW_CHUNK:
            return total


def count_expired_rows(store: Store, cutoff_ms: int) -> int:
    with store.read() as txn:
        cur = txn.cursor(store.tables.expiry)
        n = 0
        for ekey in cur.iternext(keys=True, values=False):
            if keys.decode_u64(bytes(ekey[:8])) >= cutoff_ms:
                break
            n += 1
        return n


# -- aliases ---------------------------------------------------------------------------


def expire_aliases(txn: lmdb.Transaction, t: Tables, cutoff_ms: int, data_ids: Sequence[bytes]) -> int:
    """Delete the given aliases if they are still older than `cutoff_ms` (rechecked here)."""
    n = 0
    for data_id in data_ids:
        value = txn.get(data_id, db=t.aliases)
        if value is not None and keys.decode_alias(value)[1] < cutoff_ms:
            txn.delete(data_id, db=t.aliases)
            n += 1
    return n


def old_aliases(store: Store, cutoff_ms: int) -> list[bytes]:
    with store.read() as txn:
        return [bytes(k) for k, v in txn.cursor(store.tables.aliases) if keys.decode_alias(v)[1] < cutoff_ms]


# -- blobs -----------------------------------------------------------------------------


def unreferenced_blobs(store: Store, expired_before_ms: int = 0) -> list[bytes]:
    """The mark: sha1s of blobs no row and no alias refers to, in one read snapshot.

    Rows and aliases older than `expired_before_ms` count as gone already (for a dry run,
    which must predict what the real pass frees). Memory is O(distinct blobs), not O(rows).
    """
    t = store.tables
    with store.read() as txn:
        live = {
            row.sha1 for row in (keys.decode_row(k, v) for k, v in txn.cursor(t.ids)) if row.ts_ms >= expired_before_ms
        }
        for v in txn.cursor(t.aliases).iternext(keys=False):
            sha1, ts = keys.decode_alias(v)
            if ts >= expired_before_ms:
                live.add(sha1)
        return [bytes(k) for k in txn.cursor(t.data).iternext(values=False) if bytes(k) not in live]


def last_use_ms(txn: lmdb.Transaction, t: Tables, sha1: bytes) -> int | None:
    """When the blob was created or last referenced; None if it is gone."""
    value = txn.get(sha1, db=t.data)
    if value is None:
        return None
    touched = txn.get(sha1, db=t.touched)
    return max(keys.blob_ts(value), keys.decode_u64(touched) if touched is not None else 0)


def delete_blobs(txn: lmdb.Transaction, t: Tables, candidates: Iterable[bytes], cutoff_ms: int) -> tuple[int, int, int]:
    """Delete candidate blobs not used since `cutoff_ms` (rechecked inside this transaction).

    Returns (deleted, bytes freed, kept because recently used).
    """
    deleted = freed = kept = 0
    for sha1 in candidates:
        used = last_use_ms(txn, t, sha1)
        if used is None:
            continue
        if used >= cutoff_ms:
            kept += 1
            continue
        freed += _blob_size(txn, t, sha1)
        txn.delete(sha1, db=t.data)
        txn.delete(sha1, db=t.touched)
        deleted += 1
    return deleted, freed, kept


def _blob_size(txn: lmdb.Transaction, t: Tables, sha1: bytes) -> int:
    value = txn.get(sha1, db=t.data)
    return 0 if value is None else len(value) - keys.BLOB_HEAD_SIZE


def _chunks(items: Sequence[bytes], size: int) -> Iterable[Sequence[bytes]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def collect(
    store: Store,
    submit: Submit,
    *,
    now_ms: int,
    retention_ms: int,
    grace_ms: int,
    early_ttl_ms: int,
    early_limit: int = 10_000,
    outcome_retention_ms: int | None = None,
    dry_run: bool = False,
) -> GcReport:
    """One full GC pass. Blocking: run it in a thread. Each chunk is its own committed op."""
    started = time.monotonic()
    report = GcReport(dry_run=dry_run)
    t = store.tables
    cutoff = now_ms - retention_ms
    if dry_run:
        report.rows_expired = count_expired_rows(store, cutoff)
    else:
        while True:
            n: int = submit(functools.partial(expire_rows, t=t, cutoff_ms=cutoff, limit=ROW_CHUNK)).result()
            report.rows_expired += n
            if n < ROW_CHUNK:
                break
    if not dry_run:
        outcome_cutoff = now_ms - (retention_ms if outcome_retention_ms is None else outcome_retention_ms)
        report.outcomes_expired = _drain(submit, expire_outcomes, t=t, cutoff_ms=outcome_cutoff)
        report.generations_expired = _drain(submit, expire_generations, t=t, cutoff_ms=outcome_cutoff)
        report.batch_ids_expired = _drain(submit, expire_batch_ids, t=t, cutoff_ms=cutoff)
    aliases = old_aliases(store, cutoff)
    if dry_run:
        report.aliases_expired = len(aliases)
    else:
        for chunk in _chunks(aliases, ROW_CHUNK):
            op = functools.partial(expire_aliases, t=t, cutoff_ms=cutoff, data_ids=chunk)
            report.aliases_expired += submit(op).result()
    # Blobs last: rows and aliases deleted above free theirs in this same pass.
    candidates = unreferenced_blobs(store, cutoff if dry_run else 0)
    blob_cutoff = now_ms - grace_ms
    if dry_run:
        with store.read() as txn:
            for sha1 in candidates:
                used = last_use_ms(txn, t, sha1)
                if used is not None and used < blob_cutoff:
                    report.blobs_deleted += 1
                    report.blob_bytes_freed += _blob_size(txn, t, sha1)
                elif used is not None:
                    report.blobs_kept_recent += 1
    else:
        for chunk in _chunks(candidates, BLOB_CHUNK):
            d, f, k = submit(functools.partial(delete_blobs, t=t, candidates=chunk, cutoff_ms=blob_cutoff)).result()
            report.blobs_deleted += d
            report.blob_bytes_freed += f
            report.blobs_kept_recent += k
        report.expired_early = submit(
            functools.partial(parked.expire_early, t=t, now_ms=now_ms, ttl_ms=early_ttl_ms, limit=early_limit)
        ).result()
        report.early_expired = len(report.expired_early)
    report.seconds = time.monotonic() - started
    return report


# -- applying a plan computed elsewhere (spark/gc_job.py over an export) -----------------


def delete_planned_rows(txn: lmdb.Transaction, t: Tables, planned: Sequence[tuple[str, str, int]]) -> tuple[int, int]:
    """Delete rows that still carry the planned timestamp; a row replaced since the export stays."""
    deleted = kept = 0
    for vin, request_id, ts in planned:
        rkey = keys.row_key(vin, request_id)
        value = txn.get(rkey, db=t.ids)
        if value is None:
            continue
        if keys.row_ts(value) != ts:
            kept += 1
            continue
        queue.end_row(txn, t, rkey, bytes(value), Outcome.EXPIRED, clock_ms())
        deleted += 1
    return deleted, kept


def delete_planned_aliases(txn: lmdb.Transaction, t: Tables, planned: Sequence[tuple[str, int]]) -> int:
    """Delete aliases not rewritten since the export."""
    n = 0
    for data_id, ts in planned:
        key = data_id.encode()
        value = txn.get(key, db=t.aliases)
        if value is not None and keys.decode_alias(value)[1] == ts:
            txn.delete(key, db=t.aliases)
            n += 1
    return n
