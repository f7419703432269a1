"""`Writes` over PostgreSQL: the functions of storage/postgres/ on a bounded asyncpg pool, each within
the same deadline LMDB's commits get (a write that outlives it may still land, as with LMDB);
database failures come out as StorageError, as LMDB's do (the hook answers UNAVAILABLE). `settle`
waits for the writes nobody waits for any more before the pool closes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar, cast

from storage.latency import Increment
from storage.model import (
    PLAIN,
    BatchWritten,
    CancelChunk,
    DataWritten,
    Duplicate,
    EarlyCompleted,
    EarlyExpired,
    RowSpec,
    StoredPolicy,
    TriggerWritten,
)
from storage.port import Writes, durable_within
from storage.postgres import batches, expiry, latency, parked, policies
from storage.postgres.errors import as_storage_error
from storage.postgres.types import Connection, Pool

T = TypeVar("T")


def _finished(running: set[asyncio.Future[object]]) -> Callable[[asyncio.Future[object]], None]:
    """Forget a finished write, and take its outcome: a caller that stopped waiting never will."""

    def done(write: asyncio.Future[object]) -> None:
        running.discard(write)
        if not write.cancelled():
            write.exception()

    return done


P = ParamSpec("P")


class PgWrites:
    """The PostgreSQL store's `Writes` (storage/port.py)."""

    def __init__(self, pool: Pool, timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        #: Writes in progress: a caller that stops waiting (its deadline, a cancelled hook call)
        #: leaves its write running (`durable_within`), so the pool must not close under it.
        self._running: set[asyncio.Future[object]] = set()

    async def _run(self, fn: Callable[Concatenate[Connection, P], Awaitable[T]], *args: P.args, **kw: P.kwargs) -> T:
        async def on_a_connection() -> T:
            async with self._pool.acquire() as conn:
                return await fn(conn, *args, **kw)

        write = asyncio.ensure_future(as_storage_error(on_a_connection()))
        held = cast("asyncio.Future[object]", write)
        self._running.add(held)
        held.add_done_callback(_finished(self._running))
        return await durable_within(write, self._timeout_s)

    async def settle(self, timeout_s: float) -> int:
        """Before the pool closes: wait at most `timeout_s` for the writes still running, then
        cancel the rest (their transactions roll back); how many were cancelled."""
        running = list(self._running)
        if not running:
            return 0
        _, left = await asyncio.wait(running, timeout=timeout_s)
        for write in left:
            write.cancel()
        if left:
            await asyncio.wait(left, timeout=timeout_s)
        return len(left)

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
    ) -> BatchWritten | Duplicate:
        return await self._run(batches.store_batch, vins, request_id, blob, now_ms, batch_id, spec, dry_run=dry_run)

    async def add_latency(self, increments: Sequence[Increment]) -> None:
        await self._run(latency.add, increments)

    async def store_data(self, data_id: str, blob: bytes, now_ms: int, max_rows: int, max_pending: int) -> DataWritten:
        return await self._run(parked.store_data, data_id, blob, now_ms, max_rows, max_pending)

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
    ) -> TriggerWritten | Duplicate:
        return await self._run(
            parked.store_trigger,
            data_id,
            vins,
            request_id,
            now_ms,
            early_max,
            early_max_rows,
            batch_id,
            correlation_id,
            spec,
            dry_run=dry_run,
        )

    async def complete_early(self, data_id: str, now_ms: int, max_rows: int, max_pending: int) -> EarlyCompleted:
        return await self._run(parked.complete_early, data_id, now_ms, max_rows, max_pending)

    async def expire_early(self, now_ms: int, ttl_ms: int, limit: int) -> list[EarlyExpired]:
        return await self._run(parked.expire_early, now_ms, ttl_ms, limit)

    async def waiting_data_ids(self) -> list[str]:
        return await self._run(parked.waiting_data_ids)

    async def cancel_vins(self, request_id: str, vins: Sequence[str], now_ms: int) -> CancelChunk:
        return await self._run(batches.cancel_vins, request_id, vins, now_ms)

    async def start_cancel_all(
        self, request_id: str, now_ms: int, max_rows: int, correlation_id: str | None = None
    ) -> CancelChunk:
        return await self._run(batches.start_cancel_all, request_id, now_ms, max_rows, correlation_id)

    async def cancel_chunk(self, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
        return await self._run(batches.cancel_chunk, request_id, now_ms, max_rows)

    async def cancels_in_progress(self) -> list[str]:
        async def read(conn: Connection) -> list[str]:
            return [r["request_id"] for r in await conn.fetch("SELECT request_id FROM cancels ORDER BY request_id")]

        return await self._run(read)

    async def first_deadline(self) -> int | None:
        return await self._run(expiry.first_deadline)

    async def expire_due(self, now_ms: int, limit: int) -> list[tuple[str, str, bytes]]:
        return await self._run(expiry.expire_due, now_ms, limit)

    async def set_policy(self, request_id: str, doc: bytes | None, now_ms: int, max_count: int) -> bool:
        return await self._run(policies.set_policy, request_id, doc, now_ms, max_count)

    async def policies(self) -> list[StoredPolicy]:
        return await self._run(policies.all_policies)

    async def abort(self, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> CancelChunk | None:
        return await self._run(batches.abort, request_id, doc, now_ms, max_rows)

    async def amend_abort(self, request_id: str, before: bytes, after: bytes) -> bool:
        return await self._run(policies.amend_abort, request_id, before, after)

    async def pending_vins(self, request_id: str, after: str, limit: int) -> list[str]:
        return await self._run(policies.pending_vins, request_id, after, limit)


if TYPE_CHECKING:  # mypy checks that PgWrites is a storage.port.Writes

    def _is_writes(pool: Pool) -> Writes:
        return PgWrites(pool, 0.0)
