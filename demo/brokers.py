"""The broker side of `make demo`: the real EMQX when a release is at hand, else the simulator.

Either way the demo gets the same things from it: a URL for the server's delivery client, the
ExHook registration, a platform that publishes batches on `$SDV-FANOUT` and cancels on
`$SDV-FANOUT/cancel`, the MQTT port where the
platform's status subscriber (demo/platform.py) connects, the settings for the fleet processes,
and the delivery clients the broker sees connected (counted on the broker's side, so that it does
not matter how many server processes there are or what their pids are).
"""

from __future__ import annotations

import base64
import json
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.emqx_real import (
    EmqxBroker,
    EmqxError,
    EmqxUnavailable,
    available_versions,
    find_release,
    missing_libraries,
    where_looked,
)
from testkit.emqx_sim import LOOPBACK, FakeEmqx, Mosquitto
from testkit.mqtt import Client, MqttError

BATCH_TOPIC = "$SDV-FANOUT"
#: The server's default `cancel_topic`: `{"request_id": R}` ends every pending row of R `cancelled`.
CANCEL_TOPIC = "$SDV-FANOUT/cancel"
#: The server's default `mqtt_clientid_prefix`: every delivery client's id starts with it.
DELIVERY_PREFIX = "sdv-fanout-"
#: The open-source release to use when several are at hand.
PREFERRED_EMQX = "5.8.9"
#: Name of the ExHook server registration in EMQX.
EXHOOK_NAME = "sdv-fanout"
#: How long the platform waits for the broker's PUBACK of a batch.
PUBACK_TIMEOUT_S = 10.0


def batch_payload(vins: list[str], request_id: str, data: str | bytes, **fields: Any) -> bytes:
    """A batch as the platform sends it: `{"ids", "request_id", "data"}`, bytes as base64, and
    its optional `fields` (`batch_id`, `correlation_id`, `await_response`, `expires_at`)."""
    doc: dict[str, Any] = {"ids": vins, "request_id": request_id}
    if isinstance(data, bytes):
        doc.update(data=base64.b64encode(data).decode(), data_encoding="base64")
    else:
        doc["data"] = data
    doc.update(fields)
    return json.dumps(doc).encode()


def cancel_payload(request_id: str, correlation_id: str) -> bytes:
    """A cancel of every pending row of `request_id` (no `ids`: every vehicle)."""
    return json.dumps({"request_id": request_id, "correlation_id": correlation_id}).encode()


class Broker(Protocol):
    """What the demo needs from its broker, real or simulated."""

    #: "emqx" or "sim".
    kind: str

    @property
    def url(self) -> str: ...

    @property
    def mqtt_port(self) -> int:
        """Where an MQTT client of the broker connects (on LOOPBACK): the status subscriber does."""
        ...

    def start(self) -> None: ...

    def describe(self) -> list[str]:
        """Start-up lines: the broker, its address and where its logs are."""
        ...

    def delivery_clients(self) -> list[str]:
        """Client ids starting with DELIVERY_PREFIX that the broker has seen connected."""
        ...

    def attach(self, exhook_port: int) -> list[str]:
        """Make the broker call the server's hooks; returns the hooks the server asked for."""
        ...

    def publish(self, topic: str, payload: bytes) -> None:
        """Publish one platform message at QoS 1 on BATCH_TOPIC or CANCEL_TOPIC; returns once the
        broker has taken it, i.e. the server's hook answered (raises if not). Stored or rejected,
        the answer is the same: only the status topic tells them apart."""
        ...

    def fleet_spec(self, delivery_clientid: str) -> dict[str, Any]:
        """The broker part of a fleet process's spec (see demo.fleet.FleetWorker)."""
        ...

    def summary(self) -> list[tuple[str, str]]:
        """Extra summary lines from the broker's side."""
        ...

    def errors(self) -> list[str]: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Choice:
    """Which broker the demo runs: `kind` "emqx" (with `version`) or "sim", and why."""

    kind: str
    version: str | None
    why: str


def choose(mode: str, version: str | None = None) -> Choice:
    """`auto`: EMQX when a release is found and can run here (5.8.9 first), else the simulator.
    `emqx`: EMQX or an error saying what is missing. `sim`: the simulator."""
    if mode == "sim":
        return Choice("sim", None, "asked for with --broker sim")
    versions = available_versions()
    want = version or (PREFERRED_EMQX if PREFERRED_EMQX in versions else (versions[-1] if versions else None))
    problem: str | None = None
    if want is None or want not in versions:
        problem = f"no EMQX {want or 'release'} found ({where_looked()})"
    else:
        try:
            release = find_release(want)  # unpacks the tarball the first time (a few seconds)
        except EmqxUnavailable as exc:
            problem = str(exc)
        else:
            missing = missing_libraries(release) if release is not None else []
            if release is None:
                problem = f"no EMQX {want} found ({where_looked()})"
            elif missing:
                problem = f"EMQX {want} needs {', '.join(missing)}, not installed (scripts/bootstrap installs it)"
    if problem is None:
        assert want is not None
        return Choice("emqx", want, "found" if mode == "auto" else "asked for with --broker emqx")
    if mode == "emqx":
        raise EmqxUnavailable(problem)
    return Choice("sim", None, problem)


