"""One slice of the demo's fleet, in its own process: real MQTT 5 vehicles and their drivers.

`demo.run` starts several of these (`python -m demo.fleet`), a few hundred vehicles each. They
talk JSON lines: the spec and commands on stdin, progress and the final report on stdout. A
worker ignores SIGINT (the demo stops it in order) and ends when told.

One vehicle, testkit/vehicle.py's: on the real EMQX as it is (EMQX calls the server's hooks
itself); on the simulator as `testkit.emqx_sim.Vehicle` on mosquitto, whose hooks `FakeEmqx`
calls as EMQX would. A vehicle that answers publishes its answer to a request awaiting
one on `agent/<VIN>/proxy/response/<request_id>` (QoS 1) after its PUBACK; the others never do.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from typing import IO, Any

from testkit.emqx_sim import FakeEmqx
from testkit.emqx_sim import Vehicle as SimulatorVehicle
from testkit.vehicle import REQUEST_PREFIX, Vehicle

#: A persistent session (the vehicles that resume) outlives its connection this long.
SESSION_EXPIRY_S = 300


def sha16(payload: bytes) -> str:
    """Short payload fingerprint (first 16 hex digits of its sha1) for reports."""
    return hashlib.sha1(payload, usedforsecurity=False).hexdigest()[:16]


def request_of(vin: str, topic: str) -> str | None:
    """The request id of a delivery topic of `vin`, or None for any other topic."""
    prefix = REQUEST_PREFIX.replace("{VIN}", vin) + "/"
    return topic[len(prefix) :] if topic.startswith(prefix) else None


class Tracking:
    """What the demo's driver thread keeps on every vehicle, whichever broker it talks to."""

    def _init_tracking(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.wake = threading.Event()
        self.cmds: queue.Queue[dict[str, Any]] = queue.Queue()
        self.held: set[tuple[str, str]] = set()  # (topic, sha16) unacked when a connection dropped
        self.held_count = 0
        self.acked = 0
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
        self.on_delivery = lambda _d: self.wake.set()


class SimVehicle(SimulatorVehicle, Tracking):
    """A vehicle of the hook simulator (mosquitto + FakeEmqx): testkit/vehicle.py's, whose hooks
    FakeEmqx calls (its deliveries reach `on_delivery` in the clientid's hook lane)."""

    def __init__(self, emqx: FakeEmqx, spec: dict[str, Any]) -> None:
        persistent = spec["role"] == "resume"
        vin = spec["vin"]
        super().__init__(emqx, vin, vin, vin, True, SESSION_EXPIRY_S if persistent else 0, 60)
        self._init_tracking(spec)
        self.auto_ack = False  # the driver thread acks after a short "processing" time


class MqttVehicle(Vehicle, Tracking):
    """A vehicle of the real broker (which calls the server's hooks itself): testkit.vehicle's."""

    def __init__(self, mqtt_port: int, spec: dict[str, Any]) -> None:
        persistent = spec["role"] == "resume"
        super().__init__(mqtt_port, spec["vin"], auto_ack=False, session_expiry_s=SESSION_EXPIRY_S if persistent else 0)
        self._init_tracking(spec)


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
                # A node of its own (the platform's driver is another): one node name loaded by two
                # drivers started apart reads as that node's restart to the server.
                node=f"fleet{os.getpid()}@127.0.0.1",
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
                    v.acked += v.ack_held()
                except Exception as exc:
                    self.error(v.vin, "ack", exc)
                if v.spec.get("answers"):
                    self._answer(v, v.acks[before:])
            if next_hb is not None and time.monotonic() >= next_hb:
                next_hb = time.monotonic() + v.spec["hb_s"]
                if v.connected:
                    try:
                        v.heartbeat("heartbeat")
                        v.heartbeats += 1
                    except RuntimeError:
                        pass  # the connection went away under us: it will say online again
                    except Exception as exc:
                        self.error(v.vin, "heartbeat", exc)

    def _answer(self, v: DemoVehicle, acked: list[tuple[Any, float]]) -> None:
        """After the PUBACK, run the request (`answer_ms`) and publish the answer, once per
        request and payload: a redelivered copy was answered already."""
        for d, _ in acked:
            rid, digest = request_of(v.vin, d.topic), sha16(d.payload)
            if rid not in self.await_response or any(a[0] == rid and a[1] == digest for a in v.answers):
                continue
            time.sleep(v.spec["answer_ms"] / 1000)
            body = json.dumps({"result": "ok", "dtc": v.spec["dtc"], "took_ms": v.spec["answer_ms"]})
            if "status" in v.spec:  # it reports the request failed: an abort criterion counts it
                body = json.dumps({"status": v.spec["status"], "took_ms": v.spec["answer_ms"]})
            try:
                v.respond(rid, body.encode())
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
        held = [d for _, d in v.unacked]
        v.unacked.clear()
        v.held.update((d.topic, sha16(d.payload)) for d in held)
        if not v.spec.get("answers"):
            # A request PUBACKed less than response_timeout_s ago still waits for our answer.
            recent = time.time() - self.response_timeout_s - 1.0
            v.awaiting.update(
                (d.topic, sha16(d.payload))
                for d, t in v.acks
                if t > recent and request_of(v.vin, d.topic) in self.await_response
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
            "online": sum(v.connected for v in vs),
            "received": sum(len(v.received) for v in vs),
            "acked": sum(v.acked for v in vs),
            "answered": sum(len(v.answers) for v in vs),
            "unacked": sum(len(v.unacked) for v in vs),
            "busy": sum(v.busy or not v.cmds.empty() for v in vs),
            "max_inflight": max((v.max_unacked for v in vs), default=0),
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
                "ax": [
                    [d.topic[len(prefix) :], sha16(d.payload), at] for d, at in v.acks if d.topic.startswith(prefix)
                ],
                "held_count": v.held_count,
                "max_inflight": v.max_unacked,
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
