"""The EMQX simulation harness (testkit/emqx_sim.py) itself, against a real mosquitto and a recording
HookProvider: the hook orders and fields must be those EMQX sends (docs/exhook-interface.md §6)."""

from __future__ import annotations

import gc
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.emqx_sim import FakeEmqx, Mosquitto, running_mosquitto, topic_matches
from testkit.harness import poll

SERVICE = "emqx.exhook.v3.HookProvider"
ALL_BUT_AUTH: dict[str, list[str]] = {
    name: []
    for name in (
        "client.connect",
        "client.connack",
        "client.connected",
        "client.disconnected",
        "client.subscribe",
        "client.unsubscribe",
        "session.created",
        "session.subscribed",
        "session.unsubscribed",
        "session.resumed",
        "session.discarded",
        "session.takenover",
        "session.terminated",
        "message.publish",
        "message.delivered",
        "message.acked",
        "message.dropped",
    )
}
META = pb.RequestMeta(node="emqx@127.0.0.1", version="5.9.1", sysdescr="EMQX", cluster_name="emqxcl")
REQUEST_TOPIC = "agent/{vin}/proxy/request/task_a_1"


class Recorder:
    """A tiny HookProvider that records (method, request) in arrival order and answers neutrally."""

    def __init__(self, hooks: dict[str, list[str]] | None = None) -> None:
        self.hooks = ALL_BUT_AUTH if hooks is None else hooks
        self.publish_answer: Callable[[pb.MessagePublishRequest], pb.ValuedResponse] | None = None
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(8)
        self.server = grpc.server(self._pool)
        handlers = {}
        for method in pb.DESCRIPTOR.services_by_name["HookProvider"].methods:
            request_cls = getattr(pb, method.input_type.name)
            response_cls = getattr(pb, method.output_type.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self._handler(method.name),
                request_deserializer=request_cls.FromString,
                response_serializer=response_cls.SerializeToString,
            )
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _handler(self, name: str) -> Callable[[Any, grpc.ServicerContext], Any]:
        def handle(request: Any, _context: grpc.ServicerContext) -> Any:
            with self._lock:
                self.calls.append((name, request))
            if name == "OnProviderLoaded":
                return pb.LoadedResponse(hooks=[pb.HookSpec(name=n, topics=t) for n, t in self.hooks.items()])
            if name == "OnMessagePublish" and self.publish_answer is not None:
                return self.publish_answer(request)
            if name in ("OnMessagePublish", "OnClientAuthenticate", "OnClientAuthorize"):
                return pb.ValuedResponse(type=pb.ValuedResponse.IGNORE)
            return pb.EmptySuccess()

        return handle

    def mark(self) -> int:
        """Position to slice later calls from."""
        with self._lock:
            return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, Any]]:
        """Calls recorded after `mark`."""
        with self._lock:
            return list(self.calls[mark:])

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)
        self._pool.shutdown(wait=True)


class Client:
    """A plain paho MQTT 5 client: the server's delivery publisher, or an observer."""

    def __init__(self, port: int, clientid: str) -> None:
        self.received: list[mqtt.MQTTMessage] = []
        self._up = threading.Event()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=clientid, protocol=mqtt.MQTTv5, reconnect_on_failure=False
        )
        self.client.on_connect = lambda *_a: self._up.set()
        self.client.on_subscribe = lambda *_a: self._subscribed.set()
        self.client.on_message = lambda _c, _u, m: self.received.append(m)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        poll(self._up.is_set)

    def publish(self, topic: str, payload: bytes) -> None:
        """QoS 1 publish; returns once mosquitto PUBACKed it."""
        info = self.client.publish(topic, payload, qos=1)
        poll(info.is_published)

    def subscribe(self, topic: str) -> None:
        self.client.subscribe(topic, qos=0)
        poll(self._subscribed.is_set)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def cid(request: Any) -> str:
    """The clientid a hook request is about."""
    for name in ("clientinfo", "conninfo"):
        if name in request.DESCRIPTOR.fields_by_name and request.HasField(name):
            return str(getattr(request, name).clientid)
    return ""


