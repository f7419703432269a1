"""A receive-only MQTT 5 client on the server's event loop, for our member of the events group.

It connects (clean start, our username, password and TLS settings), subscribes to the given
filters, hands each PUBLISH to `on_message(topic, payload)` while reading, and PUBACKs a QoS 1
message after the callback returned (one write per read). No thread, no queue: TCP holds the
broker back while we are busy. PINGREQ every keepalive; a link silent for 1.5 keepalives, a
packet we cannot parse or one larger than `MAX_PACKET_BYTES` (announced to the broker as our
Maximum Packet Size) ends the connection. `run` reconnects with backoff until cancelled.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import Callable
from typing import Any

import structlog

from exhook_server import paho_tls
from exhook_server.config import Config

log = structlog.get_logger("sdv_fanout.subscriber")

#: The largest packet the broker may send us (MQTT 5 Maximum Packet Size): it bounds our buffer.
MAX_PACKET_BYTES = 4 << 20
#: Unacknowledged QoS 1 messages the broker may send us at once (MQTT 5 Receive Maximum).
RECEIVE_MAXIMUM = 256
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0
_CONNECT, _CONNACK, _PUBLISH, _PUBACK, _SUBSCRIBE, _SUBACK = 0x10, 0x20, 0x30, 0x40, 0x82, 0x90
_DISCONNECT = 0xE0
_PINGREQ_PACKET, _DISCONNECT_PACKET = b"\xc0\x00", b"\xe0\x00"

#: `on_message(topic, payload)`.
MessageCallback = Callable[[str, bytes], None]


class ProtocolError(ValueError):
    """The broker sent what this client does not take: the connection ends."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, byte = divmod(n, 128)
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(value, position after it), None when it is not complete; ProtocolError past 4 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 4, end)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    if end - pos >= 4:
        raise ProtocolError("variable byte integer longer than 4 bytes")
    return None


