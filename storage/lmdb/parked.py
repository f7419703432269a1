"""LMDB: parked triggers (the plugin format's triggers stored before their data), each operation
inside a write transaction the group committer owns.

A trigger whose data is stored becomes rows at once; else it is parked in the `early` table,
bounded in triggers and in the rows they name. Its data completes the parked triggers oldest
first, in chunks of at most max_rows rows; a sweep drops those whose data never came.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lmdb
import orjson

from storage.errors import EarlyTriggersFull
from storage.lmdb import batches, keys, policies
from storage.lmdb.tables import Tables
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

_EARLY_SEQ = b"early_seq"
#: Rows named by the parked triggers, kept with them so a new trigger is checked in O(1).
_EARLY_ROWS = b"early_rows"


def store_data(
    txn: lmdb.Transaction,
    t: Tables,
    data_id: str,
    blob: bytes,
    now_ms: int,
    max_rows: int = 10_000,
    max_pending: int = 0,
) -> DataWritten:
    """Plugin-format data message: blob, alias, and the triggers waiting for it, up to `max_rows`
    rows (`more` says some still wait: the caller completes them in further chunks)."""
    sha1 = sha1_of(blob)
    new_blob = batches.put_blob(txn, t, sha1, blob, now_ms)
    txn.put(data_id.encode(), keys.alias_value(sha1, now_ms), db=t.aliases)
    done = _complete(txn, t, data_id, sha1, len(blob), now_ms, max_rows, max_pending)
    return DataWritten(data_id, sha1, new_blob, done.completed, done.more, done.expired)


def complete_early(
    txn: lmdb.Transaction, t: Tables, data_id: str, now_ms: int, max_rows: int, max_pending: int = 0
) -> EarlyCompleted:
    """One more chunk of the triggers waiting for `data_id`, whose data has arrived: oldest
    first, at most `max_rows` rows (but always at least one trigger)."""
    alias = txn.get(data_id.encode(), db=t.aliases)
    blob = None if alias is None else txn.get(keys.decode_alias(alias)[0], db=t.data)
    if alias is None or blob is None:
        return EarlyCompleted((), False)  # expired or collected meanwhile: the sweeper drops them
    sha1, _ = keys.decode_alias(alias)
    batches.touch_blob(txn, t, sha1, now_ms)
    return _complete(txn, t, data_id, sha1, len(blob) - keys.BLOB_HEAD_SIZE, now_ms, max_rows, max_pending)


def _complete(
    txn: lmdb.Transaction,
    t: Tables,
    data_id: str,
    sha1: bytes,
    size: int,
    now_ms: int,
    max_rows: int,
    max_pending: int,
) -> EarlyCompleted:
    prefix = keys.early_prefix(data_id)
    cur = txn.cursor(t.early)
    waiting: list[tuple[bytes, dict[str, Any]]] = []
    rows = 0
    more = False
    if cur.set_range(prefix):
        for key, value in cur:
            if not bytes(key).startswith(prefix):
                break
            trig = orjson.loads(value)
            if waiting and rows + len(trig["ids"]) > max_rows:
                more = True
                break
            rows += len(trig["ids"])
            waiting.append((bytes(key), trig))
    completed = []
    expired = []
    for key, trig in waiting:
        txn.delete(key, db=t.early)
        batch_id = trig.get("batch_id")
        expires_ms = int(trig.get("expires_at", 0))
        if 0 < expires_ms <= now_ms:  # its data came too late for it
            if batch_id is not None:
                batches.forget_batch(txn, t, batch_id)
            expired.append(
                EarlyExpired(
                    data_id,
                    trig["request_id"],
                    len(trig["ids"]),
                    now_ms - int(trig["ts"]),
                    batch_id,
                    trig.get("correlation_id"),
                    reason="expired",
                )
            )
            continue
        spec = RowSpec(expires_ms, int(trig.get("flags", 0)), max_pending)
        put = batches.put_rows(txn, t, trig["ids"], trig["request_id"], sha1, size, now_ms, spec)
        stored = len(trig["ids"]) - len(put.refused)
        batches.record_batch(txn, t, batch_id, trig["request_id"], sha1, stored, now_ms, put.refused)
        completed.append(
            BatchWritten(
                trig["request_id"],
                sha1,
                batches.without_refused(trig["ids"], put.refused),
                put.replaced,
                False,
                put.superseded,
                batch_id,
                trig.get("correlation_id"),
                put.refused,
            )
        )
    _count_early_rows(txn, t, -rows)
    return EarlyCompleted(tuple(completed), more, tuple(expired))


def _count_early_rows(txn: lmdb.Transaction, t: Tables, delta: int) -> int:
    """Add `delta` to the parked-row count and return it (never below 0: a store written by an
    older release starts uncounted)."""
    raw = txn.get(_EARLY_ROWS, db=t.meta)
    count = max(0, (0 if raw is None else keys.decode_u64(raw)) + delta)
    if delta:
        txn.put(_EARLY_ROWS, keys.encode_u64(count), db=t.meta)
    return count


def waiting_data_ids(txn: lmdb.Transaction, t: Tables) -> list[str]:
    """data_ids that parked triggers wait for although their data is stored: what a crash left
    between two completion chunks (keys only, one alias lookup per data_id)."""
    found: list[str] = []
    cur = txn.cursor(t.early)
    if not cur.first():
        return found
    while True:
        data_id = keys.early_data_id(bytes(cur.key()))
        if txn.get(data_id.encode(), db=t.aliases) is not None:
            found.append(data_id)
        # Jump past every trigger of this data_id.
        if not cur.set_range(keys.early_prefix(data_id) + b"\xff" * 9):
            return found


def store_trigger(
    txn: lmdb.Transaction,
    t: Tables,
    data_id: str,
    vins: Sequence[str],
    request_id: str,
    now_ms: int,
    early_max: int,
    early_max_rows: int = 1_000_000,
    batch_id: str | None = None,
    correlation_id: str | None = None,
    spec: RowSpec = PLAIN,
) -> TriggerWritten | Duplicate:
    """Plugin-format trigger: rows now if the data is known, else park it (bounded in triggers
    and in the rows they name); nothing if `batch_id` was stored (or parked) before."""
    if (dup := batches.find_duplicate(txn, t, batch_id)) is not None:
        return dup
    policies.refuse_aborted(txn, t, request_id)
    alias = txn.get(data_id.encode(), db=t.aliases)
    if alias is not None:
        sha1, _ = keys.decode_alias(alias)
        blob = txn.get(sha1, db=t.data)
        if blob is not None:
            size = len(blob) - keys.BLOB_HEAD_SIZE
            batches.touch_blob(txn, t, sha1, now_ms)
            put = batches.put_rows(txn, t, vins, request_id, sha1, size, now_ms, spec)
            batches.record_batch(txn, t, batch_id, request_id, sha1, len(vins) - len(put.refused), now_ms, put.refused)
            written = BatchWritten(
                request_id,
                sha1,
                batches.without_refused(vins, put.refused),
                put.replaced,
                False,
                put.superseded,
                refused=put.refused,
            )
            return TriggerWritten(data_id, request_id, written, False)
    if int(txn.stat(t.early)["entries"]) >= early_max:
        raise EarlyTriggersFull(f"{early_max} triggers already wait for their data")
    parked = _count_early_rows(txn, t, 0)
    if parked + len(vins) > early_max_rows:
        raise EarlyTriggersFull(f"{parked} rows already wait for their data (early_max_rows {early_max_rows})")
    _count_early_rows(txn, t, len(vins))
    raw_seq = txn.get(_EARLY_SEQ, db=t.meta)
    seq = 0 if raw_seq is None else keys.decode_u64(raw_seq) + 1
    txn.put(_EARLY_SEQ, keys.encode_u64(seq), db=t.meta)
    doc: dict[str, Any] = {"ids": list(vins), "request_id": request_id, "ts": now_ms}
    if batch_id is not None:
        doc["batch_id"] = batch_id
    if correlation_id is not None:
        doc["correlation_id"] = correlation_id
    if spec.expires_ms:
        doc["expires_at"] = spec.expires_ms
    if spec.flags:
        doc["flags"] = spec.flags
    txn.put(keys.early_key(data_id, seq), orjson.dumps(doc), db=t.early)
    batches.record_batch(txn, t, batch_id, request_id, None, 0, now_ms)
    return TriggerWritten(data_id, request_id, None, True)


def expire_early(txn: lmdb.Transaction, t: Tables, now_ms: int, ttl_ms: int, limit: int) -> list[EarlyExpired]:
    """Delete up to `limit` early triggers older than `ttl_ms`; the table is small and bounded."""
    expired: list[EarlyExpired] = []
    doomed = []
    for key, value in txn.cursor(t.early):
        trig = orjson.loads(value)
        age = now_ms - int(trig["ts"])
        if age >= ttl_ms:
            doomed.append(bytes(key))
            expired.append(
                EarlyExpired(
                    keys.early_data_id(bytes(key)),
                    trig["request_id"],
                    len(trig["ids"]),
                    age,
                    trig.get("batch_id"),
                    trig.get("correlation_id"),
                )
            )
            if len(doomed) >= limit:
                break
    for key in doomed:
        txn.delete(key, db=t.early)
    for e in expired:
        if e.batch_id is not None:  # a retry after the expiry is a new trigger, not a duplicate
            batches.forget_batch(txn, t, e.batch_id)
    _count_early_rows(txn, t, -sum(e.vins for e in expired))
    return expired
