"""Schema migrations, run by `Store` when it opens an older store read-write.

Schema 1 → 2 builds the `queue` index from `ids` in chunks of committed write transactions.
After every commit `queue` holds exactly the entries of the `ids` keys below a mark kept in
`meta`; the chunk that reaches the end of `ids` drops the mark and sets schema version 2 in the
same transaction, so a crash at any point leaves either schema 1 (run again) or a full index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb

from storage import keys

if TYPE_CHECKING:
    from storage.store import Tables

#: `ids` rows indexed per write transaction: a few MB of dirty pages, well under a second.
CHUNK_ROWS = 50_000
#: `meta` key of the first `ids` key not indexed yet, while a migration is under way.
_MARK = b"queue_migration_next"
_VERSION = b"schema_version"
#: The schema this migration produces.
TO_VERSION = 2


@dataclass(frozen=True, slots=True)
class Step:
    """What one chunk did: `done` once the store is at schema 2; `rows` (the index size)
    only from the chunk that set the version, so one process reports the migration."""

    done: bool
    rows: int | None = None


def queue_chunk(txn: lmdb.Transaction, t: Tables, *, restart: bool, chunk_rows: int = CHUNK_ROWS) -> Step:
    """Index the next `chunk_rows` rows of `ids` into `queue`, inside the caller's write txn.

    `restart` empties `queue` and starts from the first row, ignoring any mark left by an
    interrupted run: rows an old build changed since then must not keep stale entries.
    Without it the chunk goes on from the mark, so processes opening the store at the same
    time finish one migration between them.
    """
    version = txn.get(_VERSION, db=t.meta)
    if version is not None and int(bytes(version)) >= TO_VERSION:
        return Step(done=True)
    mark = None if restart else txn.get(_MARK, db=t.meta)
    if mark is None:
        txn.drop(t.queue, delete=False)
    rows = txn.cursor(t.ids)
    found = rows.set_range(bytes(mark)) if mark is not None else rows.first()
    entries: list[tuple[bytes, bytes]] = []
    next_key = None
    if found:
        for rkey, value in rows:
            if len(entries) >= chunk_rows:
                next_key = bytes(rkey)
                break
            entries.append((keys.queue_key_of(bytes(rkey), keys.row_ts(value)), b""))
    txn.cursor(t.queue).putmulti(entries)
    if next_key is not None:
        txn.put(_MARK, next_key, db=t.meta)
        return Step(done=False)
    txn.delete(_MARK, db=t.meta)
    txn.put(_VERSION, str(TO_VERSION).encode(), db=t.meta)
    return Step(done=True, rows=int(txn.stat(t.queue)["entries"]))