def port_of(request: Any) -> int:
    """The peerport a hook request carries."""
    for name in ("clientinfo", "conninfo"):
        if name in request.DESCRIPTOR.fields_by_name and request.HasField(name):
            return int(getattr(request, name).peerport)
    return 0


def names(calls: list[tuple[str, Any]]) -> list[str]:
    return [m for m, _ in calls]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with running_mosquitto(tmp_path) as b:
        yield b


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.stop()


@pytest.fixture
def emqx(recorder: Recorder, broker: Mosquitto) -> Iterator[FakeEmqx]:
    e = FakeEmqx(recorder.port, broker.port)
    e.load()
    yield e
    e.close()


@pytest.fixture
def publisher(broker: Mosquitto) -> Iterator[Client]:
    p = Client(broker.port, "sdv-fanout-test")
    yield p
    p.close()


def test_connect_and_subscribe_follow_emqx_order(emqx: FakeEmqx, recorder: Recorder, broker: Mosquitto) -> None:
    """Connect then subscribe produce EMQX's hook order with real ports and EMQX-shaped fields."""
    loaded = recorder.calls[0][1]
    assert loaded.broker.version == "5.9.1" and loaded.broker.sysdescr == "EMQX" and loaded.meta == META
    mark = recorder.mark()
    v = emqx.vehicle("V1")
    v.connect()
    v.subscribe()
    calls = recorder.since(mark)
    assert names(calls) == [
        "OnClientConnect",
        "OnSessionCreated",
        "OnClientConnected",
        "OnClientConnack",
        "OnClientSubscribe",
        "OnSessionSubscribed",
    ]
    assert all(req.meta == META and cid(req) == "V1" for _, req in calls)
    # the peerport is the real one: mosquitto logged the same connection
    assert f"New client connected from 127.0.0.1:{v.peerport} as V1" in broker.log()
    conninfo = calls[0][1].conninfo
    assert (conninfo.username, conninfo.peerhost, conninfo.sockport) == ("V1", "127.0.0.1", broker.port)
    assert (conninfo.proto_name, conninfo.proto_ver, conninfo.keepalive, conninfo.peerport) == (
        "MQTT",
        "5",
        60,
        v.peerport,
    )
    ci = calls[2][1].clientinfo
    assert (ci.protocol, ci.mountpoint, ci.anonymous, ci.password, ci.peerport) == ("mqtt", "", True, b"", v.peerport)
    assert ci == v.clientinfo()
    assert calls[3][1].result_code == "success"
    (tf,) = calls[4][1].topic_filters
    assert tf.name == "agent/V1/proxy/request/+" and tf.subopts.qos == 1
    assert calls[5][1].topic == "agent/V1/proxy/request/+" and calls[5][1].subopts.qos == 1


def test_delivery_is_delivered_then_acked(
    emqx: FakeEmqx, recorder: Recorder, broker: Mosquitto, publisher: Client
) -> None:
    """A QoS 1 delivery from the sdv-fanout- client gives publish → delivered → acked with one id."""
    v = emqx.vehicle("V1")
    v.connect()
    v.subscribe()
    mark = recorder.mark()
    publisher.publish(REQUEST_TOPIC.format(vin="V1"), b"payload-1")
    (got,) = v.wait_for(1)
    assert (got.topic, got.payload) == (REQUEST_TOPIC.format(vin="V1"), b"payload-1")
    calls = recorder.since(mark)
    assert names(calls) == ["OnMessagePublish", "OnMessageDelivered", "OnMessageAcked"]
    msgs = [req.message for _, req in calls]
    assert {getattr(m, "from") for m in msgs} == {"sdv-fanout-test"}
    assert len({m.id for m in msgs}) == 1 and re.fullmatch(r"[0-9A-F]{32}", msgs[0].id)
    assert all(m.qos == 1 and m.payload == b"payload-1" for m in msgs)
    for _, req in calls[1:]:
        assert req.clientinfo.clientid == "V1" and req.clientinfo.peerport == v.peerport
    poll(lambda: f"Received PUBACK from V1 (Mid: {got.mid}" in broker.log())


