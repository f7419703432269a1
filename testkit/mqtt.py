"""A small MQTT 5 client on asyncio: thousands of connections on one loop, PUBACKs sent by hand.

`connect()` opens one `Connection` and returns it after a granted CONNACK (session-present kept);
SUBACKs and PUBACKs come back as futures of their reason codes; each PUBLISH received goes to
`on_message` on the loop and is acknowledged only by `puback()`. `Client` is one client's
connection on the process's one shared loop thread, driven from other threads (its `a`-coroutines
from code on a loop). It sends QoS 0/1 only, and no will, AUTH or topic alias (no client of ours
uses them); keepalive PINGREQs are sent.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple, Protocol, TypeVar

LOOPBACK = "127.0.0.1"
TIMEOUT_S = 10.0  # a CONNACK, SUBACK or PUBACK, or the broker closing a connection we half-closed
T = TypeVar("T")

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK = 0x10, 0x20, 0x30, 0x40, 0x82, 0x90
PINGREQ, DISCONNECT = b"\xc0\x00", 0xE0
#: Property id -> its encoding (MQTT 5 §2.2.2.2): 1/2/4-byte integer, varint "v", string/binary "s",
#: string pair "p".
_PROPERTY: dict[int, int | str] = {
    0x01: 1, 0x02: 4, 0x03: "s", 0x08: "s", 0x09: "s", 0x0B: "v", 0x11: 4, 0x12: "s", 0x13: 2, 0x15: "s",
    0x16: "s", 0x17: 1, 0x18: 4, 0x19: 1, 0x1A: "s", 0x1C: "s", 0x1F: "s", 0x21: 2, 0x22: 2, 0x23: 2,
    0x24: 1, 0x25: 1, 0x26: "p", 0x27: 4, 0x28: 1, 0x29: 1, 0x2A: 1,
}  # fmt: skip
MESSAGE_EXPIRY, SESSION_EXPIRY = 0x02, 0x11


class MqttError(RuntimeError):
    """A refused CONNACK, a connection closed under a pending request, a packet we cannot read."""


class Message(NamedTuple):
    """One PUBLISH received: `pid` is 0 at QoS 0; `expiry_s` its Message-Expiry-Interval (None: it
    had none); `time` is time.time() when it was read."""

    topic: str
    payload: bytes
    qos: int
    dup: bool
    pid: int
    expiry_s: int | None
    time: float


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("!H", len(raw)) + raw


def _packet(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + _varint(len(body)) + body


def _properties(buf: bytes, pos: int) -> tuple[dict[int, Any], int]:
    """The property block at `pos`: {id: value} (integers as int, strings as bytes) and where it ends."""
    length, pos = _read_varint(buf, pos)
    end, out = pos + length, dict[int, Any]()
    while pos < end:
        pid, kind = buf[pos], _PROPERTY.get(buf[pos])
        pos += 1
        if isinstance(kind, int):
            out[pid], pos = int.from_bytes(buf[pos : pos + kind], "big"), pos + kind
        elif kind == "v":
            out[pid], pos = _read_varint(buf, pos)
        elif kind in ("s", "p"):
            for _ in range(2 if kind == "p" else 1):
                n = struct.unpack_from("!H", buf, pos)[0]
                out[pid], pos = buf[pos + 2 : pos + 2 + n], pos + 2 + n
        else:
            raise MqttError(f"unknown MQTT 5 property 0x{pid:02x}")
    return out, end


class Connection(asyncio.Protocol):
    """One MQTT 5 connection; every method and callback runs on the loop that opened it."""

    def __init__(
        self,
        clientid: str,
        username: str,
        clean_start: bool,
        keepalive_s: int,
        session_expiry_s: int,
        on_message: Callable[[Connection, Message], None],
    ) -> None:
        self.clientid = clientid
        self._connect = (username, clean_start, keepalive_s, session_expiry_s)
        self.loop = asyncio.get_running_loop()
        #: (session present, CONNACK reason code)
        self.connack: asyncio.Future[tuple[bool, int]] = self.loop.create_future()
        #: The CONNACK's properties, {id: value} (set before `connack` is done).
        self.connack_props: dict[int, Any] = {}
        self.closed: asyncio.Future[None] = self.loop.create_future()
        #: Called for each PUBLISH received, from the first one on (a resumed session's come right
        #: behind the CONNACK); at QoS 1 PUBACK it with `puback(message.pid)`.
        self.on_message = on_message
        #: The reason code of the server's DISCONNECT (e.g. 0x8E: session taken over), if one came.
        self.disconnect_reason: int | None = None
        self.transport: asyncio.Transport | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}  # packet id -> SUBACK codes / PUBACK code
        self._pid = 0
        self._buf = b""
        self._ping: asyncio.TimerHandle | None = None

    @property
    def session_present(self) -> bool:
        return self.connack.done() and self.connack.result()[0]

    @property
    def is_closed(self) -> bool:
        return self.closed.done()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        username, clean_start, keepalive_s, expiry_s = self._connect
        props = bytes([SESSION_EXPIRY]) + struct.pack("!I", expiry_s) if expiry_s else b""
        flags = (0x02 if clean_start else 0) | (0x80 if username else 0)
        body = _s("MQTT") + bytes([5, flags]) + struct.pack("!H", keepalive_s) + _varint(len(props)) + props
        transport.write(_packet(CONNECT, body + _s(self.clientid) + (_s(username) if username else b"")))
        if keepalive_s:
            self._schedule_ping(keepalive_s)

    def _schedule_ping(self, every_s: int) -> None:
        def ping() -> None:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(PINGREQ)
                self._schedule_ping(every_s)

        self._ping = self.loop.call_later(every_s, ping)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ping is not None:
            self._ping.cancel()
        lost = MqttError(f"{self.clientid}: connection closed ({exc or 'by the broker'})")
        for fut in [self.connack, *self._pending.values()]:
            if not fut.done():
                fut.set_exception(lost)
                fut.exception()  # nobody may wait for it any more: no "never retrieved" warning
        self._pending.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data
        pos = 0
        while pos + 2 <= len(buf):
            try:
                length, start = _read_varint(buf, pos + 1)
            except IndexError:
                break  # the length itself is incomplete
            if start + length > len(buf):
                break
            self._handle(buf[pos], buf[start : start + length])
            pos = start + length
        self._buf = buf[pos:]

    def _handle(self, kind: int, body: bytes) -> None:
        t = kind & 0xF0
        if t == PUBLISH:
            n = struct.unpack_from("!H", body)[0]
            topic, pos, qos = body[2 : 2 + n].decode(), 2 + n, (kind >> 1) & 3
            pid = 0
            if qos:
                pid, pos = struct.unpack_from("!H", body, pos)[0], pos + 2
            props, pos = _properties(body, pos)
            expiry = props.get(MESSAGE_EXPIRY)
            self.on_message(self, Message(topic, body[pos:], qos, bool(kind & 0x08), pid, expiry, time.time()))
        elif t == PUBACK:
            self._resolve(struct.unpack_from("!H", body)[0], body[2] if len(body) > 2 else 0)
        elif t == SUBACK:
            _, pos = _properties(body, 2)
            self._resolve(struct.unpack_from("!H", body)[0], list(body[pos:]))
        elif t == CONNACK and not self.connack.done():
            self.connack_props = _properties(body, 2)[0] if len(body) > 2 else {}
            self.connack.set_result((bool(body[0] & 1), body[1]))
        elif t == DISCONNECT:
            self.disconnect_reason = body[0] if body else 0

    def _resolve(self, pid: int, value: Any) -> None:
        fut = self._pending.pop(pid, None)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def _send(self, packet: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise MqttError(f"{self.clientid} is not connected")
        self.transport.write(packet)

    def _next_pid(self) -> int:
        while True:
            self._pid = self._pid % 65535 + 1
            if self._pid not in self._pending:
                return self._pid

    def subscribe(self, filters: list[tuple[str, int]]) -> asyncio.Future[list[int]]:
        """One SUBSCRIBE of (filter, QoS) pairs: a future of the SUBACK's reason codes, in order."""
        pid = self._next_pid()
        body = struct.pack("!H", pid) + b"\x00" + b"".join(_s(f) + bytes([qos]) for f, qos in filters)
        self._send(_packet(SUBSCRIBE, body))
        fut: asyncio.Future[list[int]] = self.loop.create_future()
        self._pending[pid] = fut
        return fut

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> asyncio.Future[int] | None:
        """PUBLISH at QoS 0 (None) or 1 (a future of the PUBACK's reason code)."""
        pid = self._next_pid() if qos else 0
        head = _s(topic) + (struct.pack("!H", pid) if qos else b"") + b"\x00"
        self._send(_packet(PUBLISH | qos << 1, head + payload))
        if not qos:
            return None
        fut: asyncio.Future[int] = self.loop.create_future()
        self._pending[pid] = fut
        return fut

    def puback(self, pid: int) -> bool:
        """PUBACK a QoS 1 message received; False if the connection is already closing."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(bytes([PUBACK, 2]) + struct.pack("!H", pid))
        return True

    def disconnect(self) -> None:
        """A clean DISCONNECT, then the socket closes once it is sent."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(bytes([DISCONNECT, 0]))
            self.transport.close()

    def half_close(self) -> None:
        """TCP FIN without DISCONNECT (a network lost): the broker notices and closes its side."""
        if self.transport is not None and not self.transport.is_closing() and self.transport.can_write_eof():
            self.transport.write_eof()

    def abort(self) -> None:
        """Close the socket now, nothing more sent."""
        if self.transport is not None:
            self.transport.abort()


