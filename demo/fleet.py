"""One slice of the demo's fleet, in its own process: real paho MQTT 5 vehicles and their drivers.

paho's select() loop caps a process at about 330 clients, so `demo.run` starts several of these
(`python -m demo.fleet`). They talk JSON lines: the spec and commands on stdin, progress and the
final report on stdout. A worker ignores SIGINT (the demo stops it in order) and ends when told.

Two kinds of vehicle, one behaviour: with the real EMQX a vehicle is a plain paho client of the
broker (EMQX calls the server's hooks itself); with the simulator it is `testkit.emqx_sim.Vehicle`,
connected to mosquitto, whose hooks `FakeEmqx` calls as EMQX would. A vehicle that answers
publishes its answer to a request awaiting one on `agent/<VIN>/proxy/response/<request_id>`
(QoS 1) after its PUBACK; the others never answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import IO, Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.emqx_sim import LOOPBACK, FakeEmqx, Received, Vehicle

REQUEST_PREFIX = "agent/{VIN}/proxy/request"
#: The server's default `response_topic_prefix`: a vehicle answers on `<prefix>/<request_id>`.
RESPONSE_PREFIX = "agent/{VIN}/proxy/response"
#: A persistent session (the vehicles that resume) outlives its connection this long.
SESSION_EXPIRY_S = 300
#: How long a vehicle waits for its broker's CONNACK or SUBACK, or for a dropped socket to close.
MQTT_TIMEOUT_S = 10.0


def sha16(payload: bytes) -> str:
    """Short payload fingerprint (first 16 hex digits of its sha1) for reports."""
    return hashlib.sha1(payload, usedforsecurity=False).hexdigest()[:16]


def request_filter(vin: str) -> str:
    """What a vehicle subscribes to: `agent/<VIN>/proxy/request/+`."""
    return REQUEST_PREFIX.replace("{VIN}", vin) + "/+"


def request_of(vin: str, topic: str) -> str | None:
    """The request id of a delivery topic of `vin`, or None for any other topic."""
    prefix = REQUEST_PREFIX.replace("{VIN}", vin) + "/"
    return topic[len(prefix) :] if topic.startswith(prefix) else None


def response_topic(vin: str, request_id: str) -> str:
    """Where `vin` answers `request_id`: `agent/<VIN>/proxy/response/<request_id>`."""
    return RESPONSE_PREFIX.replace("{VIN}", vin) + "/" + request_id


class Tracking:
    """What the demo watches on every vehicle, whichever broker it talks to: the requests it holds
    unacknowledged per connection (its in-flight window), and what its driver thread needs."""

    def _init_tracking(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.wake = threading.Event()
        self.cmds: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lock = threading.Lock()
        self.unacked: list[tuple[Any, str, str]] = []  # (connection, topic, sha16) received, not PUBACKed
        self.held: set[tuple[str, str]] = set()  # (topic, sha16) unacked when a connection dropped
        self.held_count = 0
        self.max_inflight = 0
        self.acked = 0
        #: (topic, sha16, time.time() just before the PUBACK went out), for the demo's check of the
        #: server's delivered counts (a PUBACK is what makes a delivery count).
        self.acks: list[tuple[str, str, float]] = []
        #: (request_id, sha16, body, time.time()) of every answer published (and PUBACKed by the broker).
        self.answers: list[tuple[str, str, str, float]] = []
        #: (topic, sha16) PUBACKed, awaiting this vehicle's answer, when a connection dropped: the
        #: server may send it again after a clean reconnect (never answered: it ends failed anyway).
        self.awaiting: set[tuple[str, str]] = set()
        self.drops = 0
        self.heartbeats = 0
        self.holding = False
        self.busy = False
        self.ready = threading.Event()

    def _track_received(self, conn: Any, topic: str, payload: bytes) -> None:
        with self.lock:
            self.unacked.append((conn, topic, sha16(payload)))
            inflight = sum(1 for c, _, _ in self.unacked if c is conn)
        self.max_inflight = max(self.max_inflight, inflight)

    def _track_acked(self, conn: Any, topic: str, payload: bytes, t: float) -> None:
        key = (topic, sha16(payload))
        self.acks.append((*key, t))
        with self.lock:
            for i, entry in enumerate(self.unacked):
                if entry[0] is conn and entry[1:] == key:
                    del self.unacked[i]
                    break


class SimVehicle(Vehicle, Tracking):
    """A test-harness Vehicle (mosquitto + FakeEmqx) that also tracks its in-flight window."""

    def __init__(self, emqx: FakeEmqx, spec: dict[str, Any]) -> None:
        persistent = spec["role"] == "resume"
        vin = spec["vin"]
        super().__init__(emqx, vin, vin, vin, True, SESSION_EXPIRY_S if persistent else 0, 60)
        self._init_tracking(spec)
        self.auto_ack = False  # the driver thread acks after a short "processing" time

    # Both run on FakeEmqx's worker thread for this clientid, in order with every other hook job.
    def _job_message(self, conn: Any, topic: str, payload: bytes, mid: int, qos: int, dup: bool, t: float) -> None:
        before = len(self._pending)
        super()._job_message(conn, topic, payload, mid, qos, dup, t)
        if len(self._pending) > before:  # queued for our PUBACK
            self._track_received(conn, topic, payload)
        self.wake.set()

    def _ack(self, conn: Any, mid: int, qos: int, msg: pb.Message) -> bool:
        t = time.time()
        done = super()._ack(conn, mid, qos, msg)
        if done:
            self._track_acked(conn, msg.topic, msg.payload, t)
        return done

    def answer(self, request_id: str, body: bytes) -> None:
        """Publish the answer to `request_id` at QoS 1 as EMQX would route it: `message.publish`
        (the server takes it there), then the real publish unless the server stopped it."""
        self.respond(request_id, body)


class _Link:
    """One MQTT connection of an `MqttVehicle` (each connect is a new paho client and TCP socket)."""

    def __init__(self, client: mqtt.Client) -> None:
        self.client = client
        self.connack = threading.Event()
        self.refused: ReasonCode | None = None
        self.closed = threading.Event()
        self.subacks: dict[int, list[ReasonCode]] = {}
        self.suback = threading.Condition()

    def stop(self) -> None:
        """Close the socket (no DISCONNECT: to the broker, a lost network) and reap paho's thread."""
        sock = self.client.socket()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
        self.client.loop_stop()
        if sock is not None:
            sock.close()