def test_manual_ack_waits_for_ack_pending(emqx: FakeEmqx, recorder: Recorder, publisher: Client) -> None:
    """With auto_ack off, message.acked comes only when the test acks."""
    v = emqx.vehicle("V1")
    v.connect()
    v.subscribe()
    v.auto_ack = False
    mark = recorder.mark()
    publisher.publish(REQUEST_TOPIC.format(vin="V1"), b"x")
    v.wait_for(1)
    assert names(recorder.since(mark)) == ["OnMessagePublish", "OnMessageDelivered"]
    assert v.ack_pending() == 1
    assert names(recorder.since(mark))[-1] == "OnMessageAcked"


def test_heartbeat_publish_honours_the_answer(emqx: FakeEmqx, recorder: Recorder, broker: Mosquitto) -> None:
    """A heartbeat is hooked before it is routed: a denied one never reaches mosquitto, an unrouted one is dropped."""

    def deny_online(req: pb.MessagePublishRequest) -> pb.ValuedResponse:
        if not req.message.topic.endswith("/online"):
            return pb.ValuedResponse(type=pb.ValuedResponse.IGNORE)
        msg = pb.Message()
        msg.CopyFrom(req.message)
        msg.headers["allow_publish"] = "false"
        return pb.ValuedResponse(type=pb.ValuedResponse.STOP_AND_RETURN, message=msg)

    recorder.publish_answer = deny_online
    observer = Client(broker.port, "observer")
    try:
        observer.subscribe("ecp/#")
        v = emqx.vehicle("V1")
        v.connect()
        mark = recorder.mark()
        denied = v.heartbeat("online")
        allowed = v.heartbeat("heartbeat", b"hb")
        assert denied is not None and denied.type == pb.ValuedResponse.STOP_AND_RETURN
        assert allowed is not None and allowed.type == pb.ValuedResponse.IGNORE
        poll(lambda: observer.received)
        assert [(m.topic, m.payload) for m in observer.received] == [("ecp/V1/heartbeat", b"hb")]
    finally:
        observer.close()
    calls = recorder.since(mark)
    assert names(calls) == ["OnMessagePublish", "OnMessagePublish", "OnMessageDropped"]
    online = calls[0][1].message
    assert (online.topic, online.qos, getattr(online, "from")) == ("ecp/V1/online", 0, "V1")
    assert dict(online.headers) == {"username": "V1", "protocol": "mqtt", "peerhost": "127.0.0.1"}
    assert calls[2][1].reason == "no_subscribers" and calls[2][1].message.topic == "ecp/V1/heartbeat"


def test_clean_start_while_old_alive_is_discarded(emqx: FakeEmqx, recorder: Recorder) -> None:
    """A second clean-start connection of one clientid discards the live one in EMQX's order."""
    old = emqx.vehicle("V1")
    old.connect()
    mark = recorder.mark()
    new = emqx.vehicle("V1")
    new.connect()
    old.wait_disconnected()  # mosquitto really kicked the old connection
    assert old.peerport != new.peerport
    calls = recorder.since(mark)
    assert [(m, port_of(r), getattr(r, "reason", None)) for m, r in calls] == [
        ("OnClientConnect", new.peerport, None),
        ("OnClientDisconnected", old.peerport, "discarded"),
        ("OnSessionDiscarded", old.peerport, None),
        ("OnSessionCreated", new.peerport, None),
        ("OnClientConnected", new.peerport, None),
        ("OnClientConnack", new.peerport, None),
    ]
    mark = recorder.mark()
    new.disconnect()
    assert [(m, r.reason) for m, r in recorder.since(mark)] == [
        ("OnClientDisconnected", "normal"),
        ("OnSessionTerminated", "{shutdown,normal}"),
    ]


