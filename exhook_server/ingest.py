"""From a checked batch message to durable rows, with the log line, metrics and receipt of each outcome.

`Ingestor.ingest` returns only once the message is durable in the store behind `Writes`
(storage/port.py: LMDB committed and fsynced, or PostgreSQL committed), or raises: the hook
answers EMQX after that, which is the durability promise. Rejections are logged and counted
here, once, with their reason code. A cancel's walk (`cancel.Cancels`) and the completion of
parked triggers (`parked.ParkedTriggers`) run behind the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
import structlog

from exhook_server import metrics
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
    Preview,
    Tags,
    Trigger,
    implied_batch_id,
    shown_batch_id,
)
from exhook_server.campaign import Campaigns
from exhook_server.cancel import Cancels
from exhook_server.config import Config
from exhook_server.errors import BatchRejected, EarlyTriggersFull, Reason, StorageError
from exhook_server.parked import ParkedTriggers
from exhook_server.status import StatusPublisher
from exhook_server.topics import is_level
from storage.errors import CommitTimeout, RequestAborted
from storage.model import BatchWritten, Duplicate, RowSpec, TriggerWritten, now_ms
from storage.port import Writes

log = structlog.get_logger("sdv_fanout.ingest")

#: Called with the (vins, request_id) of every batch that became rows; dispatch hooks in here.
StoredListener = Callable[[tuple[str, ...], str], None]

#: How many of these VINs are online now (dispatch answers it, for a preview's `online_now`).
OnlineCount = Callable[[Sequence[str]], Awaitable[int]]

#: Refused VINs named in one log line at most (the receipt names them all).
_LOGGED_REFUSED = 5
#: Longest `detail` of a `rejected` receipt, in characters: a sentence, not a payload.
MAX_DETAIL_CHARS = 200
_STORAGE_DETAIL = "the store could not take the batch now; nothing was stored: retry it (same batch_id)"


def bounded_detail(detail: str) -> str:
    """`detail` cut to MAX_DETAIL_CHARS (marked with "..." when cut)."""
    return detail if len(detail) <= MAX_DETAIL_CHARS else detail[: MAX_DETAIL_CHARS - 3] + "..."


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
        #: Counts the online VINs of a preview; None (tools, tests): previews say 0.
        self.online_among: OnlineCount | None = None
        #: The jobs a message starts: a cancel's walk, the completion of parked triggers.
        self.cancels = Cancels(cfg, writes, clock, status)
        self.parked = ParkedTriggers(cfg, writes, self._parked_stored, clock, status)

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
            try:
                written = await self._writes.store_batch(*self._batch_args(parsed, now))
            except RequestAborted as exc:
                raise BatchRejected(Reason.ABORTED, str(exc), request_id=parsed.request_id) from None
            if isinstance(written, Duplicate):
                self._duplicate(written, parsed.tags)
                return
            self._stored(written, "batch", tags=parsed.tags)
        elif isinstance(parsed, Preview):
            await self._preview(parsed, now)
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
            self.parked.completed(data.data_id, data.completed, data.expired)
            if data.more:
                self.parked.complete(data.data_id)
        elif isinstance(parsed, Cancel):
            await self.cancels.cancel(parsed.request_id, parsed.vins, parsed.tags)
        elif isinstance(parsed, PolicyDoc):
            await self.campaigns.apply(parsed, self.status)
        else:
            trig = parsed
            result = await self._store_trigger(trig, now)
            if isinstance(result, Duplicate):
                self._duplicate(result, trig.tags)
            elif result.batch is None:
                metrics.EARLY_PARKED.inc()
                log.info("trigger_parked", data_id=trig.data_id, request_id=trig.request_id, vins=len(trig.vins))
            else:
                self._stored(result.batch, "trigger", tags=trig.tags, data_id=trig.data_id)

    async def _store_trigger(self, trig: Trigger, now: int, *, dry_run: bool = False) -> TriggerWritten | Duplicate:
        """`Writes.store_trigger` of `trig` (a preview: with dry_run), its refusals as rejections."""
        try:
            return await self._writes.store_trigger(
                trig.data_id,
                trig.vins,
                trig.request_id,
                now,
                self._cfg.early_max_count,
                self._cfg.early_max_rows,
                trig.tags.batch_id,
                trig.tags.correlation_id,
                self._spec(trig.life),
                dry_run=dry_run,
            )
        except EarlyTriggersFull as exc:
            raise BatchRejected(
                Reason.EARLY_TRIGGERS_FULL, str(exc), data_id=trig.data_id, request_id=trig.request_id
            ) from None
        except RequestAborted as exc:
            raise BatchRejected(Reason.ABORTED, str(exc), request_id=trig.request_id) from None

    def _batch_args(self, batch: Batch, now: int) -> tuple[Any, ...]:
        """`Writes.store_batch`'s arguments for `batch` (a preview passes them with dry_run)."""
        return batch.vins, batch.request_id, batch.blob, now, batch.tags.batch_id, self._spec(batch.life)

    async def _preview(self, preview: Preview, now: int) -> None:
        """Report what the batch or trigger would do now (the store's own decision, undone), store
        nothing. A trigger whose data has not come would be parked: it would store no row now."""
        would: tuple[str, ...] = ()
        replaced = 0
        refused: tuple[str, ...] = ()
        duplicate = parked = False
        if preview.batch is not None:
            # A refusal is what the batch would get: its rejected event, marked dry_run.
            written: BatchWritten | TriggerWritten | Duplicate
            if isinstance(preview.batch, Trigger):
                written = await self._store_trigger(preview.batch, now, dry_run=True)
            else:
                try:
                    written = await self._writes.store_batch(*self._batch_args(preview.batch, now), dry_run=True)
                except RequestAborted as exc:
                    raise BatchRejected(Reason.ABORTED, str(exc), request_id=preview.request_id) from None
            if isinstance(written, TriggerWritten):
                parked = written.batch is None
                written = written.batch if written.batch is not None else written
            if isinstance(written, Duplicate):
                duplicate = True
            elif isinstance(written, BatchWritten):
                would, replaced, refused = written.vins, written.replaced, written.refused
        online = await self.online_among(would) if would and self.online_among is not None else 0
        metrics.BATCHES_PREVIEWED.inc()
        log.info(
            "batch_previewed",
            request_id=preview.request_id,
            would_store=len(would),
            already_pending=replaced,
            refused=len(refused),
            online_now=online,
            rejected_vins=len(preview.rejected_vins),
            duplicate=duplicate,
            parked=parked,
        )
        if self.status is None:
            return
        fields: dict[str, Any] = {"duplicate": True} if duplicate else {}
        if parked:
            fields["parked"] = True
        if preview.rejected_vins:
            fields["reason"] = Reason.BAD_VIN.value
        self.status.emit(
            "preview",
            preview.request_id,
            would_store=len(would),
            already_pending=replaced,
            refused=_refused_list(refused),
            online_now=online,
            rejected_vins=list(preview.rejected_vins),
            batch_id=shown_batch_id(preview.tags.batch_id),
            correlation_id=preview.tags.correlation_id,
            **fields,
        )

    def _spec(self, life: Lifecycle) -> RowSpec:
        return RowSpec(life.expires_ms, life.flags, self._cfg.max_pending_per_vehicle)

    def _stored(self, written: BatchWritten, fmt: str, tags: Tags | None = None, **fields: Any) -> None:
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

    def _duplicate(self, dup: Duplicate, tags: Tags) -> None:
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
        request_id, correlation_id, batch_id, dry_run = _peek_ids(kind, payload, self._cfg.max_request_id_bytes)
        # `of` names the message refused: a refused cancel must not read as a rejected batch of R,
        # nor a refused preview (`dry_run`) as a rejected batch.
        self.status.emit(
            "rejected",
            request_id,
            of=kind.value,
            dry_run=dry_run or None,
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

    def _parked_stored(self, written: BatchWritten, data_id: str) -> None:
        self._stored(written, "trigger", data_id=data_id, early=True)

    async def stop(self) -> None:
        """Stop completing parked triggers and cancels (what is left stays recorded; the next
        start resumes it)."""
        await self.parked.stop()
        await self.cancels.stop()


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


def _peek_ids(kind: Kind, payload: bytes, max_request_id_bytes: int) -> tuple[str | None, str | None, str | None, bool]:
    """request_id, correlation_id and batch_id of a rejected batch, where they are usable:
    a request id only if it could be a status topic level, tags only if short strings; and
    whether it asked for a preview (`"dry_run": true`)."""
    if kind is Kind.DATA or len(payload) > 4 << 20:
        return None, None, None, False
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None, None, None, False
    if not isinstance(doc, dict):
        return None, None, None, False
    rid = doc.get("request_id")
    usable = isinstance(rid, str) and is_level(rid) and len(rid.encode(errors="replace")) <= max_request_id_bytes
    return (
        rid if usable else None,
        _short(doc.get("correlation_id"), MAX_CORRELATION_ID_BYTES),
        _short(doc.get("batch_id"), MAX_BATCH_ID_BYTES),
        kind in (Kind.BATCH, Kind.TRIGGER) and doc.get("dry_run") is True,
    )


def _short(value: Any, max_bytes: int) -> str | None:
    if isinstance(value, str) and 0 < len(value.encode(errors="replace")) <= max_bytes:
        return value
    return None
