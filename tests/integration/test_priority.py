"""The priority lane, on both stores: a vehicle's high-priority requests (asked per batch, or by
their request's policy, stored before or after it) go before its normal ones whatever their age,
oldest first among equals, one in flight at a time. Real mosquitto, the EMQX-faithful hook driver."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exhook_server import cli
from testkit.harness import StepClock, poll
from tests.integration.test_delivery_e2e import Rig, make_rig
from tests.integration.test_policy_gates import policy


@pytest.fixture(params=["lmdb", "postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every test here runs on both stores."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def rig(tmp_path: Path, make_server: Any) -> Iterator[Rig]:
    yield from make_rig(tmp_path, make_server)


def test_a_high_priority_batch_overtakes_the_queued_normal_ones(rig: Rig) -> None:
    v = rig.emqx.vehicle("VIN1")
    v.auto_ack = False
    v.connect()
    v.subscribe()
    for n in range(3):
        rig.emqx.publish_batch(["VIN1"], f"task_ota_{n}", f"fw{n}")
    v.wait_for(1)  # task_ota_0 is out: one in flight, the other two queued
    rig.emqx.publish_batch(["VIN1"], "task_recall_1", "recall", priority="high")
    assert len(v.received) == 1
    for n in range(2, 5):
        assert v.ack_pending() == 1
        v.wait_for(n)
    assert rig.rids(v) == ["task_ota_0", "task_recall_1", "task_ota_1", "task_ota_2"]


def test_a_policy_gives_and_takes_priority_of_rows_stored_before_it(rig: Rig, capsys: Any) -> None:
    for rid in ("task_a_1", "task_b_1", "task_c_1"):
        rig.emqx.publish_batch(["VIN2"], rid, rid)
    rig.emqx.publish_batch(["VIN2"], "task_r_1", "recall", priority="high")
    policy(rig, "task_b_1", priority="high")
    policy(rig, "task_c_1", priority="high")
    policy(rig, "task_c_1", priority="normal")  # a later policy takes it back
    policy(rig, "task_r_1", priority="normal")  # the batch's own priority stays
    # inspect shows the queue in delivery order with each row's priority (from the server here).
    assert cli.main(["inspect", "VIN2", "--json", "--server", f"127.0.0.1:{rig.srv.server.admin_port}"]) == 0
    shown = json.loads(capsys.readouterr().out)["pending"]
    assert [(p["request_id"], p["priority"]) for p in shown] == [
        ("task_b_1", "high"),
        ("task_r_1", "high"),
        ("task_a_1", "normal"),
        ("task_c_1", "normal"),
    ]
    v = rig.online("VIN2")
    v.wait_for(4)
    # High first, oldest first among them (b was stored before r); then the normal ones by age.
    assert rig.rids(v) == ["task_b_1", "task_r_1", "task_a_1", "task_c_1"]
    poll(lambda: rig.rows() == 0)


def test_the_delivery_budget_starts_at_its_rate_high_priority_first(tmp_path: Path, make_server: Any) -> None:
    """max_deliveries_per_s 1 (one process) on the server's step clock: five vehicles with queued
    rows come online; one starts (the burst), the others wait; each second of the clock one more
    starts, the vehicle whose row is high priority first although it came last."""
    clock = StepClock()
    rigs = make_rig(tmp_path, make_server, clock=clock, max_deliveries_per_s=1.0, processes=1)
    rig = next(rigs)
    try:
        budget = rig.srv.server.budget
        assert budget is not None
        for n in range(1, 5):
            rig.emqx.publish_batch([f"VIN{n}"], "task_ota_1", "fw")
        rig.emqx.publish_batch(["VIN5"], "task_recall_1", "recall", priority="high")
        fleet = [rig.online(f"VIN{n}") for n in range(1, 5)]

        def started() -> int:
            return sum(len(v.received) for v in fleet)

        poll(lambda: budget.waiting() == 3 and started() == 1)
        fleet.append(rig.online("VIN5"))  # the last to come: its row is high priority
        poll(lambda: budget.waiting() == 4)
        assert fleet[4].received == []
        clock.advance(1.0)
        fleet[4].wait_for(1)  # the recall goes first
        poll(lambda: budget.waiting() == 3 and started() == 2)
        clock.advance(1.0)
        poll(lambda: budget.waiting() == 2 and started() == 3)
    finally:
        rigs.close()
