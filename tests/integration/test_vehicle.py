"""testkit/vehicle.py on a real mosquitto: what every test, bench and the demo rely on it for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.emqx_sim import running_mosquitto
from testkit.harness import poll
from testkit.vehicle import Fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_mosquitto(Path(tmp_path_factory.mktemp("vehicle"))) as broker, Fleet(broker.port) as f:
        yield f


def test_a_resumed_session_redelivers_right_behind_the_connack_and_the_vehicle_records_it(fleet: Fleet) -> None:
    """A request held unacknowledged over a drop comes again (DUP) on the resumed session, even when
    it arrives in the same read as the CONNACK, and is PUBACKed then; the next follows."""
    [sender] = fleet.online(["SENDER1"])
    v = fleet.vehicle("RESUME1", auto_ack=False, session_expiry_s=300)
    assert v.connect(clean_start=True) is False
    v.subscribe()
    sender.publish("agent/RESUME1/proxy/request/r1", b"one")
    poll(lambda: v.request_ids() == ["r1"], 10)
    v.drop()
    v.auto_ack = True
    assert v.connect(clean_start=False) is True
    sender.publish("agent/RESUME1/proxy/request/r2", b"two")
    poll(lambda: len(v.acks) == 2, 10)
    assert v.request_ids() == ["r1", "r1", "r2"]
    assert [d.dup for d in v.received] == [False, True, False]
    assert v.max_unacked == 1


def test_held_pubacks_go_out_only_with_ack_held(fleet: Fleet) -> None:
    """With auto_ack off every delivery stays unacknowledged (the broker's window fills) until
    ack_held() PUBACKs them all at once."""
    [sender] = fleet.online(["SENDER2"])
    [v] = fleet.online(["HOLD1"], auto_ack=False)
    for n in range(3):
        sender.publish(f"agent/HOLD1/proxy/request/r{n}", b"x")
    poll(lambda: len(v.received) == 3, 10)
    assert v.acks == [] and v.max_unacked == 3
    assert v.ack_held() == 3
    assert [d.request_id for d, _ in v.acks] == ["r0", "r1", "r2"] and v.unacked == []
