"""Write operations (batches, rows, blobs, acks, attempts), each run inside a write transaction the
group committer owns; parked triggers' are in storage/lmdb/parked.py.

An op either writes everything it means to, or raises before its first write
(capacity checks come first). The committer aborts and replays the group
without an op that raised anyway, so a half-done op never reaches the disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import lmdb
import orjson

from storage.lmdb import cancel, keys, outcomes, policies, queue
from storage.lmdb.tables import Tables
from storage.model import PLAIN as PLAIN
from storage.model import BatchWritten as BatchWritten
from storage.model import DataWritten as DataWritten
from storage.model import Duplicate as Duplicate
from storage.model import EarlyCompleted as EarlyCompleted
from storage.model import EarlyExpired as EarlyExpired
from storage.model import Outcome
from storage.model import RowSpec as RowSpec
from storage.model import RowsPut as RowsPut
from storage.model import TriggerWritten as TriggerWritten
from storage.model import sha1_of as sha1_of

T = TypeVar("T")


def find_duplicate(txn: lmdb.Transaction, t: Tables, batch_id: str | None) -> Duplicate | None:
    if batch_id is None:
        return None
    raw = txn.get(batch_id.encode(), db=t.batches)
    if raw is None:
        return None
    doc = orjson.loads(raw)
    sha1 = bytes.fromhex(doc["sha1"]) if doc["sha1"] else None
    return Duplicate(batch_id, doc["request_id"], sha1, doc["rows"], doc["ts"], tuple(doc.get("refused", ())))


def record_batch(
    txn: lmdb.Transaction,
    t: Tables,
    batch_id: str | None,
    request_id: str,
    sha1: bytes | None,
    rows: int,
    now_ms: int,
    refused: Sequence[str] = (),
) -> None:
    """Remember what a batch_id stored (for `retention_s`, see gc), so a retry stores nothing."""
    if batch_id is None:
        return
    key = batch_id.encode()
    old = txn.get(key, db=t.batches)
    ts = now_ms if old is None else int(orjson.loads(old)["ts"])
    doc: dict[str, Any] = {"request_id": request_id, "sha1": sha1.hex() if sha1 else None, "rows": rows, "ts": ts}
    if refused:
        doc["refused"] = list(refused)
    txn.put(key, orjson.dumps(doc), db=t.batches)
    if old is None:
        txn.put(keys.timed_key(ts, key), b"", db=t.batch_expiry)


def forget_batch(txn: lmdb.Transaction, t: Tables, batch_id: str) -> None:
    key = batch_id.encode()
    raw = txn.get(key, db=t.batches)
    if raw is not None:
        ts = int(orjson.loads(raw)["ts"])
        txn.delete(key, db=t.batches)
        txn.delete(keys.timed_key(ts, key), db=t.batch_expiry)


def touch_blob(txn: lmdb.Transaction, t: Tables, sha1: bytes, now_ms: int) -> None:
    """Record that a write referenced `sha1` now: GC keeps blobs touched within its grace period,
    which closes the race of a batch reusing a blob between GC's mark and its delete."""
    txn.put(sha1, keys.encode_u64(now_ms), db=t.touched)


def put_blob(txn: lmdb.Transaction, t: Tables, sha1: bytes, blob: bytes, now_ms: int) -> bool:
    """Store `blob` under its sha1 unless it is there already; True when written."""
    touch_blob(txn, t, sha1, now_ms)
    # One B-tree descent instead of get-then-put; a present blob keeps its created-at.
    return bool(txn.put(sha1, keys.blob_value(now_ms, blob), overwrite=False, db=t.data))


