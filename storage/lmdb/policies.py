"""LMDB: campaign policies, one per request id in the `policies` table.

A policy is set or cleared in one write transaction of the group committer (durable when the
call returns); reads are short snapshots. The store keeps the policy's JSON as given and never
reads it: exhook_server/policy.py validated it before, and reads it back.
"""

from __future__ import annotations

import struct

import lmdb

from storage.errors import PoliciesFull
from storage.lmdb import keys
from storage.lmdb.tables import Tables
from storage.model import StoredPolicy

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
    return had


def _decode(key: bytes, value: bytes | memoryview) -> StoredPolicy:
    raw = bytes(value)
    return StoredPolicy(key.decode(), raw[_SET_MS.size :], _SET_MS.unpack_from(raw)[0])


def policy(txn: lmdb.Transaction, t: Tables, request_id: str) -> StoredPolicy | None:
    """The policy of `request_id`, or None."""
    key = request_id.encode()
    value = txn.get(key, db=t.policies)
    return None if value is None else _decode(key, value)


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
    return [_decode(bytes(k), v) for k, v in txn.cursor(t.policies)]
