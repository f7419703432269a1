"""LMDB: group commit: many concurrent write ops, one transaction, one fsync.

A submitted op (a function of a write transaction) gets a future that completes only once its
transaction is on disk. One thread writes: ops queued during an fsync go into the next transaction
together, so fsyncs per second stay bounded as concurrency grows. `solo` ops (a cancel's chunks)
never join a group others started. `lazy` ops (a row delete after a PUBACK: losing it in a crash
only causes one duplicate delivery, which QoS 1 allows) ride with the next durable group, or commit
alone once the oldest has waited `lazy_delay_s`.
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
from storage.lmdb.store import Store

T = TypeVar("T")
Op = Callable[[lmdb.Transaction], T]

log = structlog.get_logger("sdv_fanout.storage")


@dataclass(slots=True)
class _Item:
    op: Op[Any]
    future: Future[Any]
    #: Rows the op writes or deletes, about: a group stops gathering at max_rows.
    rows: int = 1
    #: Housekeeping: only ever the first op of a group (ops queued behind it may join it).
    solo: bool = False


class _Replay(Exception):
    """An op raised mid-group: abort and commit the group again without it."""

    def __init__(self, index: int, error: BaseException) -> None:
        self.index = index
        self.error = error


_STOP = object()
#: Queued when the first lazy op arrives: starts the writer's clock for the lazy ops.
_LAZY = object()


class GroupCommitter:
    """The single writer of a Store."""

    def __init__(
        self, store: Store, *, max_ops: int = 1024, max_rows: int = 10_000, lazy_delay_s: float = 0.05
    ) -> None:
        self._store = store
        self._max_ops = max_ops
        #: A group stops taking ops once they write this many rows: a transaction's time, and so
        #: the wait of the batch queued behind it, stays bounded whatever the batches' sizes.
        self._max_rows = max_rows
        self._group_rows = 0  # rows of the group being gathered (writer thread only)
        #: A solo op met while gathering another group: the first op of the next (writer thread only).
        self._carry: _Item | None = None
        self._lazy_delay_s = lazy_delay_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: Lazy ops waiting for a group to join. They are not queued one by one: waking the writer
        #: thread for each would cost a GIL hand-over and two context switches per op.
        self._lazy: list[_Item] = []
        self._lazy_lock = threading.Lock()
        #: When the oldest lazy op must be committed (writer thread only); None: none is waiting.
        self._lazy_due: float | None = None
        self._closed = False
        #: Commits done and ops committed, for tests, benchmarks and metrics.
        self.commits = 0
        self.ops_committed = 0
        self._thread = threading.Thread(target=self._run, name="lmdb-writer", daemon=True)
        self._thread.start()

    def submit(self, op: Op[T], *, lazy: bool = False, rows: int = 1, solo: bool = False) -> Future[T]:
        """Queue `op`; its future resolves with op's result once durably committed.

        `lazy`: the op may wait up to `lazy_delay_s` for company before its commit (for writes
        whose loss in a crash is harmless); it never delays the durable ops it joins.
        `rows`: about how many rows the op writes, for the group's row bound.
        `solo`: housekeeping; it never joins a group other ops started (see the module's doc).
        """
        future: Future[T] = Future()
        if self._closed:
            future.set_exception(StorageError("the store is closed"))
            return future
        if not lazy:
            self._queue.put(_Item(op, future, rows, solo))
            return future
        with self._lazy_lock:
            self._lazy.append(_Item(op, future))
            first = len(self._lazy) == 1
        if first:
            self._queue.put(_LAZY)
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
            if self._carry is not None:
                carried, self._carry = self._carry, None
                stopping = self._group(carried)
                continue
            due = self._lazy_due
            try:
                first = self._queue.get() if due is None else self._queue.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                first = None  # the oldest lazy op is due: commit the lazy ops alone
            if first is _STOP:
                self._group(None)  # with the lazy ops still waiting, if any
                break
            if first is _LAZY:
                if self._lazy_due is None:
                    self._lazy_due = time.monotonic() + self._lazy_delay_s
                if time.monotonic() < self._lazy_due:
                    continue
                first = None
            stopping = self._group(first)

    def _take_lazy(self, items: list[_Item]) -> None:
        """Move the waiting lazy ops into `items`."""
        with self._lazy_lock:
            lazy, self._lazy = self._lazy, []
        taken = [i for i in lazy if i.future.set_running_or_notify_cancel()]
        items.extend(taken)
        self._group_rows += len(taken)

    def _take(self, items: list[_Item]) -> bool:
        """Move queued ops into `items` (up to max_ops, or until they write max_rows rows)
        without waiting; True once _STOP is seen."""
        while len(items) < self._max_ops and self._group_rows < self._max_rows and self._carry is None:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                return False
            if nxt is _STOP:
                return True
            if nxt is _LAZY:
                continue  # its ops are taken with the group's last _take_lazy
            if nxt.solo and items:
                self._carry = nxt  # the next group's first op
                return False
            if nxt.future.set_running_or_notify_cancel():
                items.append(nxt)
                self._group_rows += nxt.rows
        return False

    def _group(self, first: _Item | None) -> bool:
        """Commit `first` and the parked lazy ops with every op that queues up until the
        transaction is ready; True on _STOP.

        The group is gathered inside the open transaction, not before it: beginning may wait
        for LMDB's write lock (another server process committing), and every op that arrives
        meanwhile, or while earlier ops of the group run, joins this commit instead of waiting
        for the next one. More batches per fsync, and no op waits for two commits.
        """
        self._lazy_due = None
        items: list[_Item] = []
        self._group_rows = 0
        self._take_lazy(items)
        if first is not None and first.future.set_running_or_notify_cancel():
            items.append(first)
            self._group_rows += first.rows
        stopping = False
        if not items:  # cancelled while queued, or lazy ops taken already: no empty transaction
            stopping = self._take(items)
            self._take_lazy(items)
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
                    # After _take: a lazy op whose _LAZY token _take consumed is in the list.
                    self._take_lazy(items)
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