class MqttVehicle(Tracking):
    """A vehicle as a plain paho MQTT 5 client of the real broker: the broker calls the server's
    hooks, and what it redelivers on a resumed session is its own business, as in the field."""

    def __init__(self, mqtt_port: int, spec: dict[str, Any]) -> None:
        self._init_tracking(spec)
        self.vin: str = spec["vin"]
        self.mqtt_port = mqtt_port
        self.session_expiry_s = SESSION_EXPIRY_S if spec["role"] == "resume" else 0
        self.received: list[Received] = []
        self._link: _Link | None = None
        self._links: list[_Link] = []
        self._pending: list[tuple[_Link, int, str, bytes]] = []  # received QoS 1, not yet PUBACKed

    @property
    def persistent(self) -> bool:
        """Does the session outlive the connection (MQTT 5 Session-Expiry-Interval > 0)?"""
        return self.session_expiry_s > 0

    @property
    def is_connected(self) -> bool:
        """True while the current MQTT connection is up."""
        link = self._link
        return link is not None and link.connack.is_set() and link.refused is None and not link.closed.is_set()

    def _on_message(self, link: _Link, message: mqtt.MQTTMessage) -> None:
        payload = bytes(message.payload)
        self.received.append(Received(message.topic, payload, message.mid, time.time()))
        if message.qos > 0:
            with self.lock:
                self._pending.append((link, message.mid, message.topic, payload))
            self._track_received(link, message.topic, payload)
        self.wake.set()

    def _on_suback(self, link: _Link, mid: int, codes: list[ReasonCode]) -> None:
        with link.suback:
            link.subacks[mid] = codes
            link.suback.notify_all()

    def connect(self, clean_start: bool = True) -> None:
        """A new TCP connection and CONNECT; returns after the CONNACK (raises if refused)."""
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.vin,
            protocol=mqtt.MQTTv5,
            manual_ack=True,
            reconnect_on_failure=False,
        )
        client.username_pw_set(self.vin)
        link = _Link(client)

        def on_connect(_c: Any, _u: Any, _flags: Any, rc: ReasonCode, _props: Any) -> None:
            link.refused = rc if rc.is_failure else None
            link.connack.set()

        client.on_connect = on_connect
        client.on_disconnect = lambda _c, _u, _flags, _rc, _props: link.closed.set()
        client.on_subscribe = lambda _c, _u, mid, codes, _props: self._on_suback(link, mid, codes)
        client.on_message = lambda _c, _u, message: self._on_message(link, message)
        props = None
        if self.session_expiry_s:
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = self.session_expiry_s
        client.connect(LOOPBACK, self.mqtt_port, keepalive=60, clean_start=clean_start, properties=props)
        previous, self._link = self._link, link
        self._links.append(link)
        client.loop_start()
        deadline = time.monotonic() + MQTT_TIMEOUT_S
        while not link.connack.wait(0.05):
            if link.closed.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.vin}: no CONNACK")
        if link.refused is not None:
            raise RuntimeError(f"{self.vin}: CONNACK {link.refused}")
        if previous is not None:
            previous.stop()

    def reconnect(self, clean_start: bool) -> None:
        """Connect again on a new TCP connection (the broker resumes the session or starts clean)."""
        self.connect(clean_start)

    def subscribe(self) -> None:
        """SUBSCRIBE `agent/<VIN>/proxy/request/+` at QoS 1; returns after a granted SUBACK."""
        link = self._require_link()
        rc, mid = link.client.subscribe(request_filter(self.vin), options=SubscribeOptions(qos=1))
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise RuntimeError(f"{self.vin}: subscribe failed: {rc}")
        with link.suback:
            if not link.suback.wait_for(lambda: mid in link.subacks or link.closed.is_set(), MQTT_TIMEOUT_S):
                raise RuntimeError(f"{self.vin}: no SUBACK")
        codes = link.subacks.pop(mid, None)
        if codes is None or any(c.is_failure for c in codes):
            raise RuntimeError(f"{self.vin}: SUBACK {codes}")

    def answer(self, request_id: str, body: bytes) -> None:
        """QoS 1 publish of the answer to `request_id` on `agent/<VIN>/proxy/response/<request_id>`;
        returns once the broker PUBACKed it, i.e. EMQX ran its hooks."""
        link = self._require_link()
        topic = response_topic(self.vin, request_id)
        info = link.client.publish(topic, body, qos=1)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"{self.vin}: publish on {topic} failed: {info.rc}")
        info.wait_for_publish(MQTT_TIMEOUT_S)
        if not info.is_published():
            raise RuntimeError(f"{self.vin}: no PUBACK for {topic}")

    def heartbeat(self, kind: str) -> None:
        """QoS 0 publish on `ecp/<VIN>/<kind>`: tells the server this vehicle is online."""
        link = self._require_link()
        info = link.client.publish(f"ecp/{self.vin}/{kind}", b"", qos=0)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"{self.vin}: heartbeat publish failed: {info.rc}")

    def ack_pending(self) -> int:
        """PUBACK what the current connection received; returns how many PUBACKs went out."""
        with self.lock:
            pending, self._pending = self._pending, []
        done = 0
        for link, mid, topic, payload in pending:
            if link is not self._link or link.closed.is_set():
                continue  # that connection is gone: the broker redelivers or the server re-sends
            t = time.time()
            if link.client.ack(mid, 1) == MQTTErrorCode.MQTT_ERR_SUCCESS:
                self._track_acked(link, topic, payload, t)
                done += 1
        return done

    def drop(self) -> None:
        """Abrupt close (TCP FIN, no DISCONNECT), as a vehicle losing its network does; waits until
        the broker has closed its side too, i.e. it has noticed."""
        link = self._require_link()
        sock = link.client.socket()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # type: ignore[attr-defined]
        if not link.closed.wait(MQTT_TIMEOUT_S):
            raise RuntimeError(f"{self.vin}: the broker did not close the dropped connection")
        link.stop()
        with self.lock:
            self._pending = [p for p in self._pending if p[0] is not link]

    def close(self) -> None:
        """Stop every paho loop of this vehicle and close its sockets."""
        for link in self._links:
            link.stop()

    def _require_link(self) -> _Link:
        if not self.is_connected:
            raise RuntimeError(f"{self.vin} is not connected")
        assert self._link is not None
        return self._link


