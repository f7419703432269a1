"""LMDB: cancelling a request: its pending rows end `cancelled`, in transactions of bounded size.

A cancel naming VINs is one transaction (at most max_rows_per_commit rows). A cancel of every vehicle
records a job (`cancels`: request id → cut, resume position, count) with its first chunk; further
chunks follow behind the hook's answer, and after a crash at start-up. From the job's commit on, rows
stored up to its cut are never sent, so the cancel takes effect at once; a batch of the request stored
later is stamped past the cut and never taken by it. A delivery already in flight cannot be recalled:
its outcome is amended to what the vehicle does with it (`outcomes.amend_cancelled`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lmdb
import orjson

from storage.lmdb import keys, queue
from storage.lmdb.tables import Tables
from storage.model import CancelChunk as CancelChunk
from storage.model import Outcome


def cut_of(value: bytes | memoryview) -> int:
    """The cut of a `cancels` job: rows of its request stored at or before it are cancelled."""
    return int(orjson.loads(bytes(value))["cut"])


def cut_for(txn: lmdb.Transaction, t: Tables, request_id: str) -> int | None:
    """The cut of a cancel of every vehicle of `request_id` in progress, if any (one lookup in
    a table that is almost always empty)."""
    raw = txn.get(request_id.encode(), db=t.cancels)
    return None if raw is None else cut_of(raw)


def _cancel(txn: lmdb.Transaction, t: Tables, rkey: bytes, now_ms: int, cut: int | None = None) -> bytes | None:
    """Cancel the row `rkey` if it is pending (and stored by `cut`); its sha1, or None."""
    value = txn.get(rkey, db=t.ids)
    if value is None or (cut is not None and keys.row_ts(value) > cut):
        return None
    value = bytes(value)
    queue.end_row(txn, t, rkey, value, Outcome.CANCELLED, now_ms)
    return keys.row_sha1(value)


def cancel_vins(txn: lmdb.Transaction, t: Tables, request_id: str, vins: Sequence[str], now_ms: int) -> CancelChunk:
    """Cancel `request_id` for these VINs, in this transaction."""
    done = []
    for vin in vins:
        sha1 = _cancel(txn, t, keys.row_key(vin, request_id), now_ms)
        if sha1 is not None:
            done.append((vin, sha1))
    return CancelChunk(request_id, tuple(done), len(done), False)


def start_cancel_all(
    txn: lmdb.Transaction,
    t: Tables,
    request_id: str,
    now_ms: int,
    max_rows: int,
    correlation_id: str | None = None,
    reason: str | None = None,
) -> CancelChunk:
    """Record a cancel of every vehicle of `request_id` and run its first chunk. A second one
    while the first runs moves the cut to now and starts the walk over (keeping the count).
    `reason`: why, when not by a cancel message ("aborted"), reported with every chunk."""
    key = request_id.encode()
    raw = txn.get(key, db=t.cancels)
    job: dict[str, Any] = {"cut": now_ms, "after": "", "done": 0}
    if raw is not None:
        old = orjson.loads(bytes(raw))
        job["cut"] = max(now_ms, int(old["cut"]))
        job["done"] = int(old["done"])
    if correlation_id is not None:
        job["correlation_id"] = correlation_id
    if reason is not None:
        job["reason"] = reason
    txn.put(key, orjson.dumps(job), db=t.cancels)
    return cancel_chunk(txn, t, request_id, now_ms, max_rows)


def cancel_chunk(txn: lmdb.Transaction, t: Tables, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
    """The next chunk of a cancel of every vehicle: up to `max_rows` of the request's pending
    VINs, in VIN order from where the last chunk stopped; the job ends with the last chunk."""
    key = request_id.encode()
    raw = txn.get(key, db=t.cancels)
    if raw is None:
        return CancelChunk(request_id, (), 0, False)
    job = orjson.loads(bytes(raw))
    prefix = key + keys.SEP
    start = prefix + job["after"].encode() + keys.SEP if job["after"] else prefix
    vins: list[str] = []
    cur = txn.cursor(t.by_request)
    more = False
    if cur.set_range(start):
        for ikey in cur.iternext(keys=True, values=False):
            if bytes(ikey[: len(prefix)]) != prefix:
                break
            if len(vins) >= max_rows:
                more = True
                break
            vins.append(bytes(ikey[len(prefix) :]).decode())
    done = []
    for vin in vins:  # collected first: cancelling deletes the index entries walked
        sha1 = _cancel(txn, t, keys.row_key(vin, request_id), now_ms, int(job["cut"]))
        if sha1 is not None:
            done.append((vin, sha1))
    job["done"] = int(job["done"]) + len(done)
    if more:
        job["after"] = vins[-1]
        txn.put(key, orjson.dumps(job), db=t.cancels)
    else:
        txn.delete(key, db=t.cancels)
    return CancelChunk(request_id, tuple(done), job["done"], more, job.get("correlation_id"), job.get("reason"))


def count_taken(txn: lmdb.Transaction, t: Tables, request_id: str, rows: int) -> None:
    """Rows of a cancel in progress that a newer batch replaced before its walk reached them:
    they ended cancelled there (ops.put_rows), and count in the cancel's total."""
    key = request_id.encode()
    raw = txn.get(key, db=t.cancels)
    if raw is not None:
        job = orjson.loads(bytes(raw))
        job["done"] = int(job["done"]) + rows
        txn.put(key, orjson.dumps(job), db=t.cancels)


def cancels_in_progress(txn: lmdb.Transaction, t: Tables) -> list[str]:
    """Request ids whose cancel of every vehicle a crash cut short (resumed at start-up)."""
    return [bytes(k).decode() for k in txn.cursor(t.cancels).iternext(keys=True, values=False)]