def _text(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("!H", len(raw)) + raw


def connect_packet(clientid: str, username: str, password: str, keepalive_s: int) -> bytes:
    """CONNECT, MQTT 5, clean start, with Receive Maximum and Maximum Packet Size."""
    flags = 0x02 | (0x80 if username else 0) | (0x40 if password else 0)
    props = b"\x21" + struct.pack("!H", RECEIVE_MAXIMUM) + b"\x27" + struct.pack("!I", MAX_PACKET_BYTES)
    body = _text("MQTT") + bytes([5, flags]) + struct.pack("!H", keepalive_s) + _varint(len(props)) + props
    body += _text(clientid) + (_text(username) if username else b"") + (_text(password) if password else b"")
    return bytes([_CONNECT]) + _varint(len(body)) + body


def subscribe_packet(packet_id: int, filters: list[tuple[str, int]]) -> bytes:
    body = struct.pack("!H", packet_id) + b"\x00" + b"".join(_text(f) + bytes([qos]) for f, qos in filters)
    return bytes([_SUBSCRIBE]) + _varint(len(body)) + body


class _Link(asyncio.Protocol):
    """One connection: the packets in, PUBACKs and PINGREQs out."""

    def __init__(self, owner: Subscriber) -> None:
        self._owner = owner
        self._buf = b""
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.heard = asyncio.get_running_loop().time()
        self.subscribed = False
        self._paused = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        o = self._owner
        transport.write(connect_packet(o.clientid, o.username, o.password, o.keepalive_s))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.heard = loop.time()
        if self._owner.gather_s and self.transport is not None and not self._paused:
            # Read again only after the gathering window: what arrives meanwhile waits in the
            # socket and is handled in one wake-up (each heartbeat its own wake-up cost more).
            self._paused = True
            self.transport.pause_reading()
            loop.call_later(self._owner.gather_s, self._resume)
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        acks: list[bytes] = []
        try:
            while end - pos >= 2:
                head = _read_varint(buf, pos + 1, end)
                if head is None:
                    break
                length, start = head
                if length > MAX_PACKET_BYTES:
                    raise ProtocolError(f"packet of {length} bytes")
                if start + length > end:
                    break
                ack = self._packet(buf[pos], buf[start : start + length])
                if ack:
                    acks.append(ack)
                pos = start + length
        except (ProtocolError, IndexError, struct.error, UnicodeDecodeError) as exc:
            log.error("events_protocol_error", clientid=self._owner.clientid, error=str(exc))
            self.abort()
            return
        finally:
            if acks and self.transport is not None:
                self.transport.write(b"".join(acks))
        self._buf = buf[pos:]

    def _packet(self, kind: int, body: bytes) -> bytes:
        """Handle one packet; what to write back (a PUBACK) or b""."""
        t = kind & 0xF0
        if t == _PUBLISH:
            n = struct.unpack_from("!H", body)[0]
            topic = body[2 : 2 + n].decode()
            pos = 2 + n
            qos = (kind >> 1) & 0x03
            packet_id = body[pos : pos + 2] if qos else b""
            props = _read_varint(body, pos + len(packet_id), len(body))
            if props is None:
                raise ProtocolError("PUBLISH without its properties")
            self._owner.on_message(topic, body[props[1] + props[0] :])
            return b"\x40\x02" + packet_id if qos == 1 else b""
        if t == _CONNACK:
            if body[1] >= 0x80:
                log.error("events_connect_refused", clientid=self._owner.clientid, reason=hex(body[1]))
                self.abort()
            elif self.transport is not None:
                self.transport.write(subscribe_packet(1, self._owner.filters))
        elif t == _SUBACK:
            props = _read_varint(body, 2, len(body))
            codes = body[props[1] + props[0] :] if props else b""
            filters = self._owner.filters
            refused = [f for (f, _), code in zip(filters, codes, strict=False) if code >= 0x80]
            if refused or len(codes) != len(filters):
                log.error("events_subscribe_refused", clientid=self._owner.clientid, topics=refused, hint="ACL")
            else:
                self.subscribed = True
                self._owner.on_state(True)
        elif t == _DISCONNECT:
            log.warning("events_disconnected_by_broker", clientid=self._owner.clientid, reason=body[:1].hex())
            self.abort()
        return b""

    def _resume(self) -> None:
        self._paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def ping(self) -> None:
        if self.transport is not None:
            self.transport.write(_PINGREQ_PACKET)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def disconnect(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_DISCONNECT_PACKET)
            self.transport.close()


class Subscriber:
    """Keeps one subscription up until `run` is cancelled; `on_state(up)` when it is (re)made or lost."""

    def __init__(
        self,
        cfg: Config,
        clientid: str,
        filters: list[tuple[str, int]],
        on_message: MessageCallback,
        on_state: Callable[[bool], None] = lambda up: None,
        gather_s: float = 0.0,
    ) -> None:
        self.clientid = clientid
        #: After a read, wait this long before the next (0: read at once), see `_Link.data_received`.
        self.gather_s = gather_s
        self.filters = filters
        self.on_message = on_message
        self.on_state = on_state
        self.username, self.password = cfg.mqtt_username, cfg.mqtt_password
        self.keepalive_s = cfg.mqtt_keepalive_s
        self._host, self._port, tls = paho_tls.broker(cfg)
        self._ssl = ssl.create_default_context(cafile=cfg.mqtt_ca_file or None) if tls else None

    async def run(self) -> None:
        """Connect, serve, reconnect with backoff; on cancel a DISCONNECT."""
        loop = asyncio.get_running_loop()
        delay = _RETRY_FIRST_S
        while True:
            link: _Link | None = None
            try:
                _, link = await loop.create_connection(
                    lambda: _Link(self), self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl else None,
                )  # fmt: skip
                await self._serve(link)
            except asyncio.CancelledError:
                if link is not None:
                    link.disconnect()
                raise
            except OSError as exc:
                log.warning("events_connect_failed", host=self._host, port=self._port, error=str(exc), retry_s=delay)
            if link is not None and link.subscribed:
                delay = _RETRY_FIRST_S
                self.on_state(False)
                log.warning("events_link_lost", clientid=self.clientid, retry_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    async def _serve(self, link: _Link) -> None:
        """Until the link closes: PINGREQ every keepalive, and close it when the broker went silent."""
        loop = asyncio.get_running_loop()
        every = max(1, self.keepalive_s)
        while not link.closed.done():
            await asyncio.wait([link.closed], timeout=every)
            if link.closed.done():
                return
            if loop.time() - link.heard > 1.5 * every:
                log.warning("events_broker_silent", clientid=self.clientid, silent_s=round(loop.time() - link.heard))
                link.abort()
                return
            link.ping()
