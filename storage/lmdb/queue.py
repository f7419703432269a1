"""A pending row and the index entries that go with it: written together, removed together.

A row (`ids`) has an entry in `expiry` (retention, by store time), in `by_request` (the
request's pending VINs, for cancel), in `deadlines` when it has an `expires_at`, counts
once in its vehicle's `backlogs`, and once published, an entry in `tries` (and in `awaited`
while its answer is awaited). Every path that ends a row (delivery, response, cancel,
expiry, retention, `gc apply`) goes through `end_row`, so no index can keep an entry for a
row that is gone, and the vehicle's count stays exact.
"""

from __future__ import annotations

import struct

import lmdb

from storage.lmdb import keys, outcomes
from storage.lmdb.outcomes import Outcome
from storage.lmdb.tables import Tables

_U32 = struct.Struct(">I")
#: A vehicle has a `backlogs` entry exactly while it has at least this many rows.
COUNTED_FROM = 32


def decode_count(raw: bytes | memoryview) -> int:
    return int(_U32.unpack(raw)[0])


def encode_count(count: int) -> bytes:
    return _U32.pack(min(count, 0xFFFFFFFF))


def count_rows(rows: lmdb.Cursor, vin_key: bytes, limit: int) -> int:
    """Rows of the vehicle in `ids`, counting at most `limit` (a short scan of its key range:
    from its first key to the first key past it, `next` and one comparison per row)."""
    prefix = vin_key + keys.SEP
    if not rows.set_range(prefix):
        return 0
    end = vin_key + b"\x01"  # the first key past the range: VINs never hold NUL
    n = 0
    while n < limit and bytes(rows.key()) < end:  # set_range put it at or past the range's start
        n += 1
        if not rows.next():
            break
    return n


def backlog(txn: lmdb.Transaction, t: Tables, vin_key: bytes) -> int:
    """Pending rows of one vehicle: its `backlogs` count, or a scan of fewer than COUNTED_FROM."""
    raw = txn.get(vin_key, db=t.backlogs)
    if raw is not None:
        return decode_count(raw)
    return count_rows(txn.cursor(t.ids), vin_key, COUNTED_FROM)


def set_backlog(txn: lmdb.Transaction, t: Tables, vin_key: bytes, count: int) -> None:
    """Record the vehicle's row count (kept only from COUNTED_FROM on)."""
    if count >= COUNTED_FROM:
        txn.put(vin_key, encode_count(count), db=t.backlogs)
    else:
        txn.delete(vin_key, db=t.backlogs)


def _row_gone(txn: lmdb.Transaction, t: Tables, vin_key: bytes) -> None:
    """One row of the vehicle ended: its count, if it has one, goes down (and away below
    COUNTED_FROM); a vehicle without one needs nothing."""
    raw = txn.get(vin_key, db=t.backlogs)
    if raw is not None:
        set_backlog(txn, t, vin_key, decode_count(raw) - 1)


def forget_tries(txn: lmdb.Transaction, t: Tables, rkey: bytes, awaits: bool, sha1: bytes = b"") -> int:
    """The row `rkey` ended or holds another payload now: its deliveries are no longer counted.
    Returns when the row holding `sha1` was first published (ms; 0: never, or not known)."""
    raw = txn.get(rkey, db=t.tries)
    first_ms = 0
    if raw is not None:
        kept_sha1, _, first_ms, _ = keys.decode_tries(raw)  # decoded before the delete frees it
        first_ms = first_ms if kept_sha1 == sha1 else 0
        txn.delete(rkey, db=t.tries)
    if awaits:
        txn.delete(rkey, db=t.awaited)
    return first_ms


def end_row(
    txn: lmdb.Transaction,
    t: Tables,
    rkey: bytes,
    value: bytes,
    outcome: Outcome,
    now_ms: int,
    attempts: int = 0,
    response: bytes = b"",
    bumps: outcomes.Bumps | None = None,
) -> None:
    """Remove the pending row `rkey` (whose current `value` the caller read and copied) with
    every index entry it has, and record how it ended (its generation's counts through `bumps`
    when given)."""
    row = keys.decode_row(rkey, value)
    txn.delete(rkey, db=t.ids)
    txn.delete(keys.expiry_key(row.ts_ms, rkey), db=t.expiry)
    if row.expires_ms:
        txn.delete(keys.deadline_key(row.expires_ms, row.vin, row.request_id), db=t.deadlines)
    txn.delete(keys.request_index_key(row.vin, row.request_id), db=t.by_request)
    sent_ms = forget_tries(txn, t, rkey, row.await_response, row.sha1)
    _row_gone(txn, t, row.vin.encode())
    outcomes.end(txn, t, rkey, row.request_id, row.sha1, outcome, now_ms, row.ts_ms, attempts, response, sent_ms, bumps)


def rebuild_indexes(txn: lmdb.Transaction, t: Tables) -> int:
    """Fill `by_request`, `backlogs` and `deadlines` from the rows (upgrading a schema-2 store,
    whose rows have none of them); one pass. Returns the rows seen."""
    counts: dict[bytes, int] = {}
    n = 0
    for key, value in txn.cursor(t.ids):
        row = keys.decode_row(key, value)
        txn.put(keys.request_index_key(row.vin, row.request_id), b"", db=t.by_request)
        if row.expires_ms:
            txn.put(keys.deadline_key(row.expires_ms, row.vin, row.request_id), b"", db=t.deadlines)
        vin_key = row.vin.encode()
        counts[vin_key] = counts.get(vin_key, 0) + 1
        n += 1
    for vin_key, count in counts.items():
        set_backlog(txn, t, vin_key, count)
    return n


def first_deadline(txn: lmdb.Transaction, t: Tables) -> int | None:
    """The soonest expires_at of any row (ms), None when no row has one: whether a sweep has work."""
    cur = txn.cursor(t.deadlines)
    return keys.decode_u64(cur.key()[:8]) if cur.first() else None


def expire_due(txn: lmdb.Transaction, t: Tables, now_ms: int, limit: int) -> list[tuple[str, str, bytes]]:
    """End `expired` up to `limit` rows whose expires_at is at or before `now_ms`, soonest first,
    walking `deadlines` only as far as the first row still valid: O(expired). Returns (VIN,
    request id, sha1) of each."""
    cur = txn.cursor(t.deadlines)
    due: list[bytes] = []
    if cur.first():
        for dkey in cur.iternext(keys=True, values=False):
            if keys.decode_u64(dkey[:8]) > now_ms or len(due) >= limit:
                break
            due.append(bytes(dkey))
    ended = []
    for dkey in due:
        expires_ms, rkey = keys.split_deadline_key(dkey)
        value = txn.get(rkey, db=t.ids)
        if value is None or keys.row_expires(value) != expires_ms:
            txn.delete(dkey, db=t.deadlines)  # left by a row ended without its entry (never expected)
            continue
        value = bytes(value)
        end_row(txn, t, rkey, value, Outcome.EXPIRED, now_ms)
        vin, request_id = keys.split_rkey(rkey)
        ended.append((vin, request_id, keys.row_sha1(value)))
    return ended