def put_rows(
    txn: lmdb.Transaction,
    t: Tables,
    vins: Sequence[str],
    request_id: str,
    sha1: bytes,
    size: int,
    now_ms: int,
    spec: RowSpec = PLAIN,
) -> RowsPut:
    """One row per VIN; a row for the same (VIN, request_id) is replaced (its generation, if
    another, counts it superseded). A VIN whose backlog is full gets no new row (a replacement
    is fine: it adds nothing). Counts and indexes change in the same transaction.

    This is the ingest hot loop (one call per 200-VIN batch, inside the single
    writer): keys go in sorted through one cursor per table, so each put lands
    next to the previous one in the tree, and `replace` inserts a new row in one
    descent (a plain get would cost a second one for every row that is new).
    """
    pairs = sorted(zip(keys.row_keys(vins, request_id), vins, strict=True))
    if not pairs:
        return RowsPut(0, frozenset())
    cut = cancel.cut_for(txn, t, request_id)
    if cut is not None and cut >= now_ms:
        now_ms = cut + 1  # a cancel in progress takes the rows stored up to its cut, not these
    known = outcomes.generation_exists(txn, t, request_id, sha1)
    replaced = 0
    taken = 0
    superseded: set[bytes] = set()
    refused: list[str] = []
    stored: list[bytes] = []
    stored_vins: list[str] = []
    # Rows that did not hold this generation before; the common case is every row.
    newly: list[bytes] = []
    value = keys.row_value(now_ms, sha1, size, spec.expires_ms, spec.flags)
    rows = txn.cursor(t.ids)
    counter = txn.cursor(t.ids)
    backlogs = txn.cursor(t.backlogs)
    for rkey, vin in pairs:
        old = rows.replace(rkey, value)
        if old is None:
            vin_key = vin.encode()
            raw = backlogs.get(vin_key)
            if raw is not None:
                before = queue.decode_count(raw)
            else:  # fewer than COUNTED_FROM before this one: count them where they lie
                before = queue.count_rows(counter, vin_key, queue.COUNTED_FROM) - 1
            if spec.max_pending and before >= spec.max_pending:
                txn.delete(rkey, db=t.ids)
                refused.append(vin)
                continue
            if raw is not None or before + 1 >= queue.COUNTED_FROM:
                backlogs.put(vin_key, queue.encode_count(before + 1))
            newly.append(rkey)
        else:
            txn.delete(keys.expiry_key(keys.row_ts(old), rkey), db=t.expiry)
            if old_expires := keys.row_expires(old):
                txn.delete(keys.deadline_key(old_expires, vin, request_id), db=t.deadlines)
            replaced += 1
            old_sha1 = keys.row_sha1(old)
            if old_sha1 != sha1:
                sent_ms = queue.forget_tries(txn, t, rkey, keys.row_awaits(old), old_sha1)
                old_ts = keys.row_ts(old)
                # A cancel in progress took it already (its walk had not come this far), or the
                # new payload supersedes it.
                took = cut is not None and old_ts <= cut
                ended = Outcome.CANCELLED if took else Outcome.SUPERSEDED
                outcomes.end(txn, t, rkey, request_id, old_sha1, ended, now_ms, old_ts, sent_ms=sent_ms)
                if took:
                    taken += 1
                else:
                    superseded.add(old_sha1)
                newly.append(rkey)
        stored.append(rkey)
        stored_vins.append(vin)
    if taken:
        cancel.count_taken(txn, t, request_id, taken)
    if not stored:
        return RowsPut(replaced, frozenset(superseded), tuple(refused))
    outcomes.rows_pending(txn, t, newly, request_id, sha1, now_ms, known=known)
    expiry = txn.cursor(t.expiry)
    entries = keys.expiry_entries(now_ms, stored)
    # Rows are stamped with the wall clock, so the new expiry keys almost always sort after
    # every existing one: then LMDB appends them (fills pages instead of splitting them in two).
    # A clock step back or a same-ms batch with larger keys takes the ordinary path. (In append
    # mode LMDB skips a key not above the last one; sorted, only a repeated VIN's twin is.)
    append = not expiry.last() or bytes(expiry.key()) < entries[0][0]
    expiry.putmulti(entries, append=append)
    txn.cursor(t.by_request).putmulti(keys.request_index_entries(request_id, stored_vins))
    if spec.expires_ms:
        txn.cursor(t.deadlines).putmulti(keys.deadline_entries(spec.expires_ms, request_id, stored_vins))
    if spec.flags & keys.FLAG_HIGH_PRIORITY:  # kept queue heads may have been overtaken (Store.queue_head)
        raw = txn.get(keys.HIGH_ROWS_STORED, db=t.meta)
        txn.put(keys.HIGH_ROWS_STORED, keys.encode_u64((0 if raw is None else keys.decode_u64(raw)) + 1), db=t.meta)
    return RowsPut(replaced, frozenset(superseded), tuple(refused))


def store_batch(
    txn: lmdb.Transaction,
    t: Tables,
    vins: Sequence[str],
    request_id: str,
    blob: bytes,
    now_ms: int,
    batch_id: str | None = None,
    spec: RowSpec = PLAIN,
) -> BatchWritten | Duplicate:
    """Seed-000 batch: the blob once, then one row per VIN; nothing if `batch_id` was stored."""
    if (dup := find_duplicate(txn, t, batch_id)) is not None:
        return dup
    policies.refuse_aborted(txn, t, request_id)
    sha1 = sha1_of(blob)
    new_blob = put_blob(txn, t, sha1, blob, now_ms)
    put = put_rows(txn, t, vins, request_id, sha1, len(blob), now_ms, spec)
    stored = len(vins) - len(put.refused)
    record_batch(txn, t, batch_id, request_id, sha1, stored, now_ms, put.refused)
    stored_vins = without_refused(vins, put.refused)
    return BatchWritten(request_id, sha1, stored_vins, put.replaced, new_blob, put.superseded, refused=put.refused)


def preview_batch(txn: lmdb.Transaction, t: Tables, env: lmdb.Environment, **batch: Any) -> BatchWritten | Duplicate:
    """What `store_batch(txn, t, **batch)` would return at this point of the group, writing
    nothing (`undone`)."""
    return undone(txn, t, env, store_batch, **batch)


