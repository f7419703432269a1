"""Campaign gates in the delivery path, on both stores: a request held by its policy (paused, before
start_at) is not sent, the vehicle's next request goes instead, and the held one goes when its gate
opens (resume, or start_at reached on the server's injected clock). Real mosquitto, the
EMQX-faithful hook driver, vehicles auto-acking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from testkit.harness import StepClock, poll
from tests.integration.test_delivery_e2e import Rig, make_rig

TOPIC = "$SDV-FANOUT/policy"


@pytest.fixture(params=["lmdb", "postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every test here runs on both stores."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
def rig(tmp_path: Path, make_server: Any, clock: StepClock) -> Iterator[Rig]:
    yield from make_rig(tmp_path, make_server, clock=clock, policy_refresh_s=0.2)


def policy(rig: Rig, request_id: str, **fields: Any) -> None:
    reply = rig.emqx.publish(TOPIC, json.dumps({"request_id": request_id, **fields}).encode())
    assert reply is not None and reply.message.headers["allow_publish"] == "false"


def pending(rig: Rig, vin: str) -> list[str]:
    return [r.request_id for r in rig.srv.pending(vin)]


def test_a_held_request_waits_while_the_next_goes_and_goes_when_its_gate_opens(rig: Rig, clock: StepClock) -> None:
    policy(rig, "task_held_1", paused=True)  # before any batch of it
    policy(rig, "task_later_1", start_at=clock.ms + 60_000)
    v = rig.online("VIN1")
    for rid in ("task_held_1", "task_later_1", "task_free_1"):
        rig.emqx.publish_batch(["VIN1"], rid, rid.encode())
    [got] = v.wait_for(1)
    assert got.topic.endswith("/task_free_1")  # the two older ones are held: the next goes
    poll(lambda: pending(rig, "VIN1") == ["task_held_1", "task_later_1"])
    assert rig.rids(v) == ["task_free_1"]
    policy(rig, "task_held_1")  # cleared: resumed
    v.wait_for(2)
    poll(lambda: pending(rig, "VIN1") == ["task_later_1"])
    assert rig.rids(v) == ["task_free_1", "task_held_1"]
    clock.advance(61)  # past start_at: the gate opens at the next re-check
    v.wait_for(3)
    poll(lambda: pending(rig, "VIN1") == [])
    assert rig.rids(v) == ["task_free_1", "task_held_1", "task_later_1"]


def test_pausing_holds_what_is_not_sent_yet_and_resuming_sends_it(rig: Rig) -> None:
    v = rig.online("VIN2")
    policy(rig, "task_ota_9", paused=True)
    rig.emqx.publish_batch(["VIN2", "VIN3"], "task_ota_9", b"fw")
    rig.emqx.publish_batch(["VIN2"], "task_cfg_9", b"cfg")
    [got] = v.wait_for(1)
    assert got.topic.endswith("/task_cfg_9")
    poll(lambda: pending(rig, "VIN2") == ["task_ota_9"])
    assert REGISTRY.get_sample_value("sdv_fanout_campaigns_held") == 1
    policy(rig, "task_ota_9", paused=False, priority="high")  # a policy that holds nothing
    v.wait_for(2)
    assert rig.rids(v) == ["task_cfg_9", "task_ota_9"]
    assert REGISTRY.get_sample_value("sdv_fanout_campaigns_held") == 0
    w = rig.online("VIN3")  # comes online after the resume: its row was never held from it
    [got3] = w.wait_for(1)
    assert got3.topic.endswith("/task_ota_9")
