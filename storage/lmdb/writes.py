"""`Writes` over the embedded LMDB store: each write an op of storage/lmdb/batches.py (or parked, cancel, pending)
run by the group committer, awaited from the event loop within a deadline."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from storage.latency import Increment
from storage.lmdb import batches, cancel, latency, parked, policies, queue
from storage.lmdb.batches import PLAIN, RowSpec
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.model import StoredPolicy
from storage.port import Writes, durable_within

T = TypeVar("T")


class _LoopWaker:
    """Hands the writer's finished futures to the event loop with one wake-up per burst.

    The group committer finishes a whole group at once, in its own thread.
    `asyncio.wrap_future` would wake the loop once per op (a self-pipe write,
    under the GIL the loop thread also wants); under load that cost ~0.2 ms per
    batch on the writer's critical path. Here the first op of a burst schedules
    one drain and the others just join the list it will drain.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Future[Any]]]] = {}

    def wrap(self, future: Future[T]) -> asyncio.Future[T]:
        """An asyncio future of the running loop that settles like `future`."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[T] = loop.create_future()
        future.add_done_callback(functools.partial(self._finished, loop, waiter))
        return waiter

    def _finished(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[Any], future: Future[Any]) -> None:
        with self._lock:
            done = self._done.setdefault(loop, [])
            first = not done
            done.append((waiter, future))
        if first and not loop.is_closed():  # a closed loop has nobody left to wake
            loop.call_soon_threadsafe(self._drain, loop)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            done = self._done.pop(loop, [])
        for waiter, future in done:
            _settle(waiter, future)


def _settle(waiter: asyncio.Future[Any], future: Future[Any]) -> None:
    if waiter.done():  # nobody waits any more (the caller's wait was cancelled)
        return
    if future.cancelled():
        waiter.cancel()
    elif (exc := future.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(future.result())


class LmdbWrites:
    """The LMDB store's `Writes`: ops through the group committer (one fsync for many), reads in
    the caller's thread (short read transactions)."""

    def __init__(self, store: Store, committer: GroupCommitter, timeout_s: float) -> None:
        self._store = store
        self._t = store.tables
        self._committer = committer
        self._timeout_s = timeout_s
        self._waker = _LoopWaker()

    async def _commit(self, op: Callable[..., T], rows: int = 1, solo: bool = False, **kw: Any) -> T:
        future = self._waker.wrap(self._committer.submit(functools.partial(op, t=self._t, **kw), rows=rows, solo=solo))
        return await durable_within(future, self._timeout_s)

    async def store_batch(
        self,
        vins: Sequence[str],
        request_id: str,
        blob: bytes,
        now_ms: int,
        batch_id: str | None = None,
        spec: RowSpec = PLAIN,
        *,
        dry_run: bool = False,
    ) -> batches.BatchWritten | batches.Duplicate:
        # A preview goes through the committer like the batch itself: it sees every batch
        # submitted before it, and its rows count in the group's row bound.
        op = functools.partial(batches.preview_batch, env=self._store.env) if dry_run else batches.store_batch
        return await self._commit(
            op,
            rows=len(vins),
            vins=vins,
            request_id=request_id,
            blob=blob,
            now_ms=now_ms,
            batch_id=batch_id,
            spec=spec,
        )

    async def add_latency(self, increments: Sequence[Increment]) -> None:
        # Lazy: with the next commit that happens anyway (a crash loses at most that window's).
        future = self._committer.submit(functools.partial(latency.add, t=self._t, increments=increments), lazy=True)
        await durable_within(self._waker.wrap(future), self._timeout_s)

    async def store_data(
        self, data_id: str, blob: bytes, now_ms: int, max_rows: int, max_pending: int
    ) -> batches.DataWritten:
        return await self._commit(
            parked.store_data, data_id=data_id, blob=blob, now_ms=now_ms, max_rows=max_rows, max_pending=max_pending
        )

    async def store_trigger(
        self,
        data_id: str,
        vins: Sequence[str],
        request_id: str,
        now_ms: int,
        early_max: int,
        early_max_rows: int,
        batch_id: str | None = None,
        correlation_id: str | None = None,
        spec: RowSpec = PLAIN,
        *,
        dry_run: bool = False,
    ) -> batches.TriggerWritten | batches.Duplicate:
        # A preview is the trigger's own write, undone (as a batch's: store_batch).
        op = functools.partial(batches.undone, env=self._store.env, op=parked.store_trigger) if dry_run else None
        return await self._commit(
            op or parked.store_trigger,
            rows=len(vins),
            data_id=data_id,
            vins=vins,
            request_id=request_id,
            now_ms=now_ms,
            early_max=early_max,
            early_max_rows=early_max_rows,
            batch_id=batch_id,
            correlation_id=correlation_id,
            spec=spec,
        )

    async def complete_early(
        self, data_id: str, now_ms: int, max_rows: int, max_pending: int
    ) -> batches.EarlyCompleted:
        return await self._commit(
            parked.complete_early,
            rows=max_rows,
            data_id=data_id,
            now_ms=now_ms,
            max_rows=max_rows,
            max_pending=max_pending,
        )

    async def expire_early(self, now_ms: int, ttl_ms: int, limit: int) -> list[batches.EarlyExpired]:
        return await self._commit(parked.expire_early, now_ms=now_ms, ttl_ms=ttl_ms, limit=limit)

    async def waiting_data_ids(self) -> list[str]:
        with self._store.read() as txn:
            return parked.waiting_data_ids(txn, self._t)

    async def cancel_vins(self, request_id: str, vins: Sequence[str], now_ms: int) -> cancel.CancelChunk:
        return await self._commit(cancel.cancel_vins, rows=len(vins), request_id=request_id, vins=vins, now_ms=now_ms)

    async def start_cancel_all(
        self, request_id: str, now_ms: int, max_rows: int, correlation_id: str | None = None
    ) -> cancel.CancelChunk:
        return await self._commit(
            cancel.start_cancel_all,
            rows=max_rows,
            solo=True,
            request_id=request_id,
            now_ms=now_ms,
            max_rows=max_rows,
            correlation_id=correlation_id,
        )

    async def cancel_chunk(self, request_id: str, now_ms: int, max_rows: int) -> cancel.CancelChunk:
        return await self._commit(
            cancel.cancel_chunk, rows=max_rows, solo=True, request_id=request_id, now_ms=now_ms, max_rows=max_rows
        )

    async def cancels_in_progress(self) -> list[str]:
        with self._store.read() as txn:
            return cancel.cancels_in_progress(txn, self._t)

    async def first_deadline(self) -> int | None:
        with self._store.read() as txn:
            return queue.first_deadline(txn, self._t)

    async def expire_due(self, now_ms: int, limit: int) -> list[tuple[str, str, bytes]]:
        return await self._commit(queue.expire_due, rows=limit, now_ms=now_ms, limit=limit)

    async def set_policy(self, request_id: str, doc: bytes | None, now_ms: int, max_count: int) -> bool:
        return await self._commit(
            policies.set_policy, request_id=request_id, doc=doc, now_ms=now_ms, max_count=max_count
        )

    async def policies(self) -> list[StoredPolicy]:
        with self._store.read() as txn:
            return policies.all_policies(txn, self._t)

    async def abort(self, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> cancel.CancelChunk | None:
        return await self._commit(
            policies.abort, rows=max_rows, solo=True, request_id=request_id, doc=doc, now_ms=now_ms, max_rows=max_rows
        )

    async def amend_abort(self, request_id: str, before: bytes, after: bytes) -> bool:
        return await self._commit(policies.amend_abort, request_id=request_id, before=before, after=after)

    async def pending_vins(self, request_id: str, after: str, limit: int) -> list[str]:
        with self._store.read() as txn:
            return policies.pending_vins(txn, self._t, request_id, after, limit)


if TYPE_CHECKING:  # mypy checks that LmdbWrites is a storage.port.Writes
    _is_writes: Writes = LmdbWrites(Store.__new__(Store), GroupCommitter.__new__(GroupCommitter), 0.0)
