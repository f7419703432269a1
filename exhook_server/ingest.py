"""From a checked batch message to durable rows, with the log line and metrics of each outcome.

`Ingestor.ingest` returns only once the batch is durable in the store behind `Writes`
(storage/port.py: LMDB committed and fsynced, or PostgreSQL committed), or raises: the hook
answers EMQX after that, which is the durability promise.
Rejections are logged and counted here, once, with their reason code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from exhook_server import metrics
from exhook_server.aio import cancel_all
from exhook_server.batch import (
    MAX_BATCH_ID_BYTES,
    MAX_CORRELATION_ID_BYTES,
    Batch,
    BatchParser,
    Cancel,
    Data,
    Kind,
    Lifecycle,
    Parsed,
    PolicyDoc,
    Tags,
    Trigger,
)
from exhook_server.campaign import Campaigns
from exhook_server.config import Config
from exhook_server.errors import BatchRejected, EarlyTriggersFull, Reason, StorageError, StorageFull
from exhook_server.status import StatusPublisher
from exhook_server.topics import is_level
from storage.errors import CommitTimeout, LockTimeout
from storage.lmdb import batches
from storage.lmdb import cancel as cancelling
from storage.model import Outcome, now_ms
from storage.port import Writes

log = structlog.get_logger("sdv_fanout.ingest")

#: Called with the (vins, request_id) of every batch that became rows; dispatch hooks in here.
StoredListener = Callable[[tuple[str, ...], str], None]
#: Told which (VIN, sha1) rows of a request a cancel ended; answers how many of them were in
#: flight (dispatch, which alone knows, marks them so their outcome follows the delivery).
CancelledListener = Callable[[str, tuple[tuple[str, bytes], ...]], Awaitable[int]]
#: Told of every pair housekeeping ended (expiry, cancel): (vin, request_id, sha1, outcome, attempts).
OutcomeListener = Callable[[str, str, bytes, Outcome, int], None]

_NO_TAGS = Tags()
#: Starts the batch_id implied for a batch or trigger that names none (`implied_batch_id`): 59
#: bytes with the digest, kept apart from the platform's own ids by this prefix.
IMPLIED_PREFIX = "sdv-fanout:message:"


def implied_batch_id(topic: str, payload: bytes) -> str:
    """The batch_id of a message that names none: a digest of its topic and payload, so the same
    message reaching us twice (the hook and the catch-up session, or a redelivery) is stored once."""
    digest = hashlib.blake2b(topic.encode(), digest_size=20)
    digest.update(b"\0")
    digest.update(payload)  # fed in parts: no copy of a payload of megabytes
    return IMPLIED_PREFIX + digest.hexdigest()


def shown_batch_id(batch_id: str | None) -> str | None:
    """The batch_id a receipt shows: the platform's own, never an implied one."""
    return None if batch_id is None or batch_id.startswith(IMPLIED_PREFIX) else batch_id


#: Refused VINs named in one log line at most (the receipt names them all).
_LOGGED_REFUSED = 5
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


#: Longest `detail` of a `rejected` receipt, in characters: a sentence, not a payload.
MAX_DETAIL_CHARS = 200
_STORAGE_DETAIL = "the store could not take the batch now; nothing was stored: retry it (same batch_id)"
_EARLY_DETAIL = {
    "data_never_arrived": "the trigger's data (data_id) did not arrive within early_ttl_s",
    "expired": "expires_at passed while the trigger waited for its data",
}


def bounded_detail(detail: str) -> str:
    """`detail` cut to MAX_DETAIL_CHARS (marked with "..." when cut)."""
    return detail if len(detail) <= MAX_DETAIL_CHARS else detail[: MAX_DETAIL_CHARS - 3] + "..."


