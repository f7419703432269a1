"""The writes the server asks of a store: one interface, whichever engine is behind it.

Ingest, cancel and the expiry sweep (exhook_server/ingest.py) go through `Writes` only, so the
embedded LMDB store (`storage/lmdb_writes.py`) and the shared PostgreSQL store (issue 14,
`storage/pg/`) are interchangeable behind it. Every method returns once its change is durable
(or raises StorageError, CommitTimeout included, having stored nothing or possibly landing
later); results are the dataclasses of storage/ops.py and storage/cancel.py, so a caller never
knows which engine answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol, TypeVar

from storage.cancel import CancelChunk
from storage.errors import CommitTimeout
from storage.ops import (
    PLAIN,
    BatchWritten,
    DataWritten,
    Duplicate,
    EarlyCompleted,
    EarlyExpired,
    RowSpec,
    TriggerWritten,
)

T = TypeVar("T")


async def durable_within(write: asyncio.Future[T], timeout_s: float) -> T:
    """The result of a write in progress, waited for at most `timeout_s`; CommitTimeout then.
    The wait is shielded: a timeout ends our wait, not the write, which may still land (the
    platform's retry with its batch_id tells)."""
    try:
        return await asyncio.wait_for(asyncio.shield(write), timeout_s)
    except TimeoutError:
        raise CommitTimeout(f"commit took longer than {timeout_s} s") from None


class Writes(Protocol):
    """Durable writes of ingest, cancel and expiry, and the few reads their housekeeping needs."""

    async def store_batch(
        self,
        vins: Sequence[str],
        request_id: str,
        blob: bytes,
        now_ms: int,
        batch_id: str | None = None,
        spec: RowSpec = PLAIN,
    ) -> BatchWritten | Duplicate:
        """A seed-format batch: the blob once, a row per VIN (see ops.store_batch)."""
        ...

    async def store_data(self, data_id: str, blob: bytes, now_ms: int, max_rows: int, max_pending: int) -> DataWritten:
        """A plugin-format data message, completing up to `max_rows` rows of parked triggers."""
        ...

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
    ) -> TriggerWritten | Duplicate:
        """A plugin-format trigger: rows now, or parked until its data (EarlyTriggersFull)."""
        ...

    async def complete_early(self, data_id: str, now_ms: int, max_rows: int, max_pending: int) -> EarlyCompleted:
        """The next chunk of triggers waiting for `data_id`, whose data has arrived."""
        ...

    async def expire_early(self, now_ms: int, ttl_ms: int, limit: int) -> list[EarlyExpired]:
        """Drop parked triggers older than `ttl_ms`."""
        ...

    async def waiting_data_ids(self) -> list[str]:
        """data_ids whose triggers still wait although their data is stored (after a crash)."""
        ...

    async def cancel_vins(self, request_id: str, vins: Sequence[str], now_ms: int) -> CancelChunk:
        """Cancel the request for these VINs, at once."""
        ...

    async def start_cancel_all(
        self, request_id: str, now_ms: int, max_rows: int, correlation_id: str | None = None
    ) -> CancelChunk:
        """Record a cancel of every vehicle (its cut) and run its first chunk."""
        ...

    async def cancel_chunk(self, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
        """The next chunk of a cancel of every vehicle."""
        ...

    async def cancels_in_progress(self) -> list[str]:
        """Request ids whose cancel of every vehicle has chunks to go (after a crash)."""
        ...

    async def first_deadline(self) -> int | None:
        """The soonest expires_at of any row (ms), None when no row has one."""
        ...

    async def expire_due(self, now_ms: int, limit: int) -> list[tuple[str, str, bytes]]:
        """End `expired` up to `limit` rows past their expires_at: (VIN, request id, sha1) each."""
        ...
