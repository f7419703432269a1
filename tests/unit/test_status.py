"""Status messages keep their order, are kept until the broker acknowledges them, wait in a queue
bounded in count and bytes where progress reports give way to everything else, and every drop is
counted; progress reports each change of a generation once, completed once."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY

from exhook_server.config import Config
from exhook_server.progress import ProgressReporter
from exhook_server.status import WINDOW, StatusPublisher
from storage.lmdb.outcomes import Generation


class Link:
    """A delivery client stand-in: up or down, recording what it took. With `auto_ack` the broker
    answers at once (inside publish_status), else the test answers through `ack`."""

    def __init__(self, auto_ack: bool = True) -> None:
        self.up = True
        self.auto_ack = auto_ack
        self.sent: list[tuple[str, dict[str, Any]]] = []
        #: Written and not yet answered, oldest first.
        self.unacked: list[tuple[dict[str, Any], Callable[[int], None]]] = []

    def publish_status(self, topic: str, payload: bytes, on_puback: Callable[[int], None]) -> bool:
        if not self.up:
            return False
        self.sent.append((topic, json.loads(payload)))
        if self.auto_ack:
            on_puback(0)
        else:
            self.unacked.append((json.loads(payload), on_puback))
        return True

    def ack(self, n: int = 1, reason_code: int = 0) -> None:
        for _ in range(n):
            _, done = self.unacked.pop(0)
            done(reason_code)

    def drop(self, status: StatusPublisher) -> None:
        """The connection is lost: nothing it carried is answered any more."""
        self.up = False
        self.unacked.clear()
        status.link_down()

    def ids(self) -> list[Any]:
        return [doc["request_id"] for _, doc in self.sent]


def publisher(link: Link, **cfg: Any) -> StatusPublisher:
    return StatusPublisher(Config(**cfg), lambda: link, clock=lambda: 7)


def dropped(kind: str, reason: str) -> float:
    return REGISTRY.get_sample_value("sdv_fanout_status_dropped_total", {"kind": kind, "reason": reason}) or 0.0


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
    """Down: held, at most status_queue_max, oldest dropped (counted); back up: sent in order, new ones behind them."""
    link = Link()
    status = publisher(link, status_queue_max=3)
    before = dropped("accepted", "queue_count")
    link.up = False
    for n in range(5):
        status.emit("accepted", f"task_{n}")
    assert status.backlog() == 3 and status.dropped == 2
    assert dropped("accepted", "queue_count") - before == 2
    link.up = True
    status.emit("accepted", "task_5")  # behind the backlog, not before it
    assert link.ids() == ["task_2", "task_3", "task_4", "task_5"]
    assert status.backlog() == 0 and status.backlog_bytes() == 0


def test_a_message_is_kept_until_the_broker_acks_it_and_written_again_after_a_drop() -> None:
    """At most WINDOW unacknowledged; a link drop puts them back in front of the waiting ones, and the
    next connection writes them again in order, the ones it blamed one at a time."""
    link = Link(auto_ack=False)
    status = publisher(link)
    for n in range(WINDOW + 8):
        status.emit("accepted", f"task_{n}")
    assert len(link.sent) == WINDOW and status.backlog() == WINDOW + 8
    link.ack(2)
    assert len(link.sent) == WINDOW + 2 and status.backlog() == WINDOW + 6
    link.drop(status)
    status.emit("accepted", "task_late")
    link.sent.clear()
    link.up = True
    status.link_up()
    # The blamed ones go alone: each waits for the one before it to be answered.
    for n in range(2, WINDOW + 2):
        assert link.ids() == [f"task_{n}"], n
        link.sent.clear()
        link.ack()
    assert link.ids() == [*(f"task_{n}" for n in range(WINDOW + 2, WINDOW + 8)), "task_late"]
    link.ack(7)
    assert status.backlog() == 0 and status.dropped == 0


def test_a_message_that_keeps_breaking_the_link_is_dropped_and_counted() -> None:
    """Unacknowledged at delivery_max_refusals link drops: dropped (link_dropped); the innocent
    ones written with it the first time still arrive."""
    link = Link(auto_ack=False)
    status = publisher(link, delivery_max_refusals=3)
    before = dropped("accepted", "link_dropped")
    for n in range(3):
        status.emit("accepted", f"task_{n}")
    link.drop(status)  # all three blamed once
    link.up = True
    status.link_up()
    assert link.ids()[-1] == "task_0"  # alone
    link.ack()
    link.drop(status)  # task_1 blamed twice
    link.up = True
    link.sent.clear()
    status.link_up()
    assert link.ids() == ["task_1"]
    link.drop(status)  # three times: dropped
    link.up = True
    link.sent.clear()
    status.link_up()
    assert link.ids() == ["task_2"] and dropped("accepted", "link_dropped") - before == 1
    link.ack()
    assert status.backlog() == 0


def test_a_refused_message_is_dropped_and_counted() -> None:
    """A PUBACK reason >= 0x80 (e.g. not authorized): nothing to retry, counted `refused`; 0x10 (no
    matching subscribers, EMQX's answer while the platform is away) is a success."""
    link = Link(auto_ack=False)
    status = publisher(link)
    before = dropped("cancelled", "refused")
    published = REGISTRY.get_sample_value("sdv_fanout_status_published_total") or 0.0
    status.emit("cancelled", "task_1")
    status.emit("cancelled", "task_2")
    link.ack(reason_code=0x87)
    link.ack(reason_code=0x10)
    assert status.backlog() == 0 and dropped("cancelled", "refused") - before == 1
    assert (REGISTRY.get_sample_value("sdv_fanout_status_published_total") or 0.0) - published == 1


def refused(n: int) -> list[dict[str, str]]:
    return [{"vin": f"VIN{i:014d}", "reason": "vehicle_backlog_full"} for i in range(n)]


def test_a_queue_of_oversized_receipts_is_bounded_in_bytes() -> None:
    """Receipts of ~100 KB (2,000 refused VINs) while the link is down: the queue holds what fits in
    status_queue_max_bytes, the oldest dropped (queue_bytes); one larger than the bound alone is
    dropped at once (too_large); back up, the newest arrive in order."""
    link = Link()
    bound = 1 << 20
    status = publisher(link, status_queue_max_bytes=bound)
    before, before_large = dropped("accepted", "queue_bytes"), dropped("rejected", "too_large")
    link.up = False
    for n in range(30):
        status.emit("accepted", f"task_{n}", refused=refused(2_000))
        assert status.backlog_bytes() <= bound
    kept = status.backlog()
    assert 5 <= kept < 30 and dropped("accepted", "queue_bytes") - before == 30 - kept
    status.emit("rejected", "task_huge", detail="x" * (bound + 1))
    assert status.backlog() == kept and dropped("rejected", "too_large") - before_large == 1
    link.up = True
    status.link_up()
    assert link.ids() == [f"task_{n}" for n in range(30 - kept, 30)]
    assert status.backlog_bytes() == 0


def test_progress_reports_coalesce_and_never_push_out_a_receipt() -> None:
    """Link down: a generation's progress reports replace each other (the latest waits, in its
    place behind what came before it); a full queue drops progress reports before any receipt,
    and a progress report that does not fit is dropped itself."""
    link = Link()
    status = publisher(link, status_queue_max=6)
    before = dropped("progress", "queue_count")
    link.up = False
    status.emit("accepted", "task_a")
    for n in range(100):
        status.emit("progress", "task_a", sha1="aa", counts={"delivered": n})
        status.emit("progress", "task_b", sha1="bb", counts={"delivered": n})
    status.emit("cancelled", "task_c")
    assert status.backlog() == 4 and status.dropped == 0  # replaced, not dropped
    for n in range(3):
        status.emit("accepted", f"task_r{n}")  # the 5th and 6th fit; the 7th pushes out progress
    assert status.backlog() == 6 and dropped("progress", "queue_count") - before == 1
    status.emit("progress", "task_a", sha1="aa", counts={"delivered": 999})  # pushes out the older task_b one
    status.emit("accepted", "task_r3")  # pushes out that one
    assert dropped("progress", "queue_count") - before == 3
    status.emit("progress", "task_b", sha1="bb", counts={"delivered": 999})  # only receipts left: dropped itself
    assert dropped("progress", "queue_count") - before == 4 and status.backlog() == 6
    link.up = True
    status.link_up()
    assert [(doc["event"], doc["request_id"]) for _, doc in link.sent] == [
        ("accepted", "task_a"),
        ("cancelled", "task_c"),
        *(("accepted", f"task_r{n}") for n in range(4)),
    ]


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