def report_expired_early(expired: list[batches.EarlyExpired], status: StatusPublisher | None = None) -> None:
    """One log line, one count and one `rejected` receipt per early trigger whose data never
    came (sweeper and GC alike)."""
    for e in expired:
        if status is not None:
            status.emit(
                "rejected",
                e.request_id,
                of="trigger",
                reason=e.reason,
                detail=_EARLY_DETAIL.get(e.reason),
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


class Ingestor:
    """Validates, stores and reports batch messages."""

    def __init__(
        self,
        cfg: Config,
        writes: Writes,
        clock: Callable[[], int] = now_ms,
        status: StatusPublisher | None = None,
    ) -> None:
        self._cfg = cfg
        #: Receipts go here (after the commit); None: no status topic (tools, tests).
        self.status = status
        #: The store, whichever engine it is (storage/port.py).
        self._writes = writes
        self._clock = clock
        self.parser = BatchParser(cfg, clock)
        #: Campaign policies (policy_topic) go here.
        self.campaigns = Campaigns(cfg, writes, clock)
        #: With a catch-up session, a batch or trigger without batch_id gets `implied_batch_id`.
        self._imply_ids = cfg.catchup_active
        self.listeners: list[StoredListener] = []
        self.cancel_listener: CancelledListener | None = None
        self.outcome_listeners: list[OutcomeListener] = []
        #: data_id → the task completing its remaining parked triggers.
        self._completing: dict[str, asyncio.Task[None]] = {}
        #: request id → the task finishing its cancel (counting in-flight rows, further chunks).
        self._cancelling: dict[str, asyncio.Task[CancelResult]] = {}

    async def ingest(
        self, kind: Kind, topic: str, payload: bytes, clientid: str, username: str, *, via: str = "hook"
    ) -> bool:
        """Store one batch message durably. False if rejected (logged); raises StorageError.
        `via` "catchup": the message came through the catch-up session, which does not learn its
        publisher (the broker's ACL alone decided who may publish it), so publisher_allowlist is
        not checked."""
        started = asyncio.get_running_loop().time()
        try:
            if via == "hook":
                self.parser.check_publisher(clientid, username)
            parsed = self.parser.parse(kind, topic, payload)
            if self._imply_ids and isinstance(parsed, Batch | Trigger) and parsed.tags.batch_id is None:
                tags = Tags(implied_batch_id(topic, payload), parsed.tags.correlation_id)
                parsed = dataclasses.replace(parsed, tags=tags)
            await self._store_parsed(parsed)
        except BatchRejected as rej:
            metrics.REJECTED.labels(rej.reason.value).inc()
            log.warning(
                "batch_rejected",
                reason=rej.reason.value,
                detail=rej.detail,
                topic=topic,
                publisher=clientid,
                via=via,
                **rej.fields,
            )
            self._receipt_rejected(rej.reason.value, kind, payload, rej.detail, field=rej.field, vin=rej.vin)
            return False
        except StorageError as exc:
            kind_label = type(exc).__name__
            metrics.STORAGE_ERRORS.labels(kind_label).inc()
            log.error("batch_not_stored", reason=kind_label, detail=str(exc), topic=topic, publisher=clientid, via=via)
            # A commit that timed out may still land: say nothing, a retry with its batch_id
            # gets the receipt. Any other storage error stored nothing.
            if not isinstance(exc, CommitTimeout):
                self._receipt_rejected("storage_unavailable", kind, payload, _STORAGE_DETAIL)
            raise
        metrics.INGEST_SECONDS.observe(asyncio.get_running_loop().time() - started)
        return True

    async def _store_parsed(self, parsed: Parsed) -> None:
        now = self._clock()
        if isinstance(parsed, Batch):
            written = await self._writes.store_batch(
                parsed.vins, parsed.request_id, parsed.blob, now, parsed.tags.batch_id, self._spec(parsed.life)
            )
            if isinstance(written, batches.Duplicate):
                self._duplicate(written, parsed.tags)
                return
            self._stored(written, "batch", tags=parsed.tags)
        elif isinstance(parsed, Data):
            data = await self._writes.store_data(
                parsed.data_id, parsed.blob, now, self._cfg.max_rows_per_commit, self._cfg.max_pending_per_vehicle
            )
            _count_blob(data.new_blob)
            log.info(
                "data_stored",
                data_id=data.data_id,
                sha1=data.sha1.hex(),
                size=len(parsed.blob),
                new_blob=data.new_blob,
                completed_triggers=len(data.completed),
                more_waiting=data.more,
            )
            self._completed(data.data_id, data.completed, data.expired)
            if data.more:
                self.complete_waiting(data.data_id)
        elif isinstance(parsed, Cancel):
            await self.cancel(parsed.request_id, parsed.vins, parsed.tags)
        elif isinstance(parsed, PolicyDoc):
            await self.campaigns.apply(parsed, self.status)
        else:
            trig = parsed
            try:
                result = await self._writes.store_trigger(
                    trig.data_id,
                    trig.vins,
                    trig.request_id,
                    now,
                    self._cfg.early_max_count,
                    self._cfg.early_max_rows,
                    trig.tags.batch_id,
                    trig.tags.correlation_id,
                    self._spec(trig.life),
                )
            except EarlyTriggersFull as exc:
                raise BatchRejected(
                    Reason.EARLY_TRIGGERS_FULL, str(exc), data_id=trig.data_id, request_id=trig.request_id
                ) from None
            if isinstance(result, batches.Duplicate):
                self._duplicate(result, trig.tags)
            elif result.batch is None:
                metrics.EARLY_PARKED.inc()
                log.info("trigger_parked", data_id=trig.data_id, request_id=trig.request_id, vins=len(trig.vins))
            else:
                self._stored(result.batch, "trigger", tags=trig.tags, data_id=trig.data_id)

    def _spec(self, life: Lifecycle) -> batches.RowSpec:
        return batches.RowSpec(life.expires_ms, life.flags, self._cfg.max_pending_per_vehicle)

    def _stored(self, written: batches.BatchWritten, fmt: str, tags: Tags | None = None, **fields: Any) -> None:
        metrics.BATCHES_STORED.labels(fmt).inc()
        metrics.ROWS_STORED.inc(written.rows)
        metrics.ROWS_REPLACED.inc(written.replaced)
        if fmt == "batch":
            _count_blob(written.new_blob)
        log.info(
            "batch_stored",
            request_id=written.request_id,
            vins=written.rows,
            replaced=written.replaced,
            sha1=written.sha1.hex(),
            new_blob=written.new_blob,
            format=fmt,
            refused=len(written.refused),
            **fields,
        )
        if written.refused:
            _log_refused(written.request_id, written.refused)
        if self.status is not None:
            tags = tags or Tags(written.batch_id, written.correlation_id)
            self.status.emit(
                "accepted",
                written.request_id,
                sha1=written.sha1.hex(),
                vins=written.rows,
                refused=_refused_list(written.refused),
                batch_id=shown_batch_id(tags.batch_id),
                correlation_id=tags.correlation_id,
            )
        if written.superseded:
            metrics.OUTCOMES.labels("superseded").inc(len(written.superseded))
        if self.listeners:
            # After the answer, not before: the hook's reply (and EMQX's next batch) need not wait
            # for dispatch to sort 200 VINs onto its workers; call_soon keeps the batches' order.
            asyncio.get_running_loop().call_soon(self._notify, written.vins, written.request_id)

    def _duplicate(self, dup: batches.Duplicate, tags: Tags) -> None:
        """A retry of a batch_id already stored: nothing written, the first receipt again."""
        metrics.BATCHES_DUPLICATE.inc()
        log.info("batch_duplicate", batch_id=dup.batch_id, request_id=dup.request_id, parked=dup.sha1 is None)
        if self.status is not None and dup.sha1 is not None:  # a parked one gets its receipt on completion
            self.status.emit(
                "accepted",
                dup.request_id,
                sha1=dup.sha1.hex(),
                vins=dup.rows,
                refused=_refused_list(dup.refused),
                duplicate=True,
                batch_id=shown_batch_id(dup.batch_id),
                correlation_id=tags.correlation_id,
            )

    def _receipt_rejected(
        self,
        reason: str,
        kind: Kind,
        payload: bytes,
        detail: str,
        *,
        field: str | None = None,
        vin: str | None = None,
    ) -> None:
        """`rejected` on the request's status topic when the payload names a usable request id
        (and echo its correlation_id), else on `<prefix>/_rejected`; with what is wrong in words
        (`detail`) and, where one is at fault, the batch `field` and the `vin`, all bounded."""
        if self.status is None or not self.status.enabled:
            return
        request_id, correlation_id, batch_id = _peek_ids(kind, payload, self._cfg.max_request_id_bytes)
        # `of` names the message refused: a refused cancel must not read as a rejected batch of R.
        self.status.emit(
            "rejected",
            request_id,
            of=kind.value,
            reason=reason,
            detail=bounded_detail(detail),
            field=field,
            vin=vin,
            batch_id=batch_id,
            correlation_id=correlation_id,
        )

    def _notify(self, vins: tuple[str, ...], request_id: str) -> None:
        for listener in self.listeners:
            listener(vins, request_id)

    def _completed(
        self, data_id: str, completed: tuple[batches.BatchWritten, ...], expired: tuple[batches.EarlyExpired, ...] = ()
    ) -> None:
        for done in completed:
            metrics.EARLY_COMPLETED.inc()
            self._stored(done, "trigger", data_id=data_id, early=True)
        report_expired_early(list(expired), self.status)

    def complete_waiting(self, data_id: str) -> None:
        """Complete the triggers still waiting for `data_id` behind the hook's answer, one
        transaction of at most max_rows_per_commit rows at a time: a batch committed meanwhile
        waits for one chunk, not for a million parked rows. The triggers stay parked (durably)
        until their chunk commits; after a crash, `resume_waiting` finds them again."""
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
            self._completed(data_id, chunk.completed, chunk.expired)
            if not chunk.more:
                log.info("early_completion_done", data_id=data_id, chunks=chunks)
                return

    async def stop(self) -> None:
        """Stop completing parked triggers and cancels (what is left stays recorded; the next
        start resumes it)."""
        tasks: list[asyncio.Task[Any]] = [*self._completing.values(), *self._cancelling.values()]
        await cancel_all(tasks)

    # -- cancel ------------------------------------------------------------------------------
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
        return self._finish_cancel(request_id, first, tags.correlation_id)

    def _finish_cancel(
        self, request_id: str, first: cancelling.CancelChunk | None, correlation_id: str | None
    ) -> asyncio.Task[CancelResult]:
        previous = self._cancelling.get(request_id)
        task = asyncio.get_running_loop().create_task(
            self._cancel_rest(request_id, first, correlation_id, previous), name=f"cancel-{request_id}"
        )
        self._cancelling[request_id] = task
        task.add_done_callback(functools.partial(self._cancel_done, request_id))
        return task

    def _cancel_done(self, request_id: str, task: asyncio.Task[CancelResult]) -> None:
        if self._cancelling.get(request_id) is task:
            del self._cancelling[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("cancel_unfinished", request_id=request_id, detail=repr(task.exception()))

    async def _cancel_rest(
        self,
        request_id: str,
        chunk: cancelling.CancelChunk | None,
        correlation_id: str | None,
        previous: asyncio.Task[CancelResult] | None,
    ) -> CancelResult:
        if previous is not None:  # one cancel walk of a request at a time
            await asyncio.wait([previous])
        in_flight = 0
        total = 0
        if chunk is None:
            chunk = await self._logged_chunk(request_id)
        while True:
            # The next chunk commits while this one's rows are reported (deliveries out marked):
            # the walk waits for one of the two, not for both in turn.
            following = asyncio.ensure_future(self._logged_chunk(request_id)) if chunk.more else None
            try:
                in_flight += await self._ended_by_cancel(chunk)
            except BaseException:
                if following is not None:
                    following.cancel()
                raise
            total = chunk.total  # cumulative over the chunks of one cancel
            correlation_id = correlation_id or chunk.correlation_id
            if following is None:
                break
            chunk = await following
        metrics.CANCELS.inc()
        log.info("request_cancelled", request_id=request_id, cancelled=total, in_flight=in_flight)
        if self.status is not None:
            self.status.emit(
                "cancelled", request_id, cancelled=total, in_flight=in_flight, correlation_id=correlation_id
            )
        return CancelResult(request_id, total, in_flight)

    async def _logged_chunk(self, request_id: str) -> cancelling.CancelChunk:
        try:
            return await self._next_cancel_chunk(request_id)
        except StorageError as exc:  # the job stays recorded: the next start-up resumes it
            log.error("cancel_failed", request_id=request_id, reason=type(exc).__name__, detail=str(exc))
            raise

    async def _next_cancel_chunk(self, request_id: str) -> cancelling.CancelChunk:
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

    async def _ended_by_cancel(self, chunk: cancelling.CancelChunk) -> int:
        if not chunk.cancelled:
            return 0
        metrics.OUTCOMES.labels("cancelled").inc(len(chunk.cancelled))
        for listener in self.outcome_listeners:
            for vin, sha1 in chunk.cancelled:
                listener(vin, chunk.request_id, sha1, Outcome.CANCELLED, 0)
        if self.cancel_listener is None:
            return 0
        return await self.cancel_listener(chunk.request_id, chunk.cancelled)

    async def resume_cancels(self) -> list[str]:
        """At start-up: finish cancels of every vehicle a crash cut short."""
        found = await self._writes.cancels_in_progress()
        for request_id in found:
            log.info("cancel_resumed", request_id=request_id)
            self._finish_cancel(request_id, None, None)
        return found

    # -- expiry ------------------------------------------------------------------------------
    async def sweep_expired(self) -> int:
        """End `expired` every row past its expires_at, in chunks; returns how many."""
        ended_total = 0
        limit = self._cfg.max_rows_per_commit
        soonest = await self._writes.first_deadline()  # an idle sweep costs one read, no write
        if soonest is None or soonest > self._clock():
            return 0
        while True:
            ended = await self._writes.expire_due(self._clock(), limit)
            if ended:
                metrics.OUTCOMES.labels("expired").inc(len(ended))
                log.info("rows_expired", rows=len(ended), request_ids=sorted({rid for _, rid, _ in ended})[:10])
                for listener in self.outcome_listeners:
                    for vin, rid, sha1 in ended:
                        listener(vin, rid, sha1, Outcome.EXPIRED, 0)
            ended_total += len(ended)
            if len(ended) < limit:
                return ended_total

    async def run_expiry_sweeper(self) -> None:
        """Forever: end expired rows every expiry_sweep_interval_s; errors are logged, not fatal."""
        while True:
            await asyncio.sleep(self._cfg.expiry_sweep_interval_s)
            try:
                await self.sweep_expired()
            except StorageError as exc:
                log.error("expiry_sweep_failed", reason=type(exc).__name__, detail=str(exc))

    async def resume_waiting(self) -> list[str]:
        """At start-up: complete triggers whose data arrived before a crash cut their chunks short."""
        found = await self._writes.waiting_data_ids()
        for data_id in found:
            log.info("early_completion_resumed", data_id=data_id)
            self.complete_waiting(data_id)
        return found

    async def sweep_early(self) -> list[batches.EarlyExpired]:
        """Drop early triggers whose data never came, each with a logged reason."""
        expired = await self._writes.expire_early(
            self._clock(), int(self._cfg.early_ttl_s * 1000), self._cfg.early_max_count
        )
        report_expired_early(expired, self.status)
        return expired

    async def run_early_sweeper(self) -> None:
        """Forever: sweep every early_sweep_interval_s; storage errors are logged, not fatal."""
        while True:
            await asyncio.sleep(self._cfg.early_sweep_interval_s)
            try:
                await self.sweep_early()
            except StorageFull:
                log.error("early_sweep_failed", reason="storage_full")
            except StorageError as exc:
                log.error("early_sweep_failed", reason=type(exc).__name__, detail=str(exc))


def _refused_list(refused: tuple[str, ...]) -> list[dict[str, str]]:
    return [{"vin": vin, "reason": "vehicle_backlog_full"} for vin in refused]


def _log_refused(request_id: str, refused: tuple[str, ...]) -> None:
    metrics.ROWS_REFUSED.labels("vehicle_backlog_full").inc(len(refused))
    log.warning(
        "vehicle_backlog_full",
        reason="vehicle_backlog_full",
        request_id=request_id,
        vins=len(refused),
        first=list(refused[:_LOGGED_REFUSED]),
    )


def _count_blob(new_blob: bool) -> None:
    (metrics.BLOBS_NEW if new_blob else metrics.DEDUP_HITS).inc()


def _peek_ids(kind: Kind, payload: bytes, max_request_id_bytes: int) -> tuple[str | None, str | None, str | None]:
    """request_id, correlation_id and batch_id of a rejected batch, where they are usable:
    a request id only if it could be a status topic level, tags only if short strings."""
    if kind is Kind.DATA or len(payload) > 4 << 20:
        return None, None, None
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None, None, None
    if not isinstance(doc, dict):
        return None, None, None
    rid = doc.get("request_id")
    usable = isinstance(rid, str) and is_level(rid) and len(rid.encode(errors="replace")) <= max_request_id_bytes
    return (
        rid if usable else None,
        _short(doc.get("correlation_id"), MAX_CORRELATION_ID_BYTES),
        _short(doc.get("batch_id"), MAX_BATCH_ID_BYTES),
    )


def _short(value: Any, max_bytes: int) -> str | None:
    if isinstance(value, str) and 0 < len(value.encode(errors="replace")) <= max_bytes:
        return value
    return None
