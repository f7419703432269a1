"""End to end: the real server delivers through a real mosquitto to real MQTT 5 vehicles (testkit/vehicle.py),
while testkit/emqx_sim.py calls our hooks as EMQX would."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from exhook_server import events
from exhook_server.acks import rule_body
from exhook_server.config import Config
from testkit.emqx_sim import FakeEmqx, Mosquitto, Vehicle
from testkit.harness import ROOT, InProcessServer, poll


@dataclass
class Rig:
    broker: Mosquitto
    srv: InProcessServer
    emqx: FakeEmqx

    def rows(self) -> int:
        return self.srv.stats().rows

    def rids(self, v: Vehicle) -> list[str]:
        return [r.topic.rsplit("/", 1)[1] for r in v.received]

    def online(self, vin: str, **kwargs: Any) -> Vehicle:
        [v] = self.emqx.online([vin], **kwargs)
        return v


def make_rig(
    tmp_path: Path, make_server: Any, *, broker_cls: type[Mosquitto] = Mosquitto, **overrides: Any
) -> Iterator[Rig]:
    broker = broker_cls(tmp_path).start()
    try:
        srv = make_server(mqtt_url=broker.url, workers=3, **overrides)
        assert srv.server is not None and srv.server.delivery is not None
        delivery = srv.server.delivery
        poll(lambda: delivery.connected)
        emqx = FakeEmqx(srv.port, broker.port, delivery_clientid=delivery.clientid)
        if srv.cfg.events_over_mqtt:
            provision_events(emqx, broker, srv.cfg, delivery.clientid)
        emqx.load()
        try:
            yield Rig(broker, srv, emqx)
        finally:
            emqx.close()
    finally:
        broker.stop()


def provision_events(emqx: FakeEmqx, broker: Mosquitto, cfg: Config, delivery_clientid: str) -> None:
    """What `emqx sync` does for vehicle events over MQTT, on the simulator: the ack rule; then
    wait until the server's events member and its delivery client's ack topic are subscribed."""
    emqx.add_rule(rule_body(cfg))
    wanted = [f for f, _ in events.subscriptions(cfg)] + [f"{cfg.rule_ack_topic_prefix}/{delivery_clientid}"]
    poll(lambda: all(f" {f}" in broker.log() for f in wanted))


@pytest.fixture
def store_kind(each_store: str) -> str:
    """Every test here runs on both stores."""
    return each_store


@pytest.fixture
def event_mode(each_event_mode: str) -> str:
    """The tests here run with vehicle events as hook calls and over MQTT, but for `hooks_only` ones."""
    return each_event_mode


#: A test that no heartbeat or PUBACK decides runs in the hook mode only: over MQTT it would repeat
#: what the hook mode tests.
hooks_only = pytest.mark.parametrize("each_event_mode", ["hooks"])


@pytest.fixture
def rig(tmp_path: Path, make_server: Any) -> Iterator[Rig]:
    yield from make_rig(tmp_path, make_server)


def test_batch_reaches_online_vehicle_and_ack_deletes_row(rig: Rig) -> None:
    """A batch for a subscribed vehicle is delivered on its topic; the PUBACK deletes the row."""
    v = rig.online("VIN1")
    rig.emqx.publish_batch(["VIN1", "VIN2"], "task_ota_1", b"\x01firmware")
    [got] = v.wait_for(1)
    assert (got.topic, got.payload) == ("agent/VIN1/proxy/request/task_ota_1", b"\x01firmware")
    poll(lambda: rig.srv.pending("VIN1") == [])
    assert [r.request_id for r in rig.srv.pending("VIN2")] == ["task_ota_1"]


@hooks_only
def test_late_subscriber_gets_its_queue_oldest_first(rig: Rig) -> None:
    """Nothing goes to an offline vehicle; when it subscribes, its queue drains oldest first."""
    for rid in ("task_b_1", "task_a_1", "task_c_1"):
        rig.emqx.publish_batch(["VIN1"], rid, rid)
    assert rig.rows() == 3
    v = rig.online("VIN1")
    v.wait_for(3)
    assert rig.rids(v) == ["task_b_1", "task_a_1", "task_c_1"]
    poll(lambda: rig.rows() == 0)


def test_one_in_flight_until_acked(rig: Rig) -> None:
    """With acks held back, the vehicle sees exactly one request; each ack releases the next."""
    v = rig.emqx.vehicle("VIN1")
    v.auto_ack = False
    v.connect()
    v.subscribe()
    for n in range(3):
        rig.emqx.publish_batch(["VIN1"], f"task_a_{n}", f"d{n}")
    v.wait_for(1)
    v.heartbeat()
    rig.emqx.publish_batch(["VIN1"], "task_a_9", "more")
    assert len(v.received) == 1
    for n in range(2, 5):
        assert v.ack_pending() == 1
        v.wait_for(n)
    assert rig.rids(v) == ["task_a_0", "task_a_1", "task_a_2", "task_a_9"]


def test_heartbeat_repairs_missed_subscription(rig: Rig) -> None:
    """A vehicle whose subscribe we never saw gets its requests on its next heartbeat."""
    rig.emqx.hooks = None  # like a provider not loaded yet: EMQX calls no hook
    v = rig.online("VIN1")
    rig.emqx.load()
    rig.emqx.publish_batch(["VIN1"], "task_a_1", "x")
    assert rig.srv.stats().rows == 1 and v.received == []
    v.heartbeat()
    v.wait_for(1)
    assert rig.rids(v) == ["task_a_1"]


def test_resume_is_redelivered_by_the_broker_not_resent(rig: Rig) -> None:
    """A persistent session that drops before its PUBACK gets the request once more (from the
    broker session), not a second copy from us, then the next request."""
    v = rig.emqx.vehicle("VIN1", session_expiry_s=300)
    v.auto_ack = False
    v.connect()
    v.subscribe()
    rig.emqx.publish_batch(["VIN1"], "task_a_1", "first")
    rig.emqx.publish_batch(["VIN1"], "task_a_2", "second")
    v.wait_for(1)
    v.crash_before_ack()
    v.auto_ack = True
    v.reconnect(clean_start=False)
    v.wait_for(3)
    assert rig.rids(v) == ["task_a_1", "task_a_1", "task_a_2"]
    poll(lambda: rig.rows() == 0)
    assert len(v.received) == 3


def test_clean_reconnect_gets_the_unacked_request_again(rig: Rig) -> None:
    """A vehicle that drops before acking and comes back clean gets the request resent."""
    v = rig.emqx.vehicle("VIN1")
    v.auto_ack = False
    v.connect()
    v.subscribe()
    rig.emqx.publish_batch(["VIN1"], "task_a_1", "x")
    v.wait_for(1)
    v.crash_before_ack()
    v.auto_ack = True
    v.reconnect(clean_start=True)
    v.subscribe()
    v.wait_for(2)
    poll(lambda: rig.rows() == 0)


def test_batch_replacing_inflight_request_is_delivered_again(rig: Rig) -> None:
    """A newer batch for the request in flight: the old ack keeps the new row, which is then sent."""
    v = rig.emqx.vehicle("VIN1")
    v.auto_ack = False
    v.connect()
    v.subscribe()
    rig.emqx.publish_batch(["VIN1"], "task_cfg_1", "v1")
    v.wait_for(1)
    rig.emqx.publish_batch(["VIN1"], "task_cfg_1", "v2")
    v.ack_pending()
    v.wait_for(2)
    assert [r.payload for r in v.received] == [b"v1", b"v2"]
    v.ack_pending()
    poll(lambda: rig.rows() == 0)


@hooks_only
def test_nothing_is_published_on_another_vins_topic(rig: Rig) -> None:
    """Many vehicles, many batches: each vehicle receives only its own topic and its own rows."""
    vehicles = {f"VIN{n}": rig.online(f"VIN{n}") for n in range(10)}
    for n in range(5):
        rig.emqx.publish_batch([f"VIN{k}" for k in range(n, 10)], f"task_a_{n}", f"payload {n}")
    for n, (vin, v) in enumerate(vehicles.items()):
        got = v.wait_for(min(n + 1, 5))
        assert all(r.topic.startswith(f"agent/{vin}/proxy/request/") for r in got)
    poll(lambda: rig.rows() == 0)


def test_broker_restart_mid_fanout_delivers_every_row(rig: Rig) -> None:
    """The broker restarts while deliveries flow; after vehicles reconnect, every row is delivered."""
    vehicles = [rig.online(f"VIN{n}") for n in range(15)]
    for n in range(4):
        rig.emqx.publish_batch([v.vin for v in vehicles], f"task_a_{n}", f"d{n}")
    vehicles[0].wait_for(1)
    rig.emqx.restart_broker(rig.broker)
    delivery = rig.srv.server.delivery  # type: ignore[union-attr]
    poll(lambda: delivery.connected, timeout_s=30)
    for v in vehicles:
        v.reconnect(clean_start=True)
        v.subscribe()
    poll(lambda: rig.rows() == 0, timeout_s=60)
    for v in vehicles:
        assert set(rig.rids(v)) == {f"task_a_{n}" for n in range(4)}


@hooks_only
def test_delivery_stats_in_metrics(rig: Rig) -> None:
    """Deliveries and acks are counted."""
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("sdv_fanout_deliveries_acked_total", {"result": "deleted"}) or 0
    v = rig.online("VIN1")
    rig.emqx.publish_batch(["VIN1"], "task_a_1", "x")
    v.wait_for(1)
    poll(
        lambda: (
            (REGISTRY.get_sample_value("sdv_fanout_deliveries_acked_total", {"result": "deleted"}) or 0) == before + 1
        )
    )


@pytest.mark.slow
# LMDB only: the fleet at scale on PostgreSQL is tests/integration/test_multi_instance.py's (several
# instances), and this one alone would add a minute to CI.
@pytest.mark.parametrize("store_kind", ["lmdb"])
@hooks_only
def test_thousand_vehicles_twenty_batches_all_delivered(rig: Rig) -> None:
    """1,000 vehicles x 20 batches over mosquitto: every request delivered and acked, no row left."""
    vins = [f"WVW{n:014d}" for n in range(1000)]
    delivery = rig.srv.server.delivery  # type: ignore[union-attr]
    assert delivery is not None
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testkit.fleet",
                "--exhook-port",
                str(rig.srv.port),
                "--mqtt-port",
                str(rig.broker.port),
                "--delivery-clientid",
                delivery.clientid,
                "--vins",
                ",".join(vins[k::4]),
                "--expect",
                "20",
                "--deadline-s",
                "240",
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for k in range(4)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline())["ready"] == 250
        for n in range(20):
            rig.emqx.publish_batch(vins[n * 50 :] + vins[: n * 50], f"task_t{n % 4}_{n}", f"batch {n}")
        received: dict[str, list[str]] = {}
        for proc in procs:
            assert proc.stdout is not None
            received.update(json.loads(proc.stdout.readline())["done"])
            assert proc.wait(60) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    assert len(received) == 1000
    assert all(len(set(topics)) == 20 for topics in received.values())
    poll(lambda: rig.rows() == 0, timeout_s=60)