DemoVehicle = SimVehicle | MqttVehicle


class FleetWorker:
    """Drives its vehicles (one thread each) through the scenario the demo sends, and reports."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.stop = threading.Event()
        self.out_lock = threading.Lock()
        #: Request ids whose batches carry `await_response: true`: answering vehicles answer them.
        self.await_response: frozenset[str] = frozenset(spec.get("await_response", ()))
        #: The server's `response_timeout_s`: an unanswered request waits this long, then fails.
        self.response_timeout_s: float = float(spec.get("response_timeout_s", 0.0))
        self.errors: list[str] = []
        self.emqx: FakeEmqx | None = None
        self.vehicles: dict[str, DemoVehicle] = {}
        if spec["broker"] == "sim":
            self.emqx = FakeEmqx(
                spec["exhook_port"],
                spec["mqtt_port"],
                request_prefix=REQUEST_PREFIX,
                delivery_clientid=spec["delivery_clientid"],
                strict_rpc=False,
            )
            self.emqx.calls = deque(maxlen=1000)  # the harness keeps every request; we need none
            self.emqx.load()
            sims = {s["vin"]: SimVehicle(self.emqx, s) for s in spec["vehicles"]}
            self.emqx.vehicles.extend(sims.values())  # so that FakeEmqx.close() closes them
            self.vehicles.update(sims)
        else:
            self.vehicles.update({s["vin"]: MqttVehicle(spec["mqtt_port"], s) for s in spec["vehicles"]})
        self.threads = [
            threading.Thread(target=self._drive, args=(v,), name=f"drive-{v.vin}", daemon=True)
            for v in self.vehicles.values()
        ]

    def emit(self, obj: dict[str, Any]) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
            sys.stdout.flush()

    def error(self, vin: str, what: str, exc: BaseException) -> None:
        self.errors.append(f"{vin}: {what}: {exc!r}")
        print(f"{vin}: {what}: {exc!r}", file=sys.stderr, flush=True)

    # -- one thread per vehicle ---------------------------------------------------------------
    def _drive(self, v: DemoVehicle) -> None:
        ack_s = v.spec["ack_ms"] / 1000
        next_hb: float | None = None
        while not self.stop.is_set():
            timeout = 0.5 if next_hb is None else min(0.5, max(0.0, next_hb - time.monotonic()))
            v.wake.wait(timeout)
            v.wake.clear()
            while not self.stop.is_set():
                try:
                    cmd = v.cmds.get_nowait()
                except queue.Empty:
                    break
                v.busy = True
                try:
                    if cmd["cmd"] == "online":
                        self._online(v)
                    elif cmd["cmd"] == "drop":
                        self._drop_and_return(v, cmd["back_s"])
                    next_hb = time.monotonic() + v.spec["hb_phase_s"]
                except Exception as exc:
                    self.error(v.vin, cmd["cmd"], exc)
                finally:
                    v.busy = False
            if v.unacked and not v.holding:
                time.sleep(ack_s)  # "processing" the request before the PUBACK
                before = len(v.acks)
                try:
                    v.acked += v.ack_pending()
                except Exception as exc:
                    self.error(v.vin, "ack", exc)
                if v.spec.get("answers"):
                    self._answer(v, v.acks[before:])
            if next_hb is not None and time.monotonic() >= next_hb:
                next_hb = time.monotonic() + v.spec["hb_s"]
                if v.is_connected:
                    try:
                        v.heartbeat("heartbeat")
                        v.heartbeats += 1
                    except RuntimeError:
                        pass  # the connection went away under us: it will say online again
                    except Exception as exc:
                        self.error(v.vin, "heartbeat", exc)

    def _answer(self, v: DemoVehicle, acked: list[tuple[str, str, float]]) -> None:
        """After the PUBACK, run the request (`answer_ms`) and publish the answer, once per
        request and payload: a redelivered copy was answered already."""
        for topic, digest, _ in acked:
            rid = request_of(v.vin, topic)
            if rid not in self.await_response or any(a[0] == rid and a[1] == digest for a in v.answers):
                continue
            time.sleep(v.spec["answer_ms"] / 1000)
            body = json.dumps({"result": "ok", "dtc": v.spec["dtc"], "took_ms": v.spec["answer_ms"]})
            try:
                v.answer(rid, body.encode())
            except Exception as exc:
                self.error(v.vin, "respond", exc)
                continue
            v.answers.append((rid, digest, body, time.time()))

    def _online(self, v: DemoVehicle) -> None:
        v.connect()
        v.subscribe()
        v.heartbeat("online")
        v.heartbeats += 1
        v.ready.set()

    def _drop_and_return(self, v: DemoVehicle, back_s: float) -> None:
        resume = v.persistent
        if resume or v.spec.get("hold"):
            # Hold the PUBACK of whatever comes next, then drop: a persistent session keeps it in the
            # broker for redelivery; after a clean reconnect the server has to send it again.
            v.holding = True
            deadline = time.monotonic() + 3.0
            while not v.unacked and time.monotonic() < deadline and not self.stop.is_set():
                v.wake.wait(0.05)
                v.wake.clear()
        v.drop()  # TCP gone without DISCONNECT: client.disconnected(tcp_closed) (+ terminated if clean)
        with v.lock:
            held, v.unacked = v.unacked, []
        v.held.update((topic, digest) for _, topic, digest in held)
        if not v.spec.get("answers"):
            # A request PUBACKed less than response_timeout_s ago still waits for our answer.
            recent = time.time() - self.response_timeout_s - 1.0
            v.awaiting.update(
                (topic, digest)
                for topic, digest, t in v.acks
                if t > recent and request_of(v.vin, topic) in self.await_response
            )
        v.held_count += len(held)
        v.holding = False
        v.drops += 1
        if self.stop.wait(back_s):
            return
        if resume:
            v.reconnect(clean_start=False)  # session.resumed: the broker redelivers what was held
        else:
            v.reconnect(clean_start=True)
            v.subscribe()
        v.heartbeat("online")
        v.heartbeats += 1

    # -- process ------------------------------------------------------------------------------
    def _broker_errors(self) -> list[str]:
        if self.emqx is None:
            return []
        return [repr(e) for e in self.emqx.errors] + [f"rpc {hook}: {exc!r}" for hook, exc in self.emqx.rpc_errors]

    def progress(self) -> dict[str, Any]:
        vs = list(self.vehicles.values())
        return {
            "online": sum(v.is_connected for v in vs),
            "received": sum(len(v.received) for v in vs),
            "acked": sum(v.acked for v in vs),
            "answered": sum(len(v.answers) for v in vs),
            "unacked": sum(len(v.unacked) for v in vs),
            "busy": sum(v.busy or not v.cmds.empty() for v in vs),
            "max_inflight": max((v.max_inflight for v in vs), default=0),
            "errors": len(self.errors) + len(self._broker_errors()),
        }

    def final(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for vin, v in self.vehicles.items():
            prefix = REQUEST_PREFIX.replace("{VIN}", vin) + "/"
            out[vin] = {
                "rx": [
                    [r.topic[len(prefix) :] if r.topic.startswith(prefix) else "!" + r.topic, sha16(r.payload), r.time]
                    for r in v.received
                ],
                "held": sorted([t[len(prefix) :], d] for t, d in v.held),
                "awaiting": sorted([t[len(prefix) :], d] for t, d in v.awaiting),
                "answers": [list(a) for a in v.answers],
                "ax": [[t[len(prefix) :], d, at] for t, d, at in v.acks if t.startswith(prefix)],
                "held_count": v.held_count,
                "max_inflight": v.max_inflight,
                "acked": v.acked,
                "drops": v.drops,
                "heartbeats": v.heartbeats,
            }
        errors = self.errors + self._broker_errors()
        return {"vehicles": out, "errors": errors[:20], "error_count": len(errors)}

    def run(self, commands: IO[str]) -> None:
        for t in self.threads:
            t.start()
        initial = [v for v in self.vehicles.values() if v.spec["role"] != "late"]
        for v in initial:
            v.cmds.put({"cmd": "online"})
            v.wake.set()
        deadline = time.monotonic() + 60
        for v in initial:
            v.ready.wait(max(0.0, deadline - time.monotonic()))
        self.emit({"p": self.progress()})
        self.emit({"ready": sum(v.ready.is_set() for v in initial)})

        reporter = threading.Thread(target=self._report, name="report", daemon=True)
        reporter.start()
        for line in commands:
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            for vin in cmd["vins"]:
                v = self.vehicles[vin]
                v.cmds.put({"cmd": cmd["cmd"], "back_s": cmd.get("back_s", {}).get(vin, 0.0)})
                v.wake.set()
        self.stop.set()
        deadline = time.monotonic() + 15
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        reporter.join(5)
        self.emit({"final": self.final()})
        if self.emqx is not None:
            self.emqx.close(check=False)
        else:
            for v in self.vehicles.values():
                assert isinstance(v, MqttVehicle)
                v.close()

    def _report(self) -> None:
        while not self.stop.wait(0.25):
            self.emit({"p": self.progress()})


def main() -> int:
    """Entry point of a fleet process: the spec on the first line of stdin, then commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the demo process stops us in order
    spec = json.loads(sys.stdin.readline())
    FleetWorker(spec).run(sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