def test_persistent_session_resumes_and_gets_queued_message(
    emqx: FakeEmqx, recorder: Recorder, publisher: Client
) -> None:
    """A persistent session survives a disconnect, resumes with takeover hooks and gets the queued QoS 1."""
    v = emqx.vehicle("V1", clean_start=False, session_expiry_s=300)
    v.connect()
    v.subscribe()
    old_port = v.peerport
    mark = recorder.mark()
    v.disconnect()
    assert [(m, r.reason) for m, r in recorder.since(mark)] == [("OnClientDisconnected", "normal")]
    publisher.publish(REQUEST_TOPIC.format(vin="V1"), b"queued")  # mosquitto queues it for the session
    mark = recorder.mark()
    v.reconnect(clean_start=False)
    (got,) = v.wait_for(1)
    assert got.payload == b"queued"
    calls = recorder.since(mark)
    assert [(m, port_of(r), getattr(r, "reason", None)) for m, r in calls] == [
        ("OnClientConnect", v.peerport, None),
        ("OnSessionResumed", v.peerport, None),
        ("OnClientDisconnected", old_port, "takenover"),
        ("OnSessionTakenover", old_port, None),
        ("OnClientConnected", v.peerport, None),
        ("OnClientConnack", v.peerport, None),
        ("OnMessagePublish", 0, None),
        ("OnMessageDelivered", v.peerport, None),
        ("OnMessageAcked", v.peerport, None),
    ]
    assert calls[1][1].clientinfo.peerport != old_port
    assert getattr(calls[-1][1].message, "from") == "sdv-fanout-test"


def test_drop_is_tcp_closed(emqx: FakeEmqx, recorder: Recorder, broker: Mosquitto) -> None:
    """An abrupt socket close is client.disconnected(tcp_closed) and ends a non-persistent session."""
    v = emqx.vehicle("V1")
    v.connect()
    mark = recorder.mark()
    v.drop()
    assert not v.is_connected
    assert [(m, r.reason) for m, r in recorder.since(mark)] == [
        ("OnClientDisconnected", "tcp_closed"),
        ("OnSessionTerminated", "{shutdown,tcp_closed}"),
    ]
    assert "Client V1 closed its connection" in broker.log()


def test_crash_before_ack_redelivers_same_message(
    emqx: FakeEmqx, recorder: Recorder, broker: Mosquitto, publisher: Client
) -> None:
    """An unacked delivery survives a crash of a persistent vehicle and is redelivered (same id) and acked."""
    v = emqx.vehicle("V1", clean_start=False, session_expiry_s=300)
    v.connect()
    v.subscribe()
    v.auto_ack = False
    old_port = v.peerport
    mark = recorder.mark()
    publisher.publish(REQUEST_TOPIC.format(vin="V1"), b"unacked")
    v.wait_for(1)
    v.crash_before_ack()
    calls = recorder.since(mark)
    assert names(calls) == ["OnMessagePublish", "OnMessageDelivered", "OnClientDisconnected"]
    assert calls[2][1].reason == "tcp_closed"
    first_id = calls[1][1].message.id
    v.auto_ack = True
    mark = recorder.mark()
    v.reconnect(clean_start=False)
    received = v.wait_for(2)
    assert [r.payload for r in received] == [b"unacked", b"unacked"]
    calls = recorder.since(mark)
    assert [(m, port_of(r)) for m, r in calls] == [
        ("OnClientConnect", v.peerport),
        ("OnSessionResumed", v.peerport),
        ("OnClientDisconnected", old_port),
        ("OnSessionTakenover", old_port),
        ("OnClientConnected", v.peerport),
        ("OnClientConnack", v.peerport),
        ("OnMessageDelivered", v.peerport),
        ("OnMessageAcked", v.peerport),
    ]
    assert calls[-1][1].message.id == first_id
    poll(lambda: f"Received PUBACK from V1 (Mid: {received[1].mid}" in broker.log())


def test_broker_restart_drops_everyone_and_vehicle_comes_back(
    emqx: FakeEmqx, recorder: Recorder, broker: Mosquitto
) -> None:
    """A broker restart unloads/reloads the provider, drops clients silently, and a vehicle can come back."""
    v = emqx.vehicle("V1")
    v.connect()
    v.subscribe()
    mark = recorder.mark()
    emqx.restart_broker(broker)
    assert not v.is_connected
    assert names(recorder.since(mark)) == ["OnProviderUnloaded", "OnProviderLoaded"]
    mark = recorder.mark()
    v.reconnect(clean_start=True)
    v.subscribe()
    assert names(recorder.since(mark)) == [
        "OnClientConnect",
        "OnSessionCreated",
        "OnClientConnected",
        "OnClientConnack",
        "OnClientSubscribe",
        "OnSessionSubscribed",
    ]
    publisher = Client(broker.port, "sdv-fanout-test")
    try:
        publisher.publish(REQUEST_TOPIC.format(vin="V1"), b"after-restart")
        assert v.wait_for(1)[0].payload == b"after-restart"
    finally:
        publisher.close()


