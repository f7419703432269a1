"""LMDB: the latency counts of generations (storage/latency.py's buckets), table `latency`.

Key: the generation's `gens` key, the stage's index in `STAGES` (1 byte), the bucket (2 bytes,
big-endian), so a request's counts are one prefix range and a generation's follow its key.
Value: the count (8 bytes). Added to in the writer's transactions; GC drops them with their
generation (`storage.lmdb.gc.expire_generations`).
"""

from __future__ import annotations

from collections.abc import Iterable

import lmdb

from storage.latency import BUCKETS, STAGES, Counts, Increment
from storage.lmdb import keys
from storage.lmdb.tables import Tables


def _key(request_id: str, sha1: bytes, stage: str, bucket: int) -> bytes:
    return keys.gen_key(request_id, sha1) + bytes((STAGES.index(stage),)) + bucket.to_bytes(2, "big")


def add(txn: lmdb.Transaction, t: Tables, increments: Iterable[Increment]) -> int:
    """Add each increment (request id, sha1, stage, bucket, count); returns how many."""
    done = 0
    for request_id, sha1, stage, bucket, n in sorted(increments):
        key = _key(request_id, sha1, stage, bucket)
        old = txn.get(key, db=t.latency)
        txn.put(key, keys.encode_u64((0 if old is None else keys.decode_u64(old)) + n), db=t.latency)
        done += 1
    return done


def of_request(txn: lmdb.Transaction, t: Tables, request_id: str) -> dict[bytes, Counts]:
    """The counts of each generation of `request_id` that has any, by sha1."""
    prefix = keys.gen_prefix(request_id)
    found: dict[bytes, Counts] = {}
    cursor = txn.cursor(t.latency)
    if not cursor.set_range(prefix):
        return found
    for key, value in cursor:
        raw = bytes(key)
        if not raw.startswith(prefix):
            break
        sha1, stage, bucket = raw[len(prefix) : len(prefix) + 20], raw[-3], int.from_bytes(raw[-2:], "big")
        found.setdefault(sha1, {}).setdefault(STAGES[stage], {})[bucket] = keys.decode_u64(value)
    return found


def forget(txn: lmdb.Transaction, t: Tables, gen_key: bytes) -> None:
    """Drop the counts of the generation whose `gens` key is `gen_key`."""
    cursor = txn.cursor(t.latency)
    if not cursor.set_range(gen_key):
        return
    for _ in range(len(STAGES) * BUCKETS):
        if not bytes(cursor.key()).startswith(gen_key) or not cursor.delete():
            break
