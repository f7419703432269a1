"""The status topic: what the server tells the platform about its requests.

Each message about request R is one JSON object (`event`, `request_id`, `ts_ms`, the batch's
`correlation_id`) published QoS 1 to `<status_topic_prefix>/<R>` (`.../_rejected`: a rejection without
a usable request id; `.../_unroutable`: an id no topic may hold). A message is kept until the broker
PUBACKs it and written again in order after a reconnect: the platform may hear one twice, never lose
one uncounted. The queue is bounded (`status_queue_max`, `status_queue_max_bytes`), progress reports
drop first, every drop is counted (`sdv_fanout_status_dropped_total`). The Admin queries are the truth.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import orjson
import structlog

from exhook_server import metrics
from exhook_server.config import Config
from exhook_server.topics import is_level
from storage.model import now_ms

log = structlog.get_logger("sdv_fanout.status")

REJECTED_LEVEL = "_rejected"
#: Events about a request id that cannot be a topic level (only rows stored past ingest
#: validation, by an older release, can have one): a broker would drop our link for its topic.
UNROUTABLE_LEVEL = "_unroutable"
#: Status messages written and not yet PUBACKed at most: enough to keep a loopback or LAN link
#: busy, small next to the delivery window the same connection carries.
WINDOW = 32
#: What a held message costs besides its payload and topic (its record, the bytes and str
#: headers, the dict slots; measured with tracemalloc): counted so that a queue of many small
#: messages is bounded honestly too.
MESSAGE_OVERHEAD_BYTES = 384
#: Events that a newer one of the same generation makes worthless.
COALESCED = frozenset({"progress"})
#: PUBACK reason codes from here on refuse the message (MQTT 5 §2.4).
_REFUSED = 0x80

#: `on_puback(reason_code)`: the broker answered one status message.
PubackCallback = Callable[[int], None]


class StatusLink(Protocol):
    """Where status messages go: the delivery client."""

    def publish_status(self, topic: str, payload: bytes, on_puback: PubackCallback) -> bool:
        """Write one QoS 1 message; False (nothing written) while disconnected. `on_puback` is
        called with the PUBACK's reason code, at most once, and never after the link dropped
        (the publisher learns of that through `link_down`)."""
        ...


@dataclass(slots=True, eq=False)
class _Message:
    seq: int
    event: str
    request_id: str | None
    topic: str
    payload: bytes
    size: int
    #: Coalesced events: a newer message with the same key replaces this one while it waits.
    key: Hashable | None
    #: Link drops while it was unacknowledged.
    blamed: int = 0
    #: Called once the broker took it (PUBACK with a success code).
    on_sent: Callable[[], None] | None = None


class StatusPublisher:
    """Formats status events and publishes them in order, keeping each until the broker has it.

    At most `WINDOW` messages are written and unacknowledged at once; when the link drops they go
    back to the head of the queue and are written again, in order, on the next connection (each
    connection is a fresh MQTT client, so nothing else would resend them). One that was
    unacknowledged when the link dropped goes again only alone, and after `delivery_max_refusals`
    such drops (or a PUBACK refusing it) it is dropped, so one message cannot keep breaking the
    link. A `progress` report replaces the waiting one of its generation; when the queue is full,
    progress reports are dropped first and never push out anything else, then the oldest others.

    Event-loop thread only. `link` is asked for at each send: the delivery client may not
    exist yet (or at all, with `mqtt_url = ""`: then messages wait until the queue is full and
    are counted as dropped from then on). The owner calls `link_up` and `link_down` as the
    delivery client connects and loses the broker.
    """

    def __init__(self, cfg: Config, link: Callable[[], StatusLink | None], clock: Callable[[], int] = now_ms) -> None:
        self._prefix = cfg.status_topic_prefix
        self._max = cfg.status_queue_max
        self._max_bytes = cfg.status_queue_max_bytes
        self._max_blame = cfg.delivery_max_refusals
        self._link = link
        self._clock = clock
        self._seq = 0
        #: Waiting, by sequence number (oldest first): progress reports apart from the rest,
        #: so either kind's oldest is at hand; the next to send is the older of the two heads.
        self._urgent: OrderedDict[int, _Message] = OrderedDict()
        self._progress: OrderedDict[int, _Message] = OrderedDict()
        #: key → sequence number of the waiting coalesced message with that key.
        self._latest: dict[Hashable, int] = {}
        #: Written, not yet PUBACKed, in the order written (all older than anything waiting).
        self._inflight: dict[int, _Message] = {}
        #: Bytes held (waiting and in flight), each message with its overhead.
        self._bytes = 0
        #: Bumped when the link drops: a PUBACK callback of an earlier connection is stale.
        self._epoch = 0
        #: A message blamed for a link drop is in flight: nothing else goes until it is answered.
        self._alone = False
        self._releasing = False
        #: Messages dropped since start (any reason).
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self._prefix)

    def emit(
        self, event: str, request_id: str | None, on_sent: Callable[[], None] | None = None, **fields: Any
    ) -> None:
        """Publish one event about `request_id` (None: a rejection without a usable one).
        Fields that are None are left out. `on_sent` is called once the broker took it (never
        when it is dropped, or the process ends first)."""
        if not self._prefix:
            return
        doc: dict[str, Any] = {"event": event, "request_id": request_id, "ts_ms": self._clock()}
        doc.update((k, v) for k, v in fields.items() if v is not None)
        topic = f"{self._prefix}/{_level(request_id)}"
        # A copy of its exact size: orjson's bytes keep their 4 KiB write buffer (tracemalloc),
        # ten times what a receipt needs, for as long as the message is held.
        payload = bytes(memoryview(orjson.dumps(doc)))
        self._seq += 1
        key = (event, request_id, fields.get("sha1")) if event in COALESCED else None
        size = len(payload) + len(topic) + MESSAGE_OVERHEAD_BYTES
        self._release()  # room first, if the link takes what waits
        self._admit(_Message(self._seq, event, request_id, topic, payload, size, key, on_sent=on_sent))
        self._release()

    def link_up(self) -> None:
        """The link is (back) up: send what waits, in order."""
        self._release()

    def link_down(self) -> None:
        """The link dropped: what it had not acknowledged goes back to the head of the queue,
        blamed once more (dropped when blamed `delivery_max_refusals` times)."""
        self._epoch += 1
        self._alone = False
        inflight, self._inflight = list(self._inflight.values()), {}
        for msg in reversed(inflight):  # newest first, each put in front of the waiting ones
            msg.blamed += 1
            if msg.key is not None and msg.key in self._latest:
                self._bytes -= msg.size  # a newer report of its generation waits: that one goes
                continue
            if msg.blamed >= self._max_blame:
                self._bytes -= msg.size
                self._drop(msg, "link_dropped")
                continue
            queue = self._queue_of(msg)
            queue[msg.seq] = msg
            queue.move_to_end(msg.seq, last=False)
            if msg.key is not None:
                self._latest[msg.key] = msg.seq

    def backlog(self) -> int:
        """Messages not yet acknowledged by the broker (waiting or in flight)."""
        return len(self._urgent) + len(self._progress) + len(self._inflight)

    def backlog_bytes(self) -> int:
        """What those messages hold, overhead included."""
        return self._bytes

    async def drain(self, timeout_s: float) -> int:
        """Wait (at most `timeout_s`) until the broker has every message; returns the backlog
        left. For shutdown: what is still held then is lost with the process."""
        deadline = time.monotonic() + timeout_s
        while self.backlog() and time.monotonic() < deadline:
            self._release()
            await asyncio.sleep(0.01)
        return self.backlog()

    def close(self) -> None:
        """Count what is still held as dropped (the process ends)."""
        held = [*self._inflight.values(), *self._urgent.values(), *self._progress.values()]
        self._inflight.clear()
        self._urgent.clear()
        self._progress.clear()
        self._latest.clear()
        self._bytes = 0
        self._epoch += 1
        for msg in held:
            metrics.STATUS_DROPPED.labels(msg.event, "shutdown").inc()
        self.dropped += len(held)
        if held:
            log.warning("status_unsent_at_stop", messages=len(held), reason="shutdown")

    # -- the queue ---------------------------------------------------------------------------
    def _queue_of(self, msg: _Message) -> OrderedDict[int, _Message]:
        return self._progress if msg.key is not None else self._urgent

    def _admit(self, msg: _Message) -> None:
        """Hold `msg`, making room as the bounds say, or drop it."""
        if msg.size > self._max_bytes:
            self._drop(msg, "too_large")
            return
        if msg.key is not None and (older := self._latest.pop(msg.key, None)) is not None:
            self._bytes -= self._progress.pop(older).size  # replaced: the newer report says more
        while self.backlog() >= self._max or self._bytes + msg.size > self._max_bytes:
            reason = "queue_count" if self.backlog() >= self._max else "queue_bytes"
            if self._progress:
                victim = self._progress.popitem(last=False)[1]
                assert victim.key is not None
                del self._latest[victim.key]
            elif msg.key is None and self._urgent:
                victim = self._urgent.popitem(last=False)[1]
            else:  # only what is in flight, or messages that outrank this progress report
                self._drop(msg, reason)
                return
            self._bytes -= victim.size
            self._drop(victim, reason)
        self._queue_of(msg)[msg.seq] = msg
        if msg.key is not None:
            self._latest[msg.key] = msg.seq
        self._bytes += msg.size

    def _head(self) -> _Message | None:
        urgent = next(iter(self._urgent.values()), None)
        progress = next(iter(self._progress.values()), None)
        if urgent is None or (progress is not None and progress.seq < urgent.seq):
            return progress
        return urgent

    def _release(self) -> None:
        """Write waiting messages in order while the window has room and the link takes them;
        one blamed for a link drop goes alone."""
        if self._releasing:  # a link that answers at once calls back in here
            return
        self._releasing = True
        try:
            while not self._alone and len(self._inflight) < WINDOW:
                msg = self._head()
                if msg is None or (msg.blamed and self._inflight):
                    return
                link = self._link()
                if link is None:
                    return
                self._inflight[msg.seq] = msg
                if not link.publish_status(msg.topic, msg.payload, partial(self._acked, msg, self._epoch)):
                    del self._inflight[msg.seq]
                    return
                queue = self._queue_of(msg)
                if queue.pop(msg.seq, None) is not None and msg.key is not None:
                    del self._latest[msg.key]
                if msg.blamed and msg.seq in self._inflight:
                    self._alone = True
        finally:
            self._releasing = False

    def _acked(self, msg: _Message, epoch: int, reason_code: int) -> None:
        if epoch != self._epoch or self._inflight.pop(msg.seq, None) is None:
            return
        if msg.blamed:
            self._alone = False
        self._bytes -= msg.size
        if reason_code >= _REFUSED:  # e.g. 0x87: the ACL denies the topic; sending again will not help
            self._drop(msg, "refused", topic=msg.topic, reason_code=reason_code)
        else:
            metrics.STATUS_PUBLISHED.inc()
            if msg.on_sent is not None:
                msg.on_sent()
        self._release()

    def _drop(self, msg: _Message, reason: str, **detail: Any) -> None:
        metrics.STATUS_DROPPED.labels(msg.event, reason).inc()
        self.dropped += 1
        # The first, then now and then (a full queue or a denying ACL drops every message); the
        # rare reasons each time.
        if self.dropped % 10_000 == 1 or reason in ("too_large", "link_dropped"):
            log.warning(
                "status_dropped",
                request_id=msg.request_id,
                kind=msg.event,
                reason=reason,
                bytes=len(msg.payload),
                dropped=self.dropped,
                backlog=self.backlog(),
                backlog_bytes=self._bytes,
                **detail,
            )


def answer_fields(payload: bytes, size: int) -> dict[str, Any]:
    """A vehicle's answer as status fields: UTF-8 text as it is, anything else base64; a cut
    answer (longer than max_response_bytes) says so, and a cut inside a character still
    reads as text."""
    cut = size > len(payload)
    for trim in range(4 if cut else 1):
        try:
            text = payload[: len(payload) - trim].decode()
        except UnicodeDecodeError:
            continue
        return {"payload": text, "truncated": True if cut else None}
    return {
        "payload": base64.b64encode(payload).decode("ascii"),
        "payload_encoding": "base64",
        "truncated": True if cut else None,
    }


def _level(request_id: str | None) -> str:
    """The status topic level for events about `request_id`."""
    if request_id is None:
        return REJECTED_LEVEL
    return request_id if is_level(request_id) else UNROUTABLE_LEVEL