def test_only_registered_hooks_and_topics_are_called(tmp_path: Path) -> None:
    """Like EMQX, the driver calls only hooks the provider listed, filtered by their topics."""
    assert topic_matches("agent/+/proxy/request/+", "agent/V1/proxy/request/t1")
    assert not topic_matches("#", "$SDV-FANOUT") and topic_matches("$SDV-FANOUT", "$SDV-FANOUT")
    recorder = Recorder({"message.publish": ["$SDV-FANOUT"]})
    try:
        with running_mosquitto(tmp_path) as broker, FakeEmqx(recorder.port, broker.port) as emqx:
            v = emqx.vehicle("V1")
            v.connect()  # nothing: before load() EMQX calls no hook
            emqx.load()
            v.heartbeat()
            reply = emqx.publish_batch(["V1", "V2"], "task_a_1", b"\x00\xff")
            assert reply is not None and reply.type == pb.ValuedResponse.IGNORE
    finally:
        recorder.stop()
    assert names(recorder.calls) == ["OnProviderLoaded", "OnMessagePublish"]
    msg = recorder.calls[1][1].message
    assert (msg.topic, getattr(msg, "from"), msg.qos) == ("$SDV-FANOUT", "sdv-platform", 1)
    assert json.loads(msg.payload) == {
        "ids": ["V1", "V2"],
        "request_id": "task_a_1",
        "data": "AP8=",
        "data_encoding": "base64",
    }


def test_idle_persistent_session_expires(emqx: FakeEmqx, recorder: Recorder) -> None:
    """An idle persistent session ends with session.terminated("expired") once its expiry interval passes."""
    v = emqx.vehicle("V1", clean_start=False, session_expiry_s=1)
    v.connect()
    v.disconnect()
    mark = recorder.mark()
    poll(lambda: recorder.since(mark), timeout_s=5)
    assert [(m, r.reason, r.clientinfo.peerport) for m, r in recorder.since(mark)] == [
        ("OnSessionTerminated", "expired", v.peerport)
    ]


def test_failed_rpcs_are_recorded_and_mqtt_goes_on(broker: Mosquitto) -> None:
    """When the provider is down the MQTT side carries on, and close() reports the failed RPCs."""
    recorder = Recorder()
    emqx = FakeEmqx(recorder.port, broker.port, request_timeout_s=2.0)
    try:
        emqx.load()
        recorder.stop()
        v = emqx.vehicle("V1")
        v.connect()
        v.subscribe()
        assert v.is_connected
        assert [hook for hook, _ in emqx.rpc_errors] == [
            "client.connect",
            "session.created",
            "client.connected",
            "client.connack",
            "client.subscribe",
            "session.subscribed",
        ]
        with pytest.raises(AssertionError, match="failed RPC"):
            emqx.check()
    finally:
        emqx.close(check=False)


def test_closed_vehicles_leave_no_descriptor_open(recorder: Recorder, broker: Mosquitto) -> None:
    """Closing a vehicle closes every descriptor it held, without waiting for a garbage
    collection: held until one, they pile up over a full test run."""

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.disable()  # only closing may free them here, as between collections in a long run
    try:
        with FakeEmqx(recorder.port, broker.port, pool_size=1) as emqx:
            emqx.load()
            first = emqx.vehicle("V0")
            first.connect()  # the gRPC connection opens on the first call
            first.close()
            before = open_fds()
            vehicles = [emqx.vehicle(f"V{n}") for n in range(1, 21)]
            for v in vehicles:
                v.connect()
            assert open_fds() >= before + len(vehicles)  # a socket each
            for v in vehicles:
                v.close()
            assert open_fds() <= before
    finally:
        gc.enable()
