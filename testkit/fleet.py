"""Fleet processes for tests and benches: a slice of the fleet, or the raw reference publisher.

One process runs at most testkit/rig.py's MAX_PER_PROC vehicles (one GIL for their MQTT and hook
calls), so bench/e2e.py spreads the fleet over several of these. Roles:

* `sim`: vehicles driven by testkit/emqx_sim.py's FakeEmqx (testkit/vehicle.py's MQTT 5
  clients on mosquitto; the driver calls our ExHook RPCs as EMQX would: connect, subscribe,
  and one `message.acked` per PUBACK), phase by phase, reporting every receive time; with
  `--expect k`, one shot: {"done": {vin: [topic, ...]}} once each vehicle got k messages.
* `raw`: testkit/vehicle.py's vehicles (clientid `<clientid-prefix><VIN>`) on
  `<prefix>/<VIN>/proxy/request/+` for each of the comma-separated `--prefix`es, QoS 1,
  acking each message as it arrives; with `signal`, each then publishes a QoS 0
  `<ack-prefix>/<VIN>` so the publisher can keep one message in flight per VIN.
  bench/e2e_emqx.py uses them as real vehicles (clientid = VIN, `agent` and `refer`).
* `pub`: the raw reference publisher: one paho MQTT 5 client, QoS 1, the same
  in-flight window as the server's delivery client, mode `a` (everything at once)
  or `b` (next message to a VIN only after that VIN's ack signal).

Protocol: JSON lines. The process prints {"ready": n}; then for each command read
from stdin it answers on stdout. Fleets: {"cmd": "phase", "expect": k, ...} →
{"armed": true} at once, then {"done": {...}} when every vehicle got k new distinct
messages (or the deadline passed). Publisher: {"cmd": "run", ...} → {"done": {...}}.
{"cmd": "quit"} or EOF on stdin ends the process. Times are time.time() (one machine).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.emqx_sim import LOOPBACK, FakeEmqx
from testkit.emqx_sim import Vehicle as SimulatorVehicle
from testkit.mqtt import run as run_on_loop
from testkit.vehicle import RESPONSE_PREFIX, Delivery, Vehicle

POLL_S = 0.1  # progress polls with a deadline; the timings come from receive stamps, not from these


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def commands() -> Any:
    """Commands from stdin until EOF or quit."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return
        yield cmd


# -- fleets ------------------------------------------------------------------------------------


