"""The vehicle of tests, benches and the demo, on a real broker (EMQX or mosquitto), written once.

clientid = username = VIN; it subscribes to `agent/<VIN>/proxy/request/+` at QoS 1 and records
every delivery in arrival order (redeliveries included); it PUBACKs each at once, `hold_s` after
it arrived, or not until `ack_held()` (auto_ack False); it heartbeats on `ecp/<VIN>/<kind>` and
answers on `agent/<VIN>/proxy/response/<request_id>`. session_expiry_s > 0 keeps its session, which
`connect(clean_start=False)` resumes. Each connect is a new TCP connection; `drop()` loses the
network (no DISCONNECT). All vehicles of a process share one asyncio loop (testkit/mqtt.py's
Client): the blocking methods are for other threads, the `a`-prefixed coroutines for code on a loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from testkit import mqtt
from testkit.mqtt import TIMEOUT_S, HasMqttPort, MqttError, run

REQUEST_PREFIX = "agent/{VIN}/proxy/request"
#: The server's default response_topic_prefix: a vehicle answers on `<prefix>/<request_id>`.
RESPONSE_PREFIX = "agent/{VIN}/proxy/response"


class Delivery(mqtt.Message):
    """One PUBLISH a vehicle received."""

    @property
    def request_id(self) -> str:
        return self.topic.rsplit("/", 1)[-1]


class Vehicle(mqtt.Client):
    """One vehicle; `unacked` holds the deliveries of its last connection not PUBACKed yet (until
    the next connect)."""

    received: list[Delivery]  # type: ignore[assignment]

    def __init__(
        self,
        broker: int | HasMqttPort,
        vin: str,
        *,
        clientid: str | None = None,
        username: str | None = None,
        hold_s: float = 0.0,
        auto_ack: bool = True,
        session_expiry_s: int = 0,
        request_prefix: str = REQUEST_PREFIX,
        keepalive_s: int = 60,
    ) -> None:
        super().__init__(
            broker,
            clientid or vin,
            username=vin if username is None else username,  # "": none sent
            keepalive_s=keepalive_s,
            session_expiry_s=session_expiry_s,
        )
        self.vin = vin
        self.hold_s = hold_s
        self.auto_ack = auto_ack
        self.request_prefix = request_prefix.replace("{VIN}", vin)
        self.unacked: list[tuple[mqtt.Connection, Delivery]] = []
        #: (delivery, time.time() just before its PUBACK went out), in PUBACK order.
        self.acks: list[tuple[Delivery, float]] = []
        self.max_unacked = 0
        #: Called on the loop for each delivery, after its PUBACK if that went out at once.
        self.on_delivery: Callable[[Delivery], None] | None = None
        self._dropped: mqtt.Connection | None = None

    @property
    def request_filter(self) -> str:
        """`agent/<VIN>/proxy/request/+`."""
        return self.request_prefix + "/+"

    @property
    def persistent(self) -> bool:
        """Does the session outlive the connection (Session-Expiry-Interval > 0)?"""
        return self.session_expiry_s > 0

    def request_ids(self) -> list[str]:
        """The request ids received, in arrival order (redeliveries included)."""
        return [d.request_id for d in list(self.received)]

    # -- on the loop -------------------------------------------------------------------------------
    async def aconnect(self, clean_start: bool = True) -> bool:
        self.unacked.clear()
        return await super().aconnect(clean_start)

    async def asubscribe(self, *filters: str, qos: int = 1, check: bool = True) -> list[int]:
        """One SUBSCRIBE (default: the request filter); the SUBACK's reason codes (raises on a
        refused one if `check`)."""
        codes = await super().asubscribe(*(filters or (self.request_filter,)), qos=qos)
        if check and any(c >= 0x80 for c in codes):
            raise MqttError(f"{self.clientid}: SUBACK {codes}")
        return codes

    async def aonline(self) -> None:
        """Connected (clean start) and subscribed to the request filter."""
        await self.aconnect()
        await self.asubscribe()

    async def aheartbeat(self, kind: str = "online", qos: int = 1, timeout_s: float = TIMEOUT_S) -> int | None:
        """Publish `ecp/<VIN>/<kind>`; at QoS 1 the PUBACK's reason code (EMQX ran the hook by then)."""
        return await self.apublish(f"ecp/{self.vin}/{kind}", b"{}", qos, timeout_s)

    def _on_message(self, conn: mqtt.Connection, m: mqtt.Message) -> None:
        if conn is self._dropped:
            return  # a connection we are losing: as if the network had already gone
        d = Delivery(*m)
        self.received.append(d)
        if m.qos:
            self.unacked.append((conn, d))
            self.max_unacked = max(self.max_unacked, len(self.unacked))
            if self.auto_ack and self.hold_s > 0:
                conn.loop.call_later(self.hold_s, self._ack, conn, d)
            elif self.auto_ack:
                self._ack(conn, d)
        if self.on_delivery is not None:
            self.on_delivery(d)

    def _ack(self, conn: mqtt.Connection, d: Delivery) -> bool:
        if (conn, d) not in self.unacked or conn is self._dropped:
            return False  # acked already, or its connection is gone: the session (if any) redelivers
        self.unacked.remove((conn, d))
        t = time.time()
        if not conn.puback(d.pid):
            return False
        self.acks.append((d, t))
        return True

    async def _ack_held(self) -> int:
        return sum(self._ack(conn, d) for conn, d in list(self.unacked))

    async def _close_then(self, close: Callable[[mqtt.Connection], None], timeout_s: float) -> None:
        conn = self._require()
        close(conn)
        await asyncio.wait([conn.closed], timeout=timeout_s)
        await self._abort()

    # -- blocking, from any other thread -------------------------------------------------------------
    def subscribe(self, *filters: str, qos: int = 1, check: bool = True) -> list[int]:
        """SUBSCRIBE (default: the request filter) and wait for the SUBACK; its reason codes."""
        return run(self.asubscribe(*filters, qos=qos, check=check), TIMEOUT_S + 1)

    def reconnect(self, clean_start: bool) -> bool:
        """Connect again on a new TCP connection: the broker resumes the session or starts clean."""
        return self.connect(clean_start=clean_start)

    def heartbeat(self, kind: str = "online", *, qos: int = 1, timeout_s: float = TIMEOUT_S) -> int | None:
        """Publish `ecp/<VIN>/<kind>`; at QoS 1 wait for its PUBACK (EMQX ran the hook by then)."""
        return run(self.aheartbeat(kind, qos, timeout_s), timeout_s + 1)

    def respond(self, request_id: str, payload: bytes) -> int | None:
        """The answer to `request_id` on `agent/<VIN>/proxy/response/<request_id>`, QoS 1, PUBACKed."""
        return self.publish(RESPONSE_PREFIX.replace("{VIN}", self.vin) + "/" + request_id, payload)

    def ack_held(self) -> int:
        """PUBACK every delivery of the current connection not PUBACKed yet; returns how many."""
        return run(self._ack_held(), TIMEOUT_S)

    def drop(self, timeout_s: float = TIMEOUT_S) -> None:
        """Lose the network: TCP FIN without DISCONNECT, then wait (bounded) until the broker closed
        its side too, i.e. it noticed. What was not PUBACKed stays with the broker's session."""

        def half_close(conn: mqtt.Connection) -> None:
            self._dropped = conn
            conn.half_close()

        run(self._close_then(half_close, timeout_s), timeout_s + 1)

    def disconnect(self, timeout_s: float = TIMEOUT_S) -> None:
        """A clean DISCONNECT; returns once the connection is closed (bounded)."""
        run(self._close_then(mqtt.Connection.disconnect, timeout_s), timeout_s + 1)


class Fleet:
    """Vehicles of one broker; `close()` closes every one (no DISCONNECT)."""

    def __init__(self, broker: int | HasMqttPort) -> None:
        self.broker = broker
        self.vehicles: list[Vehicle] = []

    def vehicle(self, vin: str, **kw: Any) -> Vehicle:
        """A new vehicle (not connected yet)."""
        v = Vehicle(self.broker, vin, **kw)
        self.vehicles.append(v)
        return v

    def online(self, vins: list[str], **kw: Any) -> list[Vehicle]:
        """New vehicles, connected and subscribed to their request filter (all at once)."""
        vehicles = [self.vehicle(vin, **kw) for vin in vins]

        async def all_online() -> None:
            await asyncio.gather(*(v.aonline() for v in vehicles))

        run(all_online(), TIMEOUT_S * 2 + len(vins) * 0.01)
        return vehicles

    def close(self) -> None:
        for v in self.vehicles:
            v.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
