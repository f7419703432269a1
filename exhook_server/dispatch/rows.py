"""The storage port of dispatch, backed by the LMDB store and its group committer.

Kept narrow (oldest row, conditional delete) so that another store can stand
in later without touching hooks, workers or delivery.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future

from storage import ops
from storage.keys import Row
from storage.store import Store
from storage.writer import GroupCommitter


class StoreRows:
    """RowSource over a Store: reads in the caller's thread, deletes through group commit."""

    def __init__(self, store: Store, committer: GroupCommitter) -> None:
        self._store = store
        self._committer = committer

    def oldest(self, vin: str) -> tuple[Row, bytes] | None:
        return self._store.oldest(vin)

    def ack(self, vin: str, request_id: str, sha1: bytes) -> Future[bool]:
        row = self._store.row(vin, request_id)
        if row is None or row.sha1 != sha1:
            # Nothing of ours to delete (a duplicate PUBACK, or the row was replaced since): no
            # write and no hop to the writer thread. The delete re-checks inside its transaction,
            # so this read only ever saves work, it never decides a delete.
            nothing: Future[bool] = Future()
            nothing.set_result(False)
            return nothing
        # A lost delete only means one duplicate delivery (QoS 1 allows it), but it shares the
        # ingest commit anyway, so there is no cheaper path worth a second writer.
        return self._committer.submit(
            functools.partial(ops.delete_row_if, t=self._store.tables, vin=vin, request_id=request_id, sha1=sha1)
        )