class SimBroker:
    """mosquitto carries the MQTT; `testkit/emqx_sim.py` (`FakeEmqx`) plays EMQX's ExHook side, here
    for the platform's batches and in every fleet process for its vehicles."""

    kind = "sim"

    def __init__(self, log_dir: Path) -> None:
        self.mosquitto = Mosquitto(log_dir, verbose=False)
        self.platform: FakeEmqx | None = None
        self.exhook_port = 0

    @property
    def url(self) -> str:
        return self.mosquitto.url

    @property
    def mqtt_port(self) -> int:
        return self.mosquitto.port

    def start(self) -> None:
        self.mosquitto.start()

    def describe(self) -> list[str]:
        return [
            f"mosquitto {self.url} (real MQTT), EMQX's ExHook side simulated by testkit/emqx_sim.py",
            f"log {self.mosquitto.log_path}",
        ]

    def delivery_clients(self) -> list[str]:
        return sorted(set(re.findall(rf" as ({re.escape(DELIVERY_PREFIX)}\S+) ", self.mosquitto.log())))

    def attach(self, exhook_port: int) -> list[str]:
        self.exhook_port = exhook_port
        self.platform = FakeEmqx(exhook_port, self.mosquitto.port, strict_rpc=False)
        self.platform.calls = deque(maxlen=1000)  # the harness keeps every request; we need none
        return [h.name for h in self.platform.load().hooks]

    def publish(self, topic: str, payload: bytes) -> None:
        assert self.platform is not None
        resp = self.platform.publish(topic, payload)
        # Stored durably (or rejected) before the answer; STOP_AND_RETURN + allow_publish=false:
        # never routed.
        if resp is None or resp.type != pb.ValuedResponse.STOP_AND_RETURN:
            raise RuntimeError(f"{topic} {payload[:80]!r} was not taken by the server: {resp}")

    def fleet_spec(self, delivery_clientid: str) -> dict[str, Any]:
        return {
            "broker": "sim",
            "mqtt_port": self.mosquitto.port,
            "exhook_port": self.exhook_port,
            "delivery_clientid": delivery_clientid,
        }

    def summary(self) -> list[tuple[str, str]]:
        return []

    def errors(self) -> list[str]:
        if self.platform is None:
            return []
        return [repr(e) for e in self.platform.errors] + [f"rpc {h}: {e!r}" for h, e in self.platform.rpc_errors]

    def stop(self) -> None:
        if self.platform is not None:
            self.platform.close(check=False)
        self.mosquitto.stop()


class EmqxSetup:
    """A real EMQX node (testkit/emqx_real.py) on loopback: vehicles and the platform are its MQTT
    clients, and it calls the server's hooks itself over ExHook."""

    kind = "emqx"

    def __init__(self, version: str, log_dir: Path) -> None:
        self.broker = EmqxBroker(version, log_dir)
        self._platform: Client | None = None
        self._errors: list[str] = []

    @property
    def url(self) -> str:
        return self.broker.url

    @property
    def mqtt_port(self) -> int:
        return self.broker.mqtt_port

    def start(self) -> None:
        self.broker.start()

    def describe(self) -> list[str]:
        b = self.broker
        return [
            f"EMQX {b.version} (real, ExHook {b.protocol}), MQTT {b.url}, REST http://{LOOPBACK}:{b.api_port}/api/v5",
            f"log {b.log_dir}",
        ]

    def delivery_clients(self) -> list[str]:
        page = self.broker.api("GET", f"/clients?like_clientid={DELIVERY_PREFIX}&conn_state=connected&limit=1000")
        return sorted(c["clientid"] for c in page.get("data", []) if c["clientid"].startswith(DELIVERY_PREFIX))

    def attach(self, exhook_port: int) -> list[str]:
        self.broker.register_exhook(EXHOOK_NAME, f"http://{LOOPBACK}:{exhook_port}")
        hooks = self.broker.exhook_hooks(EXHOOK_NAME)
        self._connect_platform()
        return [h["name"] for h in hooks]

    def _connect_platform(self) -> None:
        self._platform = Client(self.broker, "sdv-platform", username="platform")
        try:
            self._platform.connect()
        except MqttError as exc:
            raise EmqxError("the platform's MQTT client could not connect to EMQX") from exc

    def publish(self, topic: str, payload: bytes) -> None:
        assert self._platform is not None
        # EMQX sends the PUBACK after message.publish returned, i.e. after the server's commit.
        rc = self._platform.publish(topic, payload, timeout_s=PUBACK_TIMEOUT_S)
        if rc is None or rc >= 0x80:
            raise RuntimeError(f"{topic} {payload[:80]!r}: EMQX refused it: reason 0x{rc or 0:02x}")

    def fleet_spec(self, delivery_clientid: str) -> dict[str, Any]:
        return {"broker": "emqx", "mqtt_port": self.broker.mqtt_port}

    def summary(self) -> list[tuple[str, str]]:
        try:
            detail = self.broker.api("GET", f"/exhooks/{EXHOOK_NAME}")
        except (EmqxError, OSError) as exc:
            return [("EMQX ExHook", f"metrics unavailable: {exc}")]
        m = detail.get("metrics", {})
        failed = m.get("failed", 0)
        if failed:
            self._errors.append(f"EMQX counted {failed} failed ExHook calls")
        return [("EMQX ExHook", f"{m.get('succeed', 0):,} hook calls answered, {failed:,} failed (EMQX's own count)")]

    def errors(self) -> list[str]:
        return list(self._errors)

    def stop(self) -> None:
        if self._platform is not None:
            self._platform.close()
        self.broker.stop()


def make_broker(choice: Choice, log_dir: Path) -> SimBroker | EmqxSetup:
    """The chosen broker, not started yet (its logs go to `log_dir`)."""
    if choice.kind == "emqx":
        assert choice.version is not None
        return EmqxSetup(choice.version, log_dir)
    return SimBroker(log_dir)
