"""Status messages keep their order, wait in a bounded queue while the link is down, and progress
reports each change of a generation once, completed once."""

from __future__ import annotations

import json
from typing import Any

from exhook_server.config import Config
from exhook_server.progress import ProgressReporter
from exhook_server.status import StatusPublisher
from storage.outcomes import Generation


class Link:
    """A delivery client stand-in: up or down, recording what it took."""

    def __init__(self) -> None:
        self.up = True
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def publish_status(self, topic: str, payload: bytes) -> bool:
        if self.up:
            self.sent.append((topic, json.loads(payload)))
        return self.up


def publisher(link: Link, **cfg: Any) -> StatusPublisher:
    return StatusPublisher(Config(**cfg), lambda: link, clock=lambda: 7)


def test_event_fields_and_topics() -> None:
    """An event names itself, its request and time; None fields are left out; no request id goes to _rejected."""
    link = Link()
    status = publisher(link)
    status.emit("accepted", "task_ota_1", sha1="ab", correlation_id=None)
    status.emit("rejected", None, reason="invalid_json")
    assert link.sent == [
        ("$SDV-FANOUT/status/task_ota_1", {"event": "accepted", "request_id": "task_ota_1", "ts_ms": 7, "sha1": "ab"}),
        (
            "$SDV-FANOUT/status/_rejected",
            {"event": "rejected", "request_id": None, "ts_ms": 7, "reason": "invalid_json"},
        ),
    ]


def test_an_id_no_topic_may_hold_goes_to_unroutable() -> None:
    """A request id with a control character never becomes a topic (a broker would drop the link)."""
    link = Link()
    publisher(link).emit("progress", "task_\u0085_1")
    assert [t for t, _ in link.sent] == ["$SDV-FANOUT/status/_unroutable"]


def test_messages_wait_in_order_while_the_link_is_down_and_the_oldest_go_first() -> None:
    """Down: held, at most status_queue_max, oldest dropped; back up: sent in order, new ones behind them."""
    link = Link()
    status = publisher(link, status_queue_max=3)
    link.up = False
    for n in range(5):
        status.emit("accepted", f"task_{n}")
    assert status.backlog() == 3 and status.dropped == 2
    link.up = True
    status.emit("accepted", "task_5")  # behind the backlog, not before it
    assert [doc["request_id"] for _, doc in link.sent] == ["task_2", "task_3", "task_4", "task_5"]
    assert status.backlog() == 0


def test_no_prefix_means_no_status() -> None:
    """status_topic_prefix = "" turns the topic off."""
    link = Link()
    status = publisher(link, status_topic_prefix="")
    status.emit("accepted", "task_1")
    assert not status.enabled and link.sent == []


def gen(rid: str, last: int, pending: int, delivered: int = 0) -> Generation:
    counts = dict.fromkeys(("total", "pending", "delivered", "superseded", "cancelled", "expired", "failed"), 0)
    counts.update(total=pending + delivered, pending=pending, delivered=delivered)
    return Generation(rid, b"\x01" * 20, 1, last, counts)


def test_progress_reports_changes_then_completed_once() -> None:
    """The first look only remembers; a change reports progress; the last pending pair ending reports completed once."""
    link = Link()
    reporter = ProgressReporter(reads=None, status=publisher(link))  # type: ignore[arg-type]
    assert reporter.report([gen("task_1", 10, pending=2)]) == 0
    assert reporter.report([gen("task_1", 10, pending=2)]) == 0
    assert reporter.report([gen("task_1", 11, pending=1, delivered=1)]) == 1
    assert reporter.report([gen("task_1", 12, pending=0, delivered=2)]) == 1
    assert reporter.report([gen("task_1", 12, pending=0, delivered=2)]) == 0
    events = [(doc["event"], doc["counts"]["pending"]) for _, doc in link.sent]
    assert events == [("progress", 1), ("progress", 0), ("completed", 0)]


def test_a_generation_born_and_finished_between_looks_reports_both() -> None:
    """New since the last look and already done: progress and completed."""
    link = Link()
    reporter = ProgressReporter(reads=None, status=publisher(link))  # type: ignore[arg-type]
    reporter.report([])
    reporter.report([gen("task_2", 20, pending=0, delivered=3)])
    assert [doc["event"] for _, doc in link.sent] == ["progress", "completed"]