class Fleet:
    """What both fleet kinds share: per-VIN receive logs of (request_id, time) and phase waiting."""

    def __init__(self, vins: list[str]) -> None:
        self.vins = vins

    def count(self, vin: str) -> int:
        """Messages `vin` received so far (cheap: polled)."""
        raise NotImplementedError

    def entries(self, vin: str, start: int) -> list[tuple[str, float, float]]:
        """(request_id, receive time, handled time) of what `vin` received from index `start` on;
        handled = PUBACK sent and, for sim vehicles, the message.acked RPC answered."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise if the fleet saw an error."""

    def phase(self, cmd: dict[str, Any]) -> dict[str, Any]:
        expect = int(cmd["expect"])
        starts = {vin: self.count(vin) for vin in self.vins}
        emit({"armed": True})
        deadline = time.monotonic() + float(cmd.get("deadline_s", 120))
        pending = set(self.vins)
        while pending and time.monotonic() < deadline:
            self.check()
            for vin in list(pending):
                start = starts[vin]
                if self.count(vin) - start >= expect and len({e[0] for e in self.entries(vin, start)}) >= expect:
                    pending.discard(vin)
            if pending:
                time.sleep(POLL_S)
        self.check()
        count = 0
        first_seen: dict[tuple[str, str], tuple[float, float]] = {}
        for vin in self.vins:
            new = self.entries(vin, starts[vin])
            count += len(new)
            for rid, t, done in new:
                first_seen.setdefault((vin, rid), (t, done))
        stamps = [t for t, _ in first_seen.values()]
        # Per vehicle: receive → handled (the fleet's part: PUBACK, message.acked RPC), then
        # handled → next receive (the server's part: ack → row delete → next publish → broker).
        per_vin: dict[str, list[tuple[float, float]]] = {}
        for (vin, _), td in first_seen.items():
            per_vin.setdefault(vin, []).append(td)
        cycle, fleet, turn = [], [], []
        for tds in per_vin.values():
            tds.sort()
            fleet += [d - t for t, d in tds]
            for (t0, d0), (t1, _) in itertools.pairwise(tds):
                cycle.append(t1 - t0)
                turn.append(t1 - d0)
        out: dict[str, Any] = {
            "count": count,
            "distinct": len(first_seen),
            "short": len(pending),
            "first": min(stamps, default=0.0),
            "last": max(stamps, default=0.0),
            "last_done": max((d for _, d in first_seen.values()), default=0.0),
            # samples are enough for percentiles
            "cycle": sorted(cycle)[:: max(1, len(cycle) // 500)],
            "fleet": sorted(fleet)[:: max(1, len(fleet) // 500)],
            "turn": sorted(turn)[:: max(1, len(turn) // 500)],
        }
        if cmd.get("times"):
            out["times"] = [[rid, t] for (_, rid), (t, _) in first_seen.items()]
        return out


class _Stamped(list):  # type: ignore[type-arg]
    """Vehicle.received, also noting when each entry was appended (after its hooks ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.done: list[float] = []

    def append(self, item: Any) -> None:
        self.done.append(time.time())
        super().append(item)


class _Answering(_Stamped):
    """A sim vehicle's received log whose append (in the clientid's hook lane, after the PUBACK and
    its message.acked call) first publishes the vehicle's answer when the phase asks for it."""

    def __init__(self, fleet: SimFleet, vehicle: SimulatorVehicle) -> None:
        super().__init__()
        self.fleet = fleet
        self.vehicle = vehicle

    def append(self, item: Any) -> None:
        if self.fleet.respond:
            self.fleet.answer(self.vehicle, item.topic)
        super().append(item)


class SimFleet(Fleet):
    """Vehicles of testkit/emqx_sim.py: our hooks are called as EMQX would call them."""

    def __init__(
        self, vins: list[str], exhook_port: int, mqtt_port: int, delivery_clientid: str, response_bytes: int = 64
    ) -> None:
        super().__init__(vins)
        self.response_bytes = response_bytes
        #: In a phase with `"respond": true` each vehicle answers each request after its PUBACK.
        self.respond = False
        self.answers: Counter[str] = Counter()  # how message.publish answered the responses
        # A node of its own: fleet processes are the nodes of one cluster. Sharing the default
        # name, each process's OnProviderLoaded gave that node another start time, which the
        # server takes for a restart of it (forgetting the sessions the other processes opened).
        self.emqx = FakeEmqx(
            exhook_port, mqtt_port, delivery_clientid=delivery_clientid, node=f"fleet{os.getpid()}@127.0.0.1"
        )
        self.rpc_s: list[float] = []  # round trips of message.acked RPCs, as this process sees them

        def timed(method: str, seconds: float) -> None:
            if method == "OnMessageAcked":
                self.rpc_s.append(seconds)

        self.emqx.on_rpc = timed
        self.emqx.load()
        self.vehicles = {}
        for vin in vins:
            v = self.emqx.vehicle(vin)
            v.received = _Answering(self, v)
            v.connect()
            v.subscribe()
            self.vehicles[vin] = v

    def count(self, vin: str) -> int:
        return len(self.vehicles[vin].received)

    def entries(self, vin: str, start: int) -> list[tuple[str, float, float]]:
        # Received.time is time.time() when the MQTT loop read it, before any hook runs; it is appended
        # once PUBACK and message.acked are done.
        got = self.vehicles[vin].received
        done = got.done  # type: ignore[attr-defined]
        return [(r.topic.rsplit("/", 1)[1], r.time, d) for r, d in zip(got[start:], done[start:], strict=False)]

    def check(self) -> None:
        self.emqx.check()

    def phase(self, cmd: dict[str, Any]) -> dict[str, Any]:
        start = len(self.rpc_s)
        self.respond = bool(cmd.get("respond"))
        before = Counter(self.answers)
        out = super().phase(cmd)
        rpc = sorted(self.rpc_s[start:])
        out["rpc"] = rpc[:: max(1, len(rpc) // 500)]
        out["answers"] = dict(self.answers - before)
        return out

    def answer(self, v: SimulatorVehicle, request_topic: str) -> None:
        """The vehicle's answer to a request: message.publish as EMQX calls it, then routed."""
        conn = v._conn
        if conn is None or conn.state != "open":
            self.answers["vehicle_offline"] += 1
            return
        rid = request_topic.rsplit("/", 1)[1]
        topic = f"{RESPONSE_PREFIX.replace('{VIN}', v.vin)}/{rid}"
        body = json.dumps({"request_id": rid, "result": "ok"})
        payload = (body + " " * max(0, self.response_bytes - len(body))).encode()
        resp, sent = v._publish_now(conn, topic, payload, 1)  # message.publish, as for a heartbeat
        if resp is None:
            self.answers["not_registered_or_failed"] += 1
        else:
            self.answers[pb.ValuedResponse.ResponsedType.Name(resp.type)] += 1
        if sent is not None:
            self.answers["routed"] += 1
            if not sent:
                self.answers["publish_failed"] += 1

    def close(self) -> None:
        self.emqx.close(check=False)


class RawFleet(Fleet):
    """testkit/vehicle.py's vehicles on every prefix's request topics, PUBACKing each message as
    it arrives, then (in a phase with "signal") publishing the ack signal."""

    def __init__(
        self,
        vins: list[str],
        mqtt_port: int,
        prefixes: list[str],
        ack_prefix: str,
        timeout_s: float,
        clientid_prefix: str = "raw-",
    ) -> None:
        super().__init__(vins)
        self.logs: dict[str, list[tuple[str, float, float]]] = {}
        self.signal = False
        self.vehicles = [Vehicle(mqtt_port, vin, clientid=f"{clientid_prefix}{vin}") for vin in vins]
        for v in self.vehicles:
            v.on_delivery = self._on_delivery(v, f"{ack_prefix}/{v.vin}")

        async def online(v: Vehicle) -> None:
            await v.aconnect()
            await v.asubscribe(*(f"{prefix}/{v.vin}/proxy/request/+" for prefix in prefixes))

        async def all_online() -> None:
            await asyncio.gather(*map(online, self.vehicles))

        run_on_loop(all_online(), timeout_s)

    def _on_delivery(self, v: Vehicle, ack_topic: str) -> Callable[[Delivery], None]:
        log = self.logs[v.vin] = []

        def on_delivery(d: Delivery) -> None:  # after its PUBACK (the signal follows it, as ack -> hook)
            if self.signal and v.conn is not None:
                v.conn.publish(ack_topic, d.request_id.encode(), qos=0)  # on the loop: sent at once
            log.append((d.request_id, d.time, time.time()))

        return on_delivery

    def count(self, vin: str) -> int:
        return len(self.logs[vin])

    def entries(self, vin: str, start: int) -> list[tuple[str, float, float]]:
        return self.logs[vin][start:]

    def phase(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.signal = bool(cmd.get("signal"))
        return super().phase(cmd)

    def check(self) -> None:
        lost = [v.vin for v in self.vehicles if not v.connected]
        if lost:
            raise RuntimeError(f"raw fleet: {len(lost)} vehicle(s) disconnected; first: {lost[0]}")

    def close(self) -> None:
        for v in self.vehicles:
            v.close()


# -- the raw reference publisher -----------------------------------------------------------------


class Publisher:
    """One paho client publishing QoS 1 to `<prefix>/<VIN>/proxy/request/<rid>`."""

    def __init__(self, vins: list[str], mqtt_port: int, prefix: str, ack_prefix: str, max_inflight: int) -> None:
        self.vins = vins
        self.prefix = prefix
        self.ack_prefix = ack_prefix
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.reset("a", 0)
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="raw-publisher", protocol=mqtt.MQTTv5)
        c.max_inflight_messages_set(max_inflight)  # as the server's delivery client (mqtt_max_inflight)
        c.max_queued_messages_set(0)
        c.on_connect = lambda *_a: self.connected.set()
        c.on_subscribe = lambda *_a: self.subscribed.set()
        c.on_publish = self._on_publish
        c.on_message = self._on_signal
        c.connect(LOOPBACK, mqtt_port, keepalive=60, clean_start=True)
        c.loop_start()
        self.client = c
        if not self.connected.wait(10):
            raise SystemExit("publisher: no CONNACK")
        c.subscribe(f"{ack_prefix}/+", options=SubscribeOptions(qos=0))
        if not self.subscribed.wait(10):
            raise SystemExit("publisher: no SUBACK")

    def reset(self, mode: str, total: int) -> None:
        self.mode = mode
        self.total = total
        self.pubacks = 0
        self.signals = 0
        self.last_puback = 0.0
        self.last_signal = 0.0
        self.payloads: dict[str, bytes] = {}
        self.queues: dict[str, list[str]] = {}
        self.done.clear()

    def _publish(self, vin: str, rid: str) -> None:
        info = self.client.publish(f"{self.prefix}/{vin}/proxy/request/{rid}", self.payloads[rid], qos=1)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"publish failed: {info.rc}")

    def _finished(self) -> bool:
        if self.pubacks < self.total:
            return False
        return self.mode == "a" or self.signals >= self.total

    def _on_publish(self, _c: Any, _u: Any, _mid: int, _rc: Any, _props: Any) -> None:
        with self.lock:
            self.pubacks += 1
            self.last_puback = time.time()
            if self._finished():
                self.done.set()

    def _on_signal(self, _c: Any, _u: Any, message: mqtt.MQTTMessage) -> None:
        vin = message.topic.rsplit("/", 1)[1]
        with self.lock:
            self.signals += 1
            self.last_signal = time.time()
            queue = self.queues.get(vin)
            nxt = queue.pop() if queue else None
            if self._finished():
                self.done.set()
        if nxt is not None:
            self._publish(vin, nxt)

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        rids: list[str] = cmd["rids"]
        rng = random.Random(cmd.get("seed", 0))
        with self.lock:
            self.reset(cmd["mode"], len(rids) * len(self.vins))
            self.payloads = {rid: rng.randbytes(int(cmd["payload_bytes"])) for rid in rids}
        first = time.time()
        if self.mode == "a":
            # Batch-major, like B batches each naming every VIN; paho's window paces the broker.
            for rid in rids:
                for vin in self.vins:
                    self._publish(vin, rid)
        else:
            with self.lock:
                self.queues = {vin: list(reversed(rids[1:])) for vin in self.vins}  # pop() = oldest
            for vin in self.vins:
                self._publish(vin, rids[0])
        ok = self.done.wait(float(cmd.get("deadline_s", 120)))
        with self.lock:
            return {
                "ok": ok,
                "first": first,
                "published": self.total,
                "pubacks": self.pubacks,
                "signals": self.signals,
                "last_puback": self.last_puback,
                "last_signal": self.last_signal,
            }

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# -- main ------------------------------------------------------------------------------------------


def one_shot(fleet: SimFleet, args: argparse.Namespace) -> int:
    """{"ready": n}, then {"done": {vin: [topic, ...]}, "first", "last"} once every vehicle got
    `--expect` messages (or `--deadline-s` passed); a hook driver error fails the process."""
    try:
        emit({"ready": len(fleet.vehicles)})
        deadline = time.monotonic() + args.deadline_s
        while time.monotonic() < deadline and any(len(v.received) < args.expect for v in fleet.vehicles.values()):
            fleet.check()
            time.sleep(POLL_S)  # a progress poll with a deadline, not synchronisation
        got = {vin: [r.topic for r in v.received] for vin, v in fleet.vehicles.items()}
        stamps = [r.time for v in fleet.vehicles.values() for r in v.received]
        emit({"done": got, "first": min(stamps, default=0), "last": max(stamps, default=0)})
    finally:
        fleet.emqx.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("sim", "raw", "pub"), default="sim")
    p.add_argument("--mqtt-port", type=int, required=True)
    p.add_argument("--vins", required=True, help="comma-separated")
    p.add_argument("--exhook-port", type=int, default=0)
    p.add_argument("--delivery-clientid", default="")
    p.add_argument("--response-bytes", type=int, default=64, help="sim fleets: size of a vehicle's answer")
    p.add_argument(
        "--prefix",
        default="refer",
        help="raw topics: <prefix>/<VIN>/proxy/request/<rid> (raw fleets: comma-separated, each)",
    )
    p.add_argument("--clientid-prefix", default="raw-", help="raw fleets: clientid = <this><VIN>")
    p.add_argument("--ack-prefix", default="refer-ack")
    p.add_argument("--max-inflight", type=int, default=50)
    p.add_argument("--timeout-s", type=float, default=120)
    p.add_argument("--expect", type=int, default=0, help="sim: one shot, report once each vehicle got this many")
    p.add_argument("--deadline-s", type=float, default=300, help="sim one shot: report by then at the latest")
    args = p.parse_args()
    vins = args.vins.split(",")
    worker: Any
    if args.role == "sim" and args.expect:
        return one_shot(SimFleet(vins, args.exhook_port, args.mqtt_port, args.delivery_clientid), args)
    if args.role == "sim":
        worker = SimFleet(vins, args.exhook_port, args.mqtt_port, args.delivery_clientid, args.response_bytes)
    elif args.role == "raw":
        prefixes = args.prefix.split(",")
        worker = RawFleet(vins, args.mqtt_port, prefixes, args.ack_prefix, args.timeout_s, args.clientid_prefix)
    else:
        worker = Publisher(vins, args.mqtt_port, args.prefix, args.ack_prefix, args.max_inflight)
    try:
        emit({"ready": len(vins)})
        for cmd in commands():
            if cmd["cmd"] == "phase" and isinstance(worker, Fleet):
                emit({"done": worker.phase(cmd)})
            elif cmd["cmd"] == "run" and isinstance(worker, Publisher):
                emit({"done": worker.run(cmd)})
            else:
                raise SystemExit(f"unknown command for {args.role}: {cmd}")
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