async def connect(
    port: int,
    clientid: str,
    *,
    host: str = LOOPBACK,
    username: str = "",
    clean_start: bool = True,
    keepalive_s: int = 0,
    session_expiry_s: int = 0,
    on_message: Callable[[Connection, Message], None] = lambda _c, _m: None,
) -> Connection:
    """A new connection whose CONNACK granted it (else MqttError, the socket closed)."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(
        lambda: Connection(clientid, username, clean_start, keepalive_s, session_expiry_s, on_message), host, port
    )
    try:
        _, code = await conn.connack
    except BaseException:
        conn.abort()
        raise
    if code >= 0x80:
        conn.abort()
        raise MqttError(f"{clientid}: CONNACK refused, reason 0x{code:02x}")
    return conn


_shared: asyncio.AbstractEventLoop | None = None
_shared_lock = threading.Lock()


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for blocking callers, run by a daemon thread started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="mqtt-loop", daemon=True).start()
            _shared = loop
        return _shared


def run(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Run `coro` on the shared loop and wait for its result (TimeoutError after `timeout_s`, the
    coroutine cancelled). Never call it from the shared loop's own thread."""
    fut = asyncio.run_coroutine_threadsafe(coro, shared_loop())
    try:
        return fut.result(timeout_s)
    except TimeoutError:
        fut.cancel()
        raise


