"""The status topic: what the server tells the platform about its requests.

Every message about request R is one JSON object published QoS 1 by the delivery client
to `<status_topic_prefix>/<R>` (a rejection without a usable request id goes to
`<status_topic_prefix>/_rejected`, and one about an id no topic may hold to
`<status_topic_prefix>/_unroutable`); each carries `event`, `request_id`, `ts_ms`, and the
batch's `correlation_id` when it had one. While the broker link is down, messages wait in
a bounded queue, oldest dropped first (counted): the topic is how the platform hears first,
the Admin queries are the truth it can always ask for.
"""

from __future__ import annotations

import base64
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import orjson
import structlog

from exhook_server import metrics
from exhook_server.config import Config
from exhook_server.topics import is_level
from storage.store import now_ms

log = structlog.get_logger("sdv_fanout.status")

REJECTED_LEVEL = "_rejected"
#: Events about a request id that cannot be a topic level (only rows stored past ingest
#: validation, by an older release, can have one): a broker would drop our link for its topic.
UNROUTABLE_LEVEL = "_unroutable"


class StatusLink(Protocol):
    """Where status messages go: the delivery client."""

    def publish_status(self, topic: str, payload: bytes) -> bool:
        """Queue one QoS 1 message; False (nothing queued) while disconnected."""
        ...


class StatusPublisher:
    """Formats status events and publishes them in order, holding them while the link is down.

    Event-loop thread only. `link` is asked for at each send: the delivery client may not
    exist yet (or at all, with `mqtt_url = ""`: then messages are only counted as dropped
    once the queue is full).
    """

    def __init__(self, cfg: Config, link: Callable[[], StatusLink | None], clock: Callable[[], int] = now_ms) -> None:
        self._prefix = cfg.status_topic_prefix
        self._max = cfg.status_queue_max
        self._link = link
        self._clock = clock
        self._queue: deque[tuple[str, bytes]] = deque()
        #: Messages dropped since start (the queue was full).
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self._prefix)

    def emit(self, event: str, request_id: str | None, **fields: Any) -> None:
        """Publish one event about `request_id` (None: a rejection without a usable one).
        Fields that are None are left out."""
        if not self._prefix:
            return
        doc: dict[str, Any] = {"event": event, "request_id": request_id, "ts_ms": self._clock()}
        doc.update((k, v) for k, v in fields.items() if v is not None)
        topic = f"{self._prefix}/{_level(request_id)}"
        payload = orjson.dumps(doc)
        # Behind a backlog, wait in line: the platform reads a request's events in order.
        if self._queue:
            self.flush()
        if self._queue or not self._send(topic, payload):
            self._hold(topic, payload)

    def flush(self) -> None:
        """Send what waited, in order, until the link refuses again (call when it is back)."""
        queue = self._queue
        while queue:
            topic, payload = queue[0]
            if not self._send(topic, payload):
                return
            queue.popleft()

    def backlog(self) -> int:
        return len(self._queue)

    def _send(self, topic: str, payload: bytes) -> bool:
        link = self._link()
        if link is None or not link.publish_status(topic, payload):
            return False
        metrics.STATUS_PUBLISHED.inc()
        return True

    def _hold(self, topic: str, payload: bytes) -> None:
        if len(self._queue) >= self._max:
            self._queue.popleft()
            metrics.STATUS_DROPPED.inc()
            self.dropped += 1
            if self.dropped % 10_000 == 1:  # the first, then a reminder now and then
                log.warning("status_dropped", dropped=self.dropped, reason="status_queue_max reached, link down")
        self._queue.append((topic, payload))


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
