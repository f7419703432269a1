"""Campaign pacing in the delivery path: never more than max_in_flight of a request out, a freed
slot goes to a waiting vehicle, and max_per_minute starts on the server's injected clock; the
vehicles' other requests go meanwhile. Real mosquitto, the EMQX-faithful hook driver."""

from __future__ import annotations

import json

import pytest

from exhook_server import cli
from testkit.emqx_sim import Vehicle
from testkit.harness import StepClock, poll
from tests.integration import test_policy_gates as gates
from tests.integration.test_delivery_e2e import Rig

#: The gates' rig: both stores, the server on a stepped clock, policies re-read every 0.2 s.
store_kind, clock, rig, policy = gates.store_kind, gates.clock, gates.rig, gates.policy
VINS = [f"VIN{n}" for n in range(6)]


def holding(fleet: list[Vehicle], rid: str) -> int:
    return sum(1 for v in fleet for r in v.received if r.topic.endswith("/" + rid))


def test_never_more_than_max_in_flight_out_and_a_freed_slot_goes_to_a_waiting_vehicle(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cap 2 over 6 vehicles holding their PUBACKs: 2 get the campaign, the others their next
    request (`request R` shows 2 in flight, 2 started); each PUBACK of it lets one more vehicle
    have it, never 3 out at once."""
    policy(rig, "task_cap_1", max_in_flight=2)
    cars = rig.emqx.online(VINS, auto_ack=False)
    rig.emqx.publish_batch(VINS, "task_cap_1", b"fw")
    poll(lambda: holding(cars, "task_cap_1") == 2)
    rig.emqx.publish_batch(VINS, "task_free_1", b"cfg")  # not capped: goes to the 4 with nothing out
    poll(lambda: sum(len(v.received) for v in cars) == 2 + 4)
    assert holding(cars, "task_cap_1") == 2
    assert rig.srv.server is not None
    assert cli.main(["request", "task_cap_1", "--json", "--server", f"127.0.0.1:{rig.srv.server.admin_port}"]) == 0
    shown = json.loads(capsys.readouterr().out)["pacing"]
    assert shown["in_flight"] == 2 and shown["started_last_minute"] == 2
    while holding(cars, "task_cap_1") < len(VINS):
        before = holding(cars, "task_cap_1")
        for v in cars:  # every delivery out is PUBACKed: one slot of the cap frees at least
            v.ack_pending()
        poll(lambda b=before: holding(cars, "task_cap_1") > b)  # type: ignore[misc]
        assert holding(cars, "task_cap_1") <= before + 2
    assert [rig.rids(v).count("task_cap_1") for v in cars] == [1] * len(VINS)


def test_max_per_minute_starts_the_rate_on_the_servers_clock(rig: Rig, clock: StepClock) -> None:
    """60 per minute: one at once, then one per second of the server's clock, to idle vehicles."""
    policy(rig, "task_rate_1", max_per_minute=60)
    cars = rig.emqx.online(VINS, auto_ack=True)
    rig.emqx.publish_batch(VINS, "task_rate_1", b"fw")
    poll(lambda: holding(cars, "task_rate_1") == 1)
    clock.advance(2)
    poll(lambda: holding(cars, "task_rate_1") == 3)
    clock.advance(60)  # a burst of at most 5 s of the rate, then one a second again
    poll(lambda: holding(cars, "task_rate_1") == 6)