class HasMqttPort(Protocol):
    @property
    def mqtt_port(self) -> int: ...


class Client:
    """A client whose connection lives on the shared loop: QoS 1 messages it receives are recorded
    and PUBACKed at once (a subclass decides otherwise in `_on_message`). Each connect is a new TCP
    connection; the previous one is closed without DISCONNECT."""

    def __init__(
        self,
        broker: int | HasMqttPort,
        clientid: str,
        *,
        username: str = "",
        keepalive_s: int = 60,
        session_expiry_s: int = 0,
    ) -> None:
        self.port = broker if isinstance(broker, int) else broker.mqtt_port
        self.clientid = clientid
        self.username = username
        self.keepalive_s = keepalive_s
        self.session_expiry_s = session_expiry_s
        self.received: list[Message] = []
        self.conn: Connection | None = None

    @property
    def connected(self) -> bool:
        """True while the current connection is up."""
        return self.conn is not None and not self.conn.is_closed

    @property
    def disconnect_reason(self) -> int | None:
        """The reason code of the broker's DISCONNECT on the current connection (0x8E: taken over)."""
        return None if self.conn is None else self.conn.disconnect_reason

    def _on_message(self, conn: Connection, m: Message) -> None:
        self.received.append(m)
        if m.qos:
            conn.puback(m.pid)

    async def aconnect(self, clean_start: bool = True) -> bool:
        """A new connection (CONNACK awaited); the broker's session-present flag."""
        if self.conn is not None:
            self.conn.abort()
        try:
            self.conn = await connect(
                self.port,
                self.clientid,
                username=self.username,
                clean_start=clean_start,
                keepalive_s=self.keepalive_s,
                session_expiry_s=self.session_expiry_s,
                on_message=self._on_message,
            )
        except OSError as exc:
            raise MqttError(f"{self.clientid}: no connection: {exc}") from exc
        return self.conn.session_present

    async def asubscribe(self, *filters: str, qos: int = 1) -> list[int]:
        """One SUBSCRIBE of the filters: the SUBACK's reason codes."""
        return await self._answer(self._require().subscribe([(f, qos) for f in filters]))

    async def apublish(self, topic: str, payload: bytes, qos: int = 1, timeout_s: float = TIMEOUT_S) -> int | None:
        """Publish; at QoS 1 the PUBACK's reason code (EMQX ran message.publish by then)."""
        fut = self._require().publish(topic, payload, qos)
        if fut is None:
            return None
        return await self._answer(fut, timeout_s)

    async def _answer(self, fut: asyncio.Future[T], timeout_s: float = TIMEOUT_S) -> T:
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError as exc:
            raise MqttError(f"{self.clientid}: no answer from the broker within {timeout_s} s") from exc

    def _require(self) -> Connection:
        if self.conn is None or self.conn.is_closed:
            raise MqttError(f"{self.clientid} is not connected")
        return self.conn

    async def _abort(self) -> None:
        if self.conn is not None:
            self.conn.abort()

    def connect(self, *, clean_start: bool = True) -> bool:
        """A new connection (CONNACK awaited); returns the broker's session-present flag."""
        return run(self.aconnect(clean_start), TIMEOUT_S + 1)

    def subscribe(self, *filters: str, qos: int = 1) -> list[int]:
        """SUBSCRIBE and wait for the SUBACK; its reason codes."""
        return run(self.asubscribe(*filters, qos=qos), TIMEOUT_S + 1)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, timeout_s: float = TIMEOUT_S) -> int | None:
        """Publish; at QoS 1 wait for the PUBACK and return its reason code."""
        return run(self.apublish(topic, payload, qos, timeout_s), timeout_s + 1)

    def close(self) -> None:
        """Close the connection at once (no DISCONNECT, no wait)."""
        run(self._abort(), TIMEOUT_S)


__all__ = ["LOOPBACK", "Client", "Connection", "Message", "MqttError", "connect", "run", "shared_loop"]
