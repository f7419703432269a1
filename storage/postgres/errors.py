"""PostgreSQL failures as the store's own errors, so callers handle one StorageError for both
stores (the hook answers UNAVAILABLE, background loops log and try again)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import asyncpg

from storage.errors import LockTimeout, RequestAborted, StorageError

T = TypeVar("T")

#: What a database that refuses, fails or is out of reach raises through asyncpg. An idle pool
#: connection that read its backend's FATAL message (each backend sends one when its postmaster is
#: killed) raises InternalClientError on its next use, the pool's reset on release included.
FAILURES = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError)
#: What the database answers a statement it refuses or fails (not a lost connection).
PostgresError = asyncpg.PostgresError
#: A statement that waited lock_timeout for another session's lock.
LockNotAvailable = asyncpg.exceptions.LockNotAvailableError
#: A statement that wrote nothing and may simply run again: it waited lock_timeout, or PostgreSQL
#: broke a deadlock or a serialization conflict by failing it.
RETRYABLE = (
    LockNotAvailable,
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.SerializationError,
)


#: What sdv_refuse_aborted (sql/functions/batches.sql) raises for a batch of an aborted request.
ABORTED_SQLSTATE = "SDVAB"


async def as_storage_error(work: Awaitable[T]) -> T:
    """The result of `work`; a database failure comes out as StorageError."""
    try:
        return await work
    except FAILURES as exc:
        raise_if_cancelling()
        if isinstance(exc, LockNotAvailable):
            raise LockTimeout(f"PostgreSQL: {exc}") from exc
        if getattr(exc, "sqlstate", None) == ABORTED_SQLSTATE:
            raise RequestAborted("the request was aborted by its campaign policy; a new policy re-opens it") from None
        raise StorageError(f"PostgreSQL: {type(exc).__name__}: {exc}") from exc


def raise_if_cancelling() -> None:
    """Raise CancelledError if the running task is being cancelled. asyncpg may answer the
    interruption of a query with an error of its own (the connection's release, for one): seen as
    a database failure, it would be logged and retried by a background loop that should stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