def undone(txn: lmdb.Transaction, t: Tables, env: lmdb.Environment, op: Callable[..., T], **kw: Any) -> T:
    """What `op(txn, t, **kw)` (a batch's or a trigger's write) would return at this point of the
    group, writing nothing: it runs in a child transaction of `txn` that is aborted (LMDB's
    nested transactions), so the decision is the op's own and the group commits only what its
    other ops wrote."""
    child = env.begin(write=True, parent=txn, buffers=True)
    try:
        return op(child, t, **kw)
    finally:
        child.abort()


def without_refused(vins: Sequence[str], refused: tuple[str, ...]) -> tuple[str, ...]:
    if not refused:
        return tuple(vins)
    gone = set(refused)
    return tuple(v for v in vins if v not in gone)


def delete_row_if(
    txn: lmdb.Transaction,
    t: Tables,
    vin: str,
    request_id: str,
    sha1: bytes,
    now_ms: int = 0,
    outcome: Outcome = Outcome.DELIVERED,
    attempts: int = 0,
    response: bytes = b"",
    *,
    bumps: outcomes.Bumps | None = None,
) -> bool:
    """End the (vin, request_id) row with `outcome`, only if it still refers to `sha1` (not
    replaced since): the row goes, its outcome is recorded and counted (through `bumps` when
    given). A pair cancelled while its delivery was in flight gets the outcome of that delivery
    instead of `cancelled`."""
    rkey = keys.row_key(vin, request_id)
    value = txn.get(rkey, db=t.ids)
    if value is None or keys.row_sha1(value) != sha1:
        return outcomes.amend_cancelled(txn, t, vin, request_id, sha1, outcome, now_ms, attempts, response, bumps)
    value = bytes(value)  # a memoryview into the page the delete frees
    queue.end_row(txn, t, rkey, value, outcome, now_ms or keys.row_ts(value), attempts, response, bumps)
    return True


#: One acked row's end for `DeleteRows`: `delete_row_if`'s arguments after `txn` and `t` (vin,
#: request id, sha1, now_ms, outcome, attempts, response).
RowEnd = tuple[str, str, bytes, int, Outcome, int, bytes]


class DeleteRows:
    """The lazy op of many acked rows' ends (`delete_row_if` each, in order): takes its ends
    (`take()`) when it first runs, and ends the same ones again if the committer replays its
    group. Whether each ended."""

    __slots__ = ("_ends", "_tables", "_take")

    def __init__(self, tables: Tables, take: Callable[[], list[RowEnd]]) -> None:
        self._tables, self._take = tables, take
        self._ends: list[RowEnd] | None = None

    def __call__(self, txn: lmdb.Transaction) -> list[bool]:
        # The ends of one window are mostly of a few generations: their counts change once each.
        bumps = outcomes.Bumps()
        ended = [delete_row_if(txn, self._tables, *end, bumps=bumps) for end in self.ends()]
        bumps.write(txn, self._tables)
        return ended

    def ends(self) -> list[RowEnd]:
        """The ends this op writes: taken now if it has not run yet."""
        if self._ends is None:
            self._ends = self._take()
        return self._ends


#: One record of `record_tries`: (ids key, sha1, attempts, when (ms), then for a PUBACK awaiting
#: its answer the session (node, clientid, host, port), else None: a publish at that time).
TryRecord = tuple[bytes, bytes, int, int, tuple[str, str, str, int] | None]


def record_tries(txn: lmdb.Transaction, t: Tables, records: Sequence[TryRecord]) -> int:
    """Keep how often and when rows were published (the first time and the last), and which
    were PUBACKed and await their answer, in record order. A record for a row gone or holding
    another payload since is passed over (an end committed first must not leave an entry
    behind). Returns the records written."""
    written = 0
    for rkey, sha1, attempts, at_ms, session in records:
        value = txn.get(rkey, db=t.ids)
        if value is None or keys.row_sha1(value) != sha1:
            continue
        if session is None:  # published (again): not PUBACKed yet
            first_ms = at_ms
            if attempts > 1 and (kept := txn.get(rkey, db=t.tries)) is not None:
                kept_sha1, _, kept_first, _ = keys.decode_tries(kept)
                if kept_sha1 == sha1 and kept_first:
                    first_ms = kept_first
            txn.put(rkey, keys.tries_value(sha1, attempts, first_ms, at_ms), db=t.tries)
            if keys.row_awaits(value):
                txn.delete(rkey, db=t.awaited)
        else:
            txn.put(rkey, keys.awaited_value(sha1, attempts, at_ms, session), db=t.awaited)
        written += 1
    return written


class RecordTries:
    """The lazy op of `record_tries`: takes its records (`take()`) when it first runs, and writes
    the same ones again if the committer replays its group."""

    __slots__ = ("_records", "_tables", "_take")

    def __init__(self, tables: Tables, take: Callable[[], list[TryRecord]]) -> None:
        self._tables, self._take = tables, take
        self._records: list[TryRecord] | None = None

    def __call__(self, txn: lmdb.Transaction) -> int:
        return record_tries(txn, self._tables, self.records())

    def records(self) -> list[TryRecord]:
        """The records this op writes: taken now if it has not run yet."""
        if self._records is None:
            self._records = self._take()
        return self._records
