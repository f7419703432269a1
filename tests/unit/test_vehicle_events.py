"""Vehicle events over MQTT (vehicle_events): the setting, the hook list it gives, the events
member's parsing, and the dispatch rules for events whose connection is unknown."""

from __future__ import annotations

import pytest

from exhook_server.config import DEFAULT_ACK_TOPIC_PREFIX, Config
from exhook_server.dispatch.commands import Acknowledge, Down, EndReason, MaybeSend, Responded, Session, Trigger
from exhook_server.dispatch.worker import Worker
from exhook_server.errors import ConfigError
from exhook_server.events import VehicleEvents, subscriptions
from exhook_server.hooks import hook_specs, vehicle_event_filters
from tests.dispatch_fakes import ManualClock, MemoryRows, RecordingPublisher, sha1

API = "http://emqx:18083"
S1 = Session("emqx@n1", "VIN1", "10.0.0.1", 40001)
#: A heartbeat or answer over MQTT: the VIN's client, connection unknown.
OVER_MQTT = Session("", "VIN1", "")


def test_auto_is_mqtt_exactly_when_the_emqx_api_and_a_broker_are_configured() -> None:
    assert Config(emqx_api_url=API).events_over_mqtt
    assert not Config().events_over_mqtt
    assert not Config(emqx_api_url=API, mqtt_url="").events_over_mqtt
    assert not Config(emqx_api_url=API, vehicle_events="hooks").events_over_mqtt
    assert Config(vehicle_events="mqtt").events_over_mqtt
    with pytest.raises(ConfigError, match="vehicle_events = mqtt needs mqtt_url"):
        Config(vehicle_events="mqtt", mqtt_url="")
    with pytest.raises(ConfigError, match="vehicle_events must be"):
        Config(vehicle_events="grpc")
    with pytest.raises(ConfigError, match="events_share_group"):
        Config(events_share_group="a/b")


def test_over_mqtt_the_hooks_keep_batches_and_lifecycle_and_acks_take_the_rule() -> None:
    hooks = dict(hook_specs(Config(emqx_api_url=API)))
    assert "message.acked" not in hooks
    heartbeats, answers = vehicle_event_filters(Config())
    pure_publish = dict(hook_specs(Config()))["message.publish"]
    assert hooks["message.publish"] == [t for t in pure_publish if t not in heartbeats + answers]
    assert heartbeats and answers and len(hooks["message.publish"]) == len(pure_publish) - 3
    assert Config(emqx_api_url=API).rule_ack_topic_prefix == DEFAULT_ACK_TOPIC_PREFIX
    assert Config(emqx_api_url=API, ack_topic_prefix="x/acks").rule_ack_topic_prefix == "x/acks"
    pure = dict(hook_specs(Config(emqx_api_url=API, vehicle_events="hooks")))
    assert "message.acked" in pure and "ecp/+/heartbeat" in pure["message.publish"]
    assert Config(emqx_api_url=API, vehicle_events="hooks").rule_ack_topic_prefix == ""


def test_the_member_subscribes_heartbeats_at_qos0_and_answers_at_qos1() -> None:
    assert subscriptions(Config(events_share_group="g")) == [
        ("$share/g/ecp/+/online", 0),
        ("$share/g/ecp/+/heartbeat", 0),
        ("$share/g/agent/+/proxy/response/+", 1),
    ]


class Recorder:
    """What VehicleEvents hands to dispatch."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def heartbeat(self, session: Session, vin: str) -> None:
        self.calls.append(("heartbeat", session, vin))

    def responded(self, session: Session, vin: str, request_id: str, payload: bytes, size: int) -> None:
        self.calls.append(("responded", session, vin, request_id, payload, size))


def test_an_event_is_the_vin_of_its_topic_and_anything_else_is_counted_only() -> None:
    rec = Recorder()
    events = VehicleEvents(Config(vehicle_events="mqtt", max_response_bytes=2), rec)  # type: ignore[arg-type]
    events.handle("ecp/VIN1/heartbeat", b"{}")
    events.handle("agent/VIN1/proxy/response/task_a_1", b"done")
    events.handle("agent/VIN1/proxy/request/task_a_1", b"x")
    events.handle("ecp/VIN1/elsewhere", b"")
    assert rec.calls == [
        ("heartbeat", OVER_MQTT, "VIN1"),
        ("responded", OVER_MQTT, "VIN1", "task_a_1", b"do", 4),
    ]


class Rig:
    def __init__(self) -> None:
        self.rows = MemoryRows()
        self.pub = RecordingPublisher()
        self.worker = Worker("w0", self.rows, self.pub, inflight_timeout_s=60, clock=ManualClock())

    def do(self, *cmds: object) -> None:
        for cmd in cmds:
            self.worker.handle(cmd)  # type: ignore[arg-type]


def test_a_heartbeat_over_mqtt_keeps_the_precise_session_and_sends_nothing_twice() -> None:
    rig = Rig()
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1), MaybeSend(Trigger.HEARTBEAT, "VIN1", OVER_MQTT))
    assert rig.worker.presence["VIN1"] == S1
    assert [rid for _, rid, _ in rig.pub.sent] == ["task_a_1"]


def test_the_disconnect_ends_presence_learnt_from_a_heartbeat_over_mqtt() -> None:
    rig = Rig()
    rig.do(MaybeSend(Trigger.HEARTBEAT, "VIN1", OVER_MQTT), Down("VIN1", S1, EndReason.OFFLINE))
    assert "VIN1" not in rig.worker.presence


def test_an_answer_that_overtakes_its_puback_ends_the_row_and_the_late_puback_nothing() -> None:
    rig = Rig()
    rig.rows.add("VIN1", "task_a_1", b"x", await_response=True)
    rig.rows.add("VIN1", "task_a_2", b"y", await_response=True)
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.do(Responded("VIN1", OVER_MQTT, "task_a_1", b"ok", 2))
    assert [rid for _, rid, _ in rig.pub.sent] == ["task_a_1", "task_a_2"]
    rig.do(Acknowledge("VIN1", S1, "task_a_1", sha1(b"x")))
    assert rig.worker.inflight["VIN1"].request_id == "task_a_2"
    assert [rid for _, rid, _ in rig.pub.sent] == ["task_a_1", "task_a_2"]
