"""Group commit: many concurrent write ops, one transaction, one fsync.

Callers submit an op (a function of a write transaction) and get a future
that completes only after the transaction holding it is committed to disk.
One thread does all writing: while one commit's fsync runs, new ops queue up
and go into the next transaction together, so fsyncs per second stay bounded
while throughput grows with concurrency.

Some writes need not be durable at once: a row delete after a vehicle's PUBACK
that a crash loses only causes one duplicate delivery, which QoS 1 allows
(architecture.md §2). Such ops are submitted `lazy`: they ride along with the
next durable group, or are committed on their own once the oldest has waited
`lazy_delay_s`. Under a steady ack stream that is one commit per delay instead
of one per few acks.
"""

from __future__ import annotations

import queue
import threading
import time
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
    lazy: bool = False


class _Replay(Exception):
    """An op raised mid-group: abort and commit the group again without it."""

    def __init__(self, index: int, error: BaseException) -> None:
        self.index = index
        self.error = error


_STOP = object()


class GroupCommitter:
    """The single writer of a Store."""

    def __init__(self, store: Store, *, max_ops: int = 1024, lazy_delay_s: float = 0.05) -> None:
        self._store = store
        self._max_ops = max_ops
        self._lazy_delay_s = lazy_delay_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: Lazy ops waiting for a group to join (writer thread only), and when they must go.
        self._lazy: list[_Item] = []
        self._lazy_due = 0.0
        self._closed = False
        #: Commits done and ops committed, for tests, benchmarks and metrics.
        self.commits = 0
        self.ops_committed = 0
        self._thread = threading.Thread(target=self._run, name="lmdb-writer", daemon=True)
        self._thread.start()

    def submit(self, op: Op[T], *, lazy: bool = False) -> Future[T]:
        """Queue `op`; its future resolves with op's result once durably committed.

        `lazy`: the op may wait up to `lazy_delay_s` for company before its commit (for writes
        whose loss in a crash is harmless); it never delays the durable ops it joins.
        """
        future: Future[T] = Future()
        if self._closed:
            future.set_exception(StorageError("the store is closed"))
            return future
        self._queue.put(_Item(op, future, lazy))
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
            try:
                if self._lazy:
                    first = self._queue.get(timeout=max(0.0, self._lazy_due - time.monotonic()))
                else:
                    first = self._queue.get()
            except queue.Empty:
                first = None  # the oldest lazy op is due: commit the lazy ops alone
            if first is _STOP:
                if self._lazy:
                    self._group(None)
                break
            if first is not None and first.lazy:
                self._park(first)
                if time.monotonic() < self._lazy_due and len(self._lazy) < self._max_ops:
                    continue
                first = None
            stopping = self._group(first)

    def _park(self, item: _Item) -> None:
        """Keep a lazy op for the next group; the first one parked sets when that must be."""
        if not self._lazy:
            self._lazy_due = time.monotonic() + self._lazy_delay_s
        self._lazy.append(item)

    def _take(self, items: list[_Item]) -> bool:
        """Move queued ops into `items` (up to max_ops) without waiting; True once _STOP is seen."""
        while len(items) < self._max_ops:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                return False
            if nxt is _STOP:
                return True
            if nxt.future.set_running_or_notify_cancel():
                items.append(nxt)
        return False

    def _group(self, first: _Item | None) -> bool:
        """Commit `first` and the parked lazy ops with every op that queues up until the
        transaction is ready; True on _STOP.

        The group is gathered inside the open transaction, not before it: beginning may wait
        for LMDB's write lock (another server process committing), and every op that arrives
        meanwhile, or while earlier ops of the group run, joins this commit instead of waiting
        for the next one. More batches per fsync, and no op waits for two commits.
        """
        parked, self._lazy = self._lazy, []
        items = [i for i in parked if i.future.set_running_or_notify_cancel()]
        if first is not None and first.future.set_running_or_notify_cancel():
            items.append(first)
        stopping = False
        if not items:  # cancelled while queued: no transaction for nothing
            stopping = self._take(items)
            if not items:
                return stopping
        results: list[Any] = []
        try:
            with self._store.write() as txn:
                done = 0
                while True:
                    for item in items[done:]:
                        results.append(item.op(txn))
                    done = len(items)
                    if stopping:
                        break
                    stopping = self._take(items)
                    if len(items) == done:
                        break
        except Exception:
            # An op raised, the map is full, or the commit failed: the transaction is aborted;
            # the careful path replays the group without the failing op, grows the map, or
            # fails every op of the group, exactly as for a group gathered up front.
            self._commit(items)
            return stopping
        self._done(items, results)
        return stopping

    def _done(self, items: list[_Item], results: list[Any]) -> None:
        self.commits += 1
        self.ops_committed += len(items)
        for item, result in zip(items, results, strict=True):
            item.future.set_result(result)

    def _commit(self, items: list[_Item]) -> None:
        live = list(items)
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
            self._done(live, results)
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
