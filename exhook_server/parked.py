"""Parked triggers (the plugin format's triggers stored before their data): completed in chunks
once their data arrives, dropped with a reason when it never comes.

A completion runs behind the data message's answer, one transaction of at most
max_rows_per_commit rows at a time; the triggers stay parked (durably) until their chunk commits,
so a crash leaves them for `resume`. The sweep drops those older than early_ttl_s every
early_sweep_interval_s, each with a log line, a count and a `rejected` receipt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from exhook_server import metrics
from exhook_server.aio import cancel_all
from exhook_server.batch import shown_batch_id
from exhook_server.config import Config
from exhook_server.status import StatusPublisher
from storage.errors import StorageError, StorageFull
from storage.model import BatchWritten, EarlyExpired, now_ms
from storage.port import Writes

log = structlog.get_logger("sdv_fanout.ingest")

#: Told of each parked trigger that became rows: (its rows written, its data_id).
CompletedListener = Callable[[BatchWritten, str], None]

_REASON_DETAIL = {
    "data_never_arrived": "the trigger's data (data_id) did not arrive within early_ttl_s",
    "expired": "expires_at passed while the trigger waited for its data",
}


def report_expired(expired: Sequence[EarlyExpired], status: StatusPublisher | None = None) -> None:
    """One log line, one count and one `rejected` receipt per parked trigger whose data never
    came (sweep and GC alike) or whose expires_at passed while it waited."""
    for e in expired:
        if status is not None:
            status.emit(
                "rejected",
                e.request_id,
                of="trigger",
                reason=e.reason,
                detail=_REASON_DETAIL.get(e.reason),
                data_id=e.data_id,
                batch_id=shown_batch_id(e.batch_id),
                correlation_id=e.correlation_id,
            )
        metrics.EARLY_EXPIRED.inc()
        log.warning(
            "early_trigger_expired",
            reason=e.reason,
            data_id=e.data_id,
            request_id=e.request_id,
            vins=e.vins,
            age_ms=e.age_ms,
        )


class ParkedTriggers:
    """The parked triggers of one server: their completion and their sweep."""

    def __init__(
        self,
        cfg: Config,
        writes: Writes,
        on_completed: CompletedListener,
        clock: Callable[[], int] = now_ms,
        status: StatusPublisher | None = None,
    ) -> None:
        self._cfg = cfg
        self._writes = writes
        self._on_completed = on_completed
        self._clock = clock
        self.status = status
        #: data_id → the task completing its remaining parked triggers.
        self._completing: dict[str, asyncio.Task[None]] = {}

    def completed(self, data_id: str, done: Sequence[BatchWritten], expired: Sequence[EarlyExpired] = ()) -> None:
        """Report a chunk of `data_id`'s triggers: those that became rows, those dropped."""
        for written in done:
            metrics.EARLY_COMPLETED.inc()
            self._on_completed(written, data_id)
        report_expired(expired, self.status)

    def complete(self, data_id: str) -> None:
        """Complete the triggers still parked for `data_id` behind the caller's answer, one
        transaction of at most max_rows_per_commit rows at a time: a batch committed meanwhile
        waits for one chunk, not for a million parked rows."""
        if data_id in self._completing:
            return
        task = asyncio.get_running_loop().create_task(self._complete_rest(data_id), name=f"complete-{data_id}")
        self._completing[data_id] = task
        task.add_done_callback(lambda _: self._completing.pop(data_id, None))

    async def _complete_rest(self, data_id: str) -> None:
        chunks = 0
        while True:
            try:
                chunk = await self._writes.complete_early(
                    data_id, self._clock(), self._cfg.max_rows_per_commit, self._cfg.max_pending_per_vehicle
                )
            except StorageError as exc:  # the triggers stay parked: the next start-up retries
                log.error("early_completion_failed", data_id=data_id, reason=type(exc).__name__, detail=str(exc))
                return
            chunks += 1
            self.completed(data_id, chunk.completed, chunk.expired)
            if not chunk.more:
                log.info("early_completion_done", data_id=data_id, chunks=chunks)
                return

    async def resume(self) -> list[str]:
        """At start-up: complete triggers whose data arrived before a crash cut their chunks short."""
        found = await self._writes.waiting_data_ids()
        for data_id in found:
            log.info("early_completion_resumed", data_id=data_id)
            self.complete(data_id)
        return found

    async def sweep(self) -> list[EarlyExpired]:
        """Drop parked triggers whose data never came, each with a logged reason."""
        expired = await self._writes.expire_early(
            self._clock(), int(self._cfg.early_ttl_s * 1000), self._cfg.early_max_count
        )
        report_expired(expired, self.status)
        return expired

    async def run_sweeper(self) -> None:
        """Forever: sweep every early_sweep_interval_s; storage errors are logged, not fatal."""
        while True:
            await asyncio.sleep(self._cfg.early_sweep_interval_s)
            try:
                await self.sweep()
            except StorageFull:
                log.error("early_sweep_failed", reason="storage_full")
            except StorageError as exc:
                log.error("early_sweep_failed", reason=type(exc).__name__, detail=str(exc))

    async def stop(self) -> None:
        """Stop completing (the triggers left stay parked; the next start resumes them)."""
        tasks: list[asyncio.Task[Any]] = list(self._completing.values())
        await cancel_all(tasks)
