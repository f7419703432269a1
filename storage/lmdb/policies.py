"""LMDB: campaign policies, one per request id in the `policies` table, and their aborts (`aborts`).

A policy is set or cleared in one write transaction of the group committer (durable when the
call returns); reads are short snapshots. The store keeps the policy's JSON as given and never
reads it: exhook_server/policy.py validated it before, and reads it back. An abort is recorded
with the start of its cancel in one transaction, once per policy: setting or clearing the policy
removes it (the request is open again); while it stands, a batch of the request is refused.
"""

from __future__ import annotations

import struct

import lmdb

from storage.errors import PoliciesFull, RequestAborted
from storage.lmdb import cancel, keys
from storage.lmdb.tables import Tables
from storage.model import CancelChunk, StoredPolicy

_SET_MS = struct.Struct(">Q")


def set_policy(
    txn: lmdb.Transaction, t: Tables, *, request_id: str, doc: bytes | None, now_ms: int, max_count: int
) -> bool:
    """Store `doc` as the policy of `request_id` (None: clear it); True if one was in force before.
    PoliciesFull when `max_count` policies of other requests are in force."""
    key = request_id.encode()
    had = txn.get(key, db=t.policies) is not None
    if doc is not None and not had and txn.stat(t.policies)["entries"] >= max_count:
        raise PoliciesFull(f"{max_count} campaign policies are in force (max_policies)")
    if doc is None:
        if had:
            txn.delete(key, db=t.policies)
    else:
        txn.put(key, _SET_MS.pack(now_ms) + doc, db=t.policies)
    txn.delete(key, db=t.aborts)  # a new policy (or none) re-opens an aborted request
    return had


def abort(
    txn: lmdb.Transaction, t: Tables, *, request_id: str, doc: bytes, now_ms: int, max_rows: int
) -> CancelChunk | None:
    """Record the abort `doc` of `request_id` under its policy in force and start the cancel of
    every vehicle of it (reason "aborted"), in this transaction; None, writing nothing, when it has
    no policy or was aborted under it already (by another process). Twin: postgres/batches.abort."""
    key = request_id.encode()
    if txn.get(key, db=t.policies) is None or txn.get(key, db=t.aborts) is not None:
        return None
    txn.put(key, doc, db=t.aborts)
    return cancel.start_cancel_all(txn, t, request_id, now_ms, max_rows, reason="aborted")


def amend_abort(txn: lmdb.Transaction, t: Tables, *, request_id: str, before: bytes, after: bytes) -> bool:
    """Replace the abort record `before` of `request_id` with `after`; False, writing nothing,
    when the record is not `before`. Twin: postgres/policies.amend_abort."""
    key = request_id.encode()
    if txn.get(key, db=t.aborts) != before:
        return False
    txn.put(key, after, db=t.aborts)
    return True


def refuse_aborted(txn: lmdb.Transaction, t: Tables, request_id: str) -> None:
    """RequestAborted when `request_id` stands aborted (a batch of it is refused)."""
    if txn.get(request_id.encode(), db=t.aborts) is not None:
        raise RequestAborted(f"request {request_id!r} was aborted by its campaign policy; a new policy re-opens it")


def _decode(txn: lmdb.Transaction, t: Tables, key: bytes, value: bytes | memoryview) -> StoredPolicy:
    raw = bytes(value)
    aborted = txn.get(key, db=t.aborts)
    return StoredPolicy(
        key.decode(), raw[_SET_MS.size :], _SET_MS.unpack_from(raw)[0], None if aborted is None else bytes(aborted)
    )


def policy(txn: lmdb.Transaction, t: Tables, request_id: str) -> StoredPolicy | None:
    """The policy of `request_id`, or None."""
    key = request_id.encode()
    value = txn.get(key, db=t.policies)
    return None if value is None else _decode(txn, t, key, value)


def pending_vins(txn: lmdb.Transaction, t: Tables, request_id: str, after: str, limit: int) -> list[str]:
    """Up to `limit` VINs holding a pending row of `request_id`, in VIN order past `after`
    (the `by_request` index: O(limit))."""
    head = request_id.encode() + keys.SEP
    cur = txn.cursor(t.by_request)
    found: list[str] = []
    if not cur.set_range(head + after.encode() + (b"\0" if after else b"")):
        return found
    for key in cur.iternext(keys=True, values=False):
        if not bytes(key).startswith(head) or len(found) >= limit:
            break
        found.append(bytes(key[len(head) :]).decode())
    return found


def all_policies(txn: lmdb.Transaction, t: Tables) -> list[StoredPolicy]:
    """Every policy in force, by request id."""
    return [_decode(txn, t, bytes(k), v) for k, v in txn.cursor(t.policies)]
