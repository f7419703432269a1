"""Cancelling a request: its pending rows end `cancelled`, of named vehicles at once or of every
vehicle in bounded chunks, one transaction each, over either store's `Writes`.

`Cancels.cancel` returns once the cancel is durable; the rest of the walk (further chunks, the
deliveries already out, the `cancelled` receipt) runs behind it, one walk per request at a time,
and a walk a crash cut short is resumed at the next start (`resume`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from exhook_server import metrics
from exhook_server.aio import cancel_all
from exhook_server.batch import Tags
from exhook_server.config import Config
from exhook_server.dispatch.worker import OutcomeListener
from exhook_server.status import StatusPublisher
from storage.errors import LockTimeout, StorageError
from storage.model import CancelChunk, Outcome, now_ms
from storage.port import Writes

log = structlog.get_logger("sdv_fanout.ingest")

#: Told which (VIN, sha1) rows of a request a cancel ended; answers how many of them were in
#: flight (dispatch, which alone knows, marks them so their outcome follows the delivery).
CancelledListener = Callable[[str, tuple[tuple[str, bytes], ...]], Awaitable[int]]

_NO_TAGS = Tags()
#: Times a cancel chunk that found a vehicle's rows locked by someone else is tried again (after
#: a pause growing to 5 s: about 5 minutes in all) before the walk stops until the next start-up.
_LOCKED_RETRIES = 64


@dataclass(frozen=True, slots=True)
class CancelResult:
    request_id: str
    #: Pending rows the cancel ended.
    cancelled: int
    #: Of those, deliveries already out: their outcome becomes what the vehicle does with them.
    in_flight: int


class Cancels:
    """The cancels of one server: started by a cancel message or the Admin API, walked here."""

    def __init__(
        self,
        cfg: Config,
        writes: Writes,
        clock: Callable[[], int] = now_ms,
        status: StatusPublisher | None = None,
    ) -> None:
        self._cfg = cfg
        self._writes = writes
        self._clock = clock
        #: The `cancelled` receipts go here; None: no status topic (tools, tests).
        self.status = status
        #: Dispatch: counts (and marks) the deliveries out among the rows a chunk ended.
        self.listener: CancelledListener | None = None
        self.outcome_listeners: list[OutcomeListener] = []
        #: request id → the task finishing its cancel (counting in-flight rows, further chunks).
        self._cancelling: dict[str, asyncio.Task[CancelResult]] = {}

    async def cancel(
        self, request_id: str, vins: tuple[str, ...] | None, tags: Tags = _NO_TAGS
    ) -> asyncio.Task[CancelResult]:
        """Cancel `request_id` for `vins` (None: every vehicle). Returns once the cancel is
        durable: its rows ended (named VINs), or its job recorded and first chunk done (every
        vehicle; from then on none of its rows is sent). The returned task finishes the rest
        behind the caller's answer (in-flight count, further chunks, the `cancelled` event)
        and gives the totals; Admin waits for it, the hook does not."""
        now = self._clock()
        if vins is not None:
            first = await self._writes.cancel_vins(request_id, vins, now)
        else:
            first = await self._writes.start_cancel_all(request_id, now, self._cfg.cancel_rows, tags.correlation_id)
        log.info("cancel_started", request_id=request_id, vins=None if vins is None else len(vins), more=first.more)
        return self._finish(request_id, first, tags.correlation_id)

    def walk(self, first: CancelChunk) -> asyncio.Task[CancelResult]:
        """Finish a cancel of every vehicle whose first chunk someone else committed (an abort:
        exhook_server/abort.py), as `cancel` finishes its own."""
        return self._finish(first.request_id, first, None)

    def _finish(
        self, request_id: str, first: CancelChunk | None, correlation_id: str | None
    ) -> asyncio.Task[CancelResult]:
        previous = self._cancelling.get(request_id)
        task = asyncio.get_running_loop().create_task(
            self._rest(request_id, first, correlation_id, previous), name=f"cancel-{request_id}"
        )
        self._cancelling[request_id] = task
        task.add_done_callback(functools.partial(self._done, request_id))
        return task

    def _done(self, request_id: str, task: asyncio.Task[CancelResult]) -> None:
        if self._cancelling.get(request_id) is task:
            del self._cancelling[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("cancel_unfinished", request_id=request_id, detail=repr(task.exception()))

    async def _rest(
        self,
        request_id: str,
        chunk: CancelChunk | None,
        correlation_id: str | None,
        previous: asyncio.Task[CancelResult] | None,
    ) -> CancelResult:
        if previous is not None:  # one cancel walk of a request at a time
            await asyncio.wait([previous])
        in_flight = 0
        total = 0
        reason = None if chunk is None else chunk.reason
        if chunk is None:
            chunk = await self._logged_chunk(request_id)
        while True:
            # The next chunk commits while this one's rows are reported (deliveries out marked):
            # the walk waits for one of the two, not for both in turn.
            following = asyncio.ensure_future(self._logged_chunk(request_id)) if chunk.more else None
            try:
                in_flight += await self._ended(chunk)
            except BaseException:
                if following is not None:
                    following.cancel()
                raise
            total = chunk.total  # cumulative over the chunks of one cancel
            correlation_id = correlation_id or chunk.correlation_id
            reason = reason or chunk.reason
            if following is None:
                break
            chunk = await following
        metrics.CANCELS.inc()
        log.info("request_cancelled", request_id=request_id, cancelled=total, in_flight=in_flight, reason=reason)
        if self.status is not None:
            self.status.emit(
                "cancelled",
                request_id,
                cancelled=total,
                in_flight=in_flight,
                correlation_id=correlation_id,
                reason=reason,
            )
        return CancelResult(request_id, total, in_flight)

    async def _logged_chunk(self, request_id: str) -> CancelChunk:
        try:
            return await self._next_chunk(request_id)
        except StorageError as exc:  # the job stays recorded: the next start-up resumes it
            log.error("cancel_failed", request_id=request_id, reason=type(exc).__name__, detail=str(exc))
            raise

    async def _next_chunk(self, request_id: str) -> CancelChunk:
        """The next chunk of a cancel of every vehicle. One that waited too long for a vehicle's
        rows someone else holds (LockTimeout; nothing of it was written) is tried again after a
        pause, so the walk neither waits on that lock nor stops for it."""
        for attempt in range(_LOCKED_RETRIES):
            try:
                return await self._writes.cancel_chunk(request_id, self._clock(), self._cfg.cancel_rows)
            except LockTimeout as exc:
                log.warning("cancel_chunk_locked", request_id=request_id, attempt=attempt + 1, detail=str(exc))
                await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
        return await self._writes.cancel_chunk(request_id, self._clock(), self._cfg.cancel_rows)

    async def _ended(self, chunk: CancelChunk) -> int:
        if not chunk.cancelled:
            return 0
        metrics.OUTCOMES.labels("cancelled").inc(len(chunk.cancelled))
        for listener in self.outcome_listeners:
            for vin, sha1 in chunk.cancelled:
                listener(vin, chunk.request_id, sha1, Outcome.CANCELLED, 0)
        if self.listener is None:
            return 0
        return await self.listener(chunk.request_id, chunk.cancelled)

    async def resume(self) -> list[str]:
        """At start-up: finish cancels of every vehicle a crash cut short."""
        found = await self._writes.cancels_in_progress()
        for request_id in found:
            log.info("cancel_resumed", request_id=request_id)
            self._finish(request_id, None, None)
        return found

    async def stop(self) -> None:
        """Stop the walks (what is left stays recorded; the next start resumes it)."""
        tasks: list[asyncio.Task[Any]] = list(self._cancelling.values())
        await cancel_all(tasks)


async def run_cancel(writes: Writes, request_id: str, vins: Sequence[str] | None, now_ms: int, max_rows: int) -> int:
    """A whole cancel in this process through either store's `Writes`, one transaction per chunk
    (`sdv-fanout cancel` without a server; LMDB serialises it with a running server's writer,
    PostgreSQL with every instance's). Returns the rows cancelled."""
    if vins is not None:
        return (await writes.cancel_vins(request_id, vins, now_ms)).total
    chunk = await writes.start_cancel_all(request_id, now_ms, max_rows)
    while chunk.more:
        chunk = await writes.cancel_chunk(request_id, now_ms, max_rows)
    return chunk.total
