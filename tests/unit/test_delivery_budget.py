"""max_deliveries_per_s on an injected clock: a reconnect storm of vehicles with queued rows
starts at most the budget's rate (its burst once), high priority first, request ids taking turns,
through the real Worker rules over the in-memory row source."""

from __future__ import annotations

import itertools
from collections import Counter

from prometheus_client import REGISTRY

from exhook_server.dispatch.budget import DeliveryBudget
from exhook_server.dispatch.commands import Acknowledge, Down, EndReason, MaybeSend, NewBatch, Session, Trigger
from exhook_server.dispatch.worker import Worker
from tests.dispatch_fakes import ManualClock, MemoryRows, RecordingPublisher, sha1

RATE = 10.0


class Storm:
    """60 vehicles with queued rows: 20 of task_ota_1, 20 of task_cfg_1 (both normal), 20 of
    task_recall_1 (high priority by its policy), stored in that order."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.rows = MemoryRows()
        self.pub = RecordingPublisher()
        self.budget = DeliveryBudget(RATE, self.clock, self._wake)
        high = frozenset({"task_recall_1"})
        self.worker = Worker(
            "w0", self.rows, self.pub, inflight_timeout_s=60, clock=self.clock, high=lambda: high, budget=self.budget
        )
        self.sessions: dict[str, Session] = {}
        for rid in ("task_ota_1", "task_cfg_1", "task_recall_1"):
            for n in range(20):
                self.rows.add(f"{rid[5:8].upper()}{n:02d}", rid, rid.encode())

    def _wake(self, vins: list[str]) -> None:
        self.worker.handle(NewBatch(tuple(vins)))

    def connect_all(self) -> None:
        for n, (vin, _) in enumerate(sorted(self.rows.rows)):
            self.sessions[vin] = Session("emqx@n1", vin, "10.0.0.1", 40000 + n)
            self.worker.handle(MaybeSend(Trigger.SESSION_SUBSCRIBED, vin, self.sessions[vin]))

    def run(self, seconds: float, step: float = 0.02) -> None:
        for _ in range(round(seconds / step)):
            self.clock.now += step
            self.budget.tick()

    def sent(self) -> list[str]:
        return [rid for _, rid, _ in self.pub.sent]


def test_a_reconnect_storm_starts_at_the_budgets_rate_high_priority_first_and_fair() -> None:
    storm = Storm()
    deferred = REGISTRY.get_sample_value("sdv_fanout_deliveries_deferred_total") or 0.0
    storm.connect_all()
    assert len(storm.pub.sent) == RATE  # the burst: one second of the rate, at once
    assert (REGISTRY.get_sample_value("sdv_fanout_deliveries_deferred_total") or 0.0) - deferred == 60 - RATE
    assert storm.budget.waiting() == 50
    # Each further second starts the rate, never more.
    for second in range(1, 6):
        storm.run(1.0)
        assert len(storm.pub.sent) <= RATE * (second + 1)
        assert len(storm.pub.sent) >= RATE * (second + 1) - 1
    # The burst went to whoever connected first (CFG00-09); from then on the 20 high-priority
    # vehicles go before any normal one, then the two normal requests take turns.
    assert storm.sent()[:10] == ["task_cfg_1"] * 10
    after_burst = storm.sent()[10:]
    assert after_burst[:20] == ["task_recall_1"] * 20
    normal = after_burst[20:40]
    assert Counter(normal) == {"task_ota_1": 10, "task_cfg_1": 10}
    assert all(a != b for a, b in itertools.pairwise(normal)), normal


def test_a_vehicle_going_offline_gives_its_place_back_and_acks_start_the_next_within_the_budget() -> None:
    storm = Storm()
    storm.connect_all()
    first = list(storm.pub.sent)
    gone = next(vin for vin in storm.sessions if vin not in {v for v, _, _ in first})
    storm.worker.handle(Down(gone, storm.sessions[gone], EndReason.TERMINATED))
    assert storm.budget.waiting() == 49
    # The vehicles served PUBACK: nothing more is queued for them, the others keep their turn.
    for vin, rid, payload in first:
        storm.worker.handle(Acknowledge(vin, storm.sessions[vin], rid, sha1(payload)))
    assert len(storm.pub.sent) == RATE
    storm.run(5.0)
    assert gone not in {v for v, _, _ in storm.pub.sent}
    assert len(storm.pub.sent) == 59  # every vehicle but the one gone, within 5 s of the rate
