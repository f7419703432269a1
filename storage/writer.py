"""Group commit: many concurrent write ops, one transaction, one fsync.

Callers submit an op (a function of a write transaction) and get a future
that completes only after the transaction holding it is committed to disk.
One thread does all writing: while one commit's fsync runs, new ops queue up
and go into the next transaction together, so fsyncs per second stay bounded
while throughput grows with concurrency.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import lmdb
import structlog

from storage.errors import StorageError, StorageFull
from storage.store import Store

T = TypeVar("T")
Op = Callable[[lmdb.Transaction], T]

log = structlog.get_logger("sdv_fanout.storage")


@dataclass(slots=True)
class _Item:
    op: Op[Any]
    future: Future[Any]


class _Replay(Exception):
    """An op raised mid-group: abort and commit the group again without it."""

    def __init__(self, index: int, error: BaseException) -> None:
        self.index = index
        self.error = error


_STOP = object()


class GroupCommitter:
    """The single writer of a Store."""

    def __init__(self, store: Store, *, max_ops: int = 1024) -> None:
        self._store = store
        self._max_ops = max_ops
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        #: Commits done and ops committed, for tests, benchmarks and metrics.
        self.commits = 0
        self.ops_committed = 0
        self._thread = threading.Thread(target=self._run, name="lmdb-writer", daemon=True)
        self._thread.start()

    def submit(self, op: Op[T]) -> Future[T]:
        """Queue `op`; its future resolves with op's result once durably committed."""
        future: Future[T] = Future()
        if self._closed:
            future.set_exception(StorageError("the store is closed"))
            return future
        self._queue.put(_Item(op, future))
        return future

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, then stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    # -- writer thread ---------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            items: list[_Item] = []
            first = self._queue.get()
            if first is _STOP:
                break
            items.append(first)
            while len(items) < self._max_ops:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stopping = True
                    break
                items.append(nxt)
            self._commit(items)

    def _commit(self, items: list[_Item]) -> None:
        live = [i for i in items if i.future.set_running_or_notify_cancel()]
        while live:
            try:
                results = self._attempt(live)
            except _Replay as replay:
                bad = live.pop(replay.index)
                if not isinstance(replay.error, StorageError):  # expected ones are logged above us
                    log.error("write_op_failed", error=repr(replay.error))
                bad.future.set_exception(replay.error)
                continue
            except lmdb.MapFullError:
                if self._store.grow():
                    log.info("lmdb_map_grown", map_size_bytes=self._store.map_size())
                    continue
                err = StorageFull(f"LMDB map is at map_max_bytes ({self._store.map_max_bytes})")
                log.error("lmdb_map_full", map_size_bytes=self._store.map_size())
                for item in live:
                    item.future.set_exception(err)
                return
            except lmdb.Error as exc:
                log.error("lmdb_commit_failed", error=repr(exc))
                for item in live:
                    item.future.set_exception(StorageError(f"commit failed: {exc}"))
                return
            self.commits += 1
            self.ops_committed += len(live)
            for item, result in zip(live, results, strict=True):
                item.future.set_result(result)
            return

    def _attempt(self, items: list[_Item]) -> list[Any]:
        results = []
        with self._store.write() as txn:
            for index, item in enumerate(items):
                try:
                    results.append(item.op(txn))
                except lmdb.MapFullError:
                    raise
                except Exception as exc:
                    raise _Replay(index, exc) from exc
        return results
