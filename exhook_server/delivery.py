"""Publishes deliveries to the broker over MQTT 5 (paho-mqtt 2.x); the only publisher of deliveries.

paho's socket lives on the server's event loop (only the blocking part of connecting runs in a
thread, retried with backoff until the broker answers); `publish` never blocks: beyond the in-flight
window a delivery waits in our queue. Connection changes reach dispatch through `on_state`. A
delivery the broker refuses (PUBACK reason >= 0x80, or the link dropping while it was unacknowledged)
is sent again only alone, and after `delivery_max_refusals` its row ends failed, so one delivery
cannot cost every vehicle its link. With `ack_topic_prefix` it also receives the vehicles' PUBACKs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, cast

import paho.mqtt.client as mqtt
import structlog
from paho.mqtt import _packet as paho_packet
from paho.mqtt.client import CallbackOnPublish_v2
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from exhook_server import paho_tls
from exhook_server.config import Config
from exhook_server.topics import RequestTopics
from storage.model import now_ms

log = structlog.get_logger("sdv_fanout.delivery")

#: Reconnect backoff: doubles from the first delay to the last; a link that was up starts over.
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0
#: How often paho's keepalive bookkeeping runs (PINGREQ due, PINGRESP overdue).
_HOUSEKEEPING_S = 1.0
#: How long `stop` waits for the DISCONNECT to be written.
_STOP_TIMEOUT_S = 5.0
#: Blamed deliveries remembered at most (least recently blamed forgotten first): forgetting one
#: only means it may be blamed again from zero.
_SUSPECTS_MAX = 10_000

#: `on_refused(vin, request_id, reason, final)`: the broker refused this delivery; `final` once
#: it has been refused `delivery_max_refusals` times.
RefusedCallback = Callable[[str, str, str, bool], None]
#: `on_ack(payload)`: a message arrived on our ack topic (`acks.RuleAcks.received`).
AckCallback = Callable[[bytes], None]
#: What one read from the broker's socket takes at most.
_RECV_BYTES = 1 << 16


#: What a plain PUBACK (reason 0x00, no properties) hands to on_publish: shared, never changed.
_PUBACK_OK = ReasonCode(PacketTypes.PUBACK)
_NO_PROPERTIES = Properties(PacketTypes.PUBACK)  # type: ignore[no-untyped-call]


def expiry_property(seconds: int) -> bytes:
    """PUBLISH properties holding only a Message-Expiry-Interval (id 0x02), length in front."""
    return b"\x05\x02" + struct.pack("!I", seconds)


class _Client(paho_tls.Client):
    """paho's client (pinned: paho-mqtt 2.2.0) with the hot paths of a busy link made cheaper,
    the same bytes on the wire and the same callbacks.

    Per delivery our link carries a PUBLISH out, its PUBACK in and, with rule acks, an ack
    message in and its PUBACK out. paho reads each packet's fixed header a byte at a time,
    writes each packet on its own (a system call per byte or packet), and builds a ReasonCode
    and two Properties objects for every PUBACK and a Properties, message and info object for
    every PUBLISH: together more than half of the server's CPU at a few thousand deliveries a
    second (py-spy). Here one read takes what the socket has and serves paho's small reads from
    it (`buffered` says when more is waiting, as the socket will not signal it again), one write
    takes every queued packet, a plain PUBACK goes to on_publish with shared objects, and a
    QoS 0 or 1 message without properties on `fast_topic` goes to `fast_message(payload)` (at
    QoS 1 before paho PUBACKs it). Anything else takes paho's own path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rbuf = b""
        self._rpos = 0
        #: The topic (UTF-8) whose QoS 1 messages skip paho's decoding, and where they go.
        self.fast_topic = b""
        self.fast_message: Callable[[bytes], None] | None = None
        #: Packet ids of the PUBLISHes `publish_fast` wrote and no PUBACK answered yet.
        self._fast_mids: set[int] = set()

    def _handle_pubackcomp(self, cmd: Any) -> MQTTErrorCode:
        packet = self._in_packet["packet"]
        # Two bytes of packet id, then a reason code 0x00 and a property length 0, or less of
        # them (MQTT 5 §3.4.2): EMQX sends all four bytes.
        if cmd != "PUBACK" or not 2 <= len(packet) <= 4 or any(packet[2:]):
            if cmd == "PUBACK" and len(packet) >= 2 and packet[0] << 8 | packet[1] in self._fast_mids:
                # A refusal (reason >= 0x80) or a PUBACK with properties, of one of ours.
                ack = paho_packet.decode_puback(self._in_packet["command"], packet, self._protocol)
                self._fast_mids.discard(ack.mid)
                return self._fast_published(ack.mid, ack.reason, ack.properties)
            return super()._handle_pubackcomp(cmd)
        mid = packet[0] << 8 | packet[1]
        if mid in self._fast_mids:
            self._fast_mids.discard(mid)
            return self._fast_published(mid, _PUBACK_OK, _NO_PROPERTIES)
        with self._out_message_mutex:
            if mid in self._out_messages:
                return self._do_on_publish(mid, _PUBACK_OK, _NO_PROPERTIES)
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_publish(self) -> MQTTErrorCode:
        packet = self._in_packet["packet"]
        topic = self.fast_topic
        n = len(topic)
        flags = self._in_packet["command"] & 0x0F
        # QoS 0 or 1, not DUP or RETAIN: topic length, topic, (QoS 1: packet id), property
        # length 0, payload.
        at = n + 4 if flags == 0x02 else n + 2
        if (
            self.fast_message is None
            or flags not in (0x00, 0x02)
            or len(packet) < at + 1
            or packet[0] << 8 | packet[1] != n
            or packet[2 : 2 + n] != topic
            or packet[at]
        ):
            return super()._handle_publish()
        self.fast_message(bytes(packet[at + 1 :]))
        if flags == 0x00:
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        return self._send_puback(packet[n + 2] << 8 | packet[n + 3])

    def publish_fast(self, topic: bytes, payload: bytes, properties: bytes = b"\x00") -> int:
        """Queue a QoS 1 PUBLISH built here (no message or info object of paho's): `topic` UTF-8,
        `properties` encoded with their length in front. Its PUBACK reaches on_publish as paho's
        would (mid, reason code, properties); the packet id comes from paho's own counter."""
        mid = self._mid_generate()
        head = struct.pack("!H", len(topic)) + topic + struct.pack("!H", mid) + properties
        self._fast_mids.add(mid)
        packet = self._pack_remaining_length(bytearray((mqtt.PUBLISH | 0x02,)), len(head) + len(payload))
        self._packet_queue(mqtt.PUBLISH, bytes(packet) + head + payload, mid, 1)
        return mid

    def _fast_published(self, mid: int, reason: ReasonCode, properties: Properties) -> MQTTErrorCode:
        on_publish = cast("CallbackOnPublish_v2 | None", self.on_publish)
        if on_publish is not None:
            on_publish(self, self._userdata, mid, reason, properties)
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def linked(self) -> bool:
        """True while the client has a socket (paho's publish would refuse otherwise)."""
        return self._sock is not None

    def buffered(self) -> bool:
        """True while bytes read from the socket are waiting for paho."""
        return self._rpos < len(self._rbuf)

    def _packet_read(self) -> MQTTErrorCode:
        # paho between packets and a whole PUBLISH or PUBACK already read: hand it to the same
        # handler in one step, not through paho's reads of the fixed header a byte at a time.
        buf, pos = self._rbuf, self._rpos
        end = len(buf)
        if self._in_packet["command"] or end - pos < 2 or buf[pos] & 0xF0 not in (mqtt.PUBLISH, mqtt.PUBACK):
            return super()._packet_read()
        length = shift = 0
        at = pos + 1
        while True:  # the remaining length: at most 4 bytes of 7 bits each
            if at >= end or at > pos + 4:
                return super()._packet_read()  # not all here yet (or malformed: paho says so)
            byte = buf[at]
            at += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if at + length > end:
            return super()._packet_read()
        self._rpos = at + length
        packet = self._in_packet  # paho's, between packets: only these fields differ from its reset
        command = packet["command"] = buf[pos]
        packet["packet"] = bytearray(buf[at : at + length])
        packet["remaining_length"] = length
        try:
            rc = self._handle_publish() if command & 0xF0 == mqtt.PUBLISH else self._handle_pubackcomp("PUBACK")
        except MalformedPacket:
            rc = MQTTErrorCode.MQTT_ERR_PROTOCOL
        packet["command"] = 0
        packet["packet"] = bytearray()
        packet["remaining_length"] = 0
        with self._msgtime_mutex:
            self._last_bytes_received = time.monotonic()
        return rc

    def _sock_recv(self, bufsize: int) -> bytes:
        buf, pos = self._rbuf, self._rpos
        if pos >= len(buf):
            buf = super()._sock_recv(max(bufsize, _RECV_BYTES))
            if not buf:
                return buf  # the peer closed: paho sees the end
            pos = 0
        end = min(pos + bufsize, len(buf))
        self._rbuf, self._rpos = buf, end
        return buf[pos:end]

    def _packet_write(self) -> MQTTErrorCode:
        out = self._out_packet
        # paho acts on a written DISCONNECT or QoS 0 PUBLISH (close, callbacks): leave those to it.
        # TLS too: a full socket raises SSLWantWriteError (an OSError, not a BlockingIOError), and
        # OpenSSL wants the retried write to repeat the same bytes, which a fresh join may not.
        if (
            isinstance(self._sock, ssl.SSLSocket)
            or len(out) < 2
            or any(
                p["command"] & 0xF0 == mqtt.DISCONNECT or (p["command"] & 0xF0 == mqtt.PUBLISH and p["qos"] == 0)
                for p in out
            )
        ):
            return super()._packet_write()
        try:
            written = self._sock_send(b"".join(p["packet"][p["pos"] :] for p in out))
        except (AttributeError, ValueError):
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        except BlockingIOError:
            return MQTTErrorCode.MQTT_ERR_AGAIN
        except OSError as exc:
            log.warning("mqtt_write_failed", error=str(exc))
            return MQTTErrorCode.MQTT_ERR_CONN_LOST
        while written and out:
            packet = out[0]
            step = min(written, packet["to_process"])
            packet["pos"] += step
            packet["to_process"] -= step
            written -= step
            if not packet["to_process"]:
                out.popleft()
        with self._msgtime_mutex:
            self._last_msg_out = time.monotonic()
        return MQTTErrorCode.MQTT_ERR_SUCCESS


class MqttDelivery:
    """The delivery client: one MQTT connection, QoS 1 publishes on the request topics.

    Publishes of one loop iteration are written right after it and PUBACKs are read as they come,
    with no thread hand-off per message. `on_state` voids in-flight state on loss and sends again
    when the link is back. The in-flight window is kept small: large windows collapse throughput.

    Each connection gets a fresh paho client (paho would otherwise re-send its unacked messages
    first after every reconnect, the refused one included). A refused delivery is blamed
    (`on_refused`) and sent again only with nothing else unacknowledged, so the next drop names the
    culprit exactly.

    With `ack_topic_prefix` the client subscribes to `<prefix>/<its clientid>` (where the EMQX rule
    republishes the vehicles' PUBACKs, see `acks`) on every connection, hands each message to
    `on_ack`, and warns when deliveries go out and no ack message comes back for
    `inflight_timeout_s` (the rule is missing or broken).

    Built, started and published to on the event loop's thread; `stop` is called from
    another thread while the loop runs.
    """

    def __init__(
        self,
        cfg: Config,
        loop: asyncio.AbstractEventLoop,
        on_state: Callable[[bool], None],
        *,
        on_refused: RefusedCallback | None = None,
        on_ack: AckCallback | None = None,
        clientid: str | None = None,
        after_read: Callable[[], None] | None = None,
    ) -> None:
        self._cfg = cfg
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._on_state = on_state
        self._on_refused = on_refused
        self._max_refusals = cfg.delivery_max_refusals
        #: Deliveries written and not yet PUBACKed at most; the rest wait in `_held`.
        self._window = cfg.mqtt_max_inflight
        self._topics = RequestTopics(cfg.request_topic_prefix)
        #: Acks are matched by the prefix; the rest keeps replicas apart.
        self.clientid = clientid or f"{cfg.mqtt_clientid_prefix}{socket.gethostname()}-{os.getpid()}"
        self._on_ack = on_ack
        #: Called after each read from the broker (the dispatcher's `drain_now`).
        self._after_read = after_read
        #: Where the rule republishes the PUBACKs of our deliveries; "" = the hook brings them.
        self.ack_topic = f"{cfg.rule_ack_topic_prefix}/{self.clientid}" if cfg.rule_ack_topic_prefix and on_ack else ""
        self._ack_timeout_s = cfg.inflight_timeout_s
        #: When a delivery went out with no ack message since (monotonic); None when answered.
        self._unanswered_since: float | None = None
        self._ack_warned = False
        self._host, self._port, self._tls = paho_tls.broker(cfg)
        self._connected = False
        self._stopping = False
        self._client: _Client = self._new_client()
        self._expiry_s = cfg.mqtt_message_expiry_s
        #: The PUBLISH properties of a request without an expiry (encoded, length in front).
        self._props = expiry_property(cfg.mqtt_message_expiry_s) if cfg.mqtt_message_expiry_s else b"\x00"
        #: The socket the loop watches (None between connections), and whether for writing too.
        self._sock: Any = None
        self._writing = False
        #: The loop turn's write, scheduled (see `_want_flush`); None when none is due.
        self._flush_handle: asyncio.Handle | None = None
        self._was_up = False
        self._housekeeping_timer: asyncio.TimerHandle | None = None
        #: mid → (vin, request_id) of deliveries written and not yet PUBACKed by the broker.
        self._unacked: dict[int, tuple[str, str]] = {}
        #: mid → what to tell when the broker answers a status message written on this connection.
        self._status_unacked: dict[int, Callable[[int], None]] = {}
        #: (vin, request_id) → times the broker refused it; present = sent only alone.
        self._suspects: OrderedDict[tuple[str, str], int] = OrderedDict()
        #: Deliveries accepted from dispatch, waiting while a suspect is (about to be) sent alone.
        self._held: deque[tuple[str, str, bytes, int]] = deque()
        #: The mid of the suspect now sent alone, if any.
        self._isolated: int | None = None
        #: Set once the watched socket is gone: the connector then connects again.
        self._gone = asyncio.Event()
        self._connector: asyncio.Task[None] | None = None

    def _new_client(self) -> _Client:
        """A paho client for one connection: nothing queued from an earlier one."""
        cfg = self._cfg
        client = _Client(CallbackAPIVersion.VERSION2, client_id=self.clientid, protocol=mqtt.MQTTv5)
        paho_tls.authenticate(client, cfg, self._tls)
        # Our window, not paho's: paho walks every message it holds on each PUBACK to find the
        # next one to send (O(queue) per delivery); ours is a deque.
        client.max_inflight_messages_set(0)
        client.max_queued_messages_set(0)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_want_write
        if self.ack_topic:
            client.on_message = self._on_message
            client.on_subscribe = self._on_subscribe
            client.fast_topic = self.ack_topic.encode()
            client.fast_message = self._ack_message
        client.connect_async(self._host, self._port, keepalive=cfg.mqtt_keepalive_s, clean_start=True)
        return client

    def start(self) -> None:
        """Connect in the background; retries with backoff until the broker answers."""
        self._connector = self._loop.create_task(self._connect_forever(), name="mqtt-delivery")
        log.info("mqtt_connecting", host=self._host, port=self._port, clientid=self.clientid)
        if self.ack_topic:
            log.info(
                "rule_acks_expected",
                topic=self.ack_topic,
                note="message.acked is not registered: PUBACKs come only through the EMQX rule (emqx sync installs it)",
            )

    def stop(self) -> None:
        """Disconnect cleanly (bounded in time) and stop reconnecting."""
        self._stopping = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(_STOP_TIMEOUT_S + 5)

    @property
    def connected(self) -> bool:
        return self._connected

    def publish_status(self, topic: str, payload: bytes, on_puback: Callable[[int], None]) -> bool:
        """Write one QoS 1 status message (exhook_server/status.py); False while disconnected.
        `on_puback(reason_code)` once the broker answers it; a link drop forgets it (the status
        publisher hears of that through on_state and sends it again). Not a delivery: outside
        the delivery window and the refusal accounting."""
        if not self._connected:
            return False
        info = self._client.publish(topic, payload, qos=1)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            return False
        self._status_unacked[info.mid] = on_puback
        return True

    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        """Queue one QoS 1 delivery; False (nothing queued) while disconnected. A request with
        an expiry (epoch ms) carries the seconds it has left as its Message-Expiry-Interval, so
        no broker session queue hands it out stale either."""
        if not self._connected:
            return False
        key = (vin, request_id)
        refusals = self._suspects.get(key)
        if refusals is not None and refusals >= self._max_refusals:
            # Refused for good: never written again (a later link may have forgotten nothing).
            self._refused(key, "refused_before", final=True)
            return True
        if refusals is not None or self._held or self._isolated is not None or len(self._unacked) >= self._window:
            self._held.append((vin, request_id, payload, expires_ms))
            self._release()
            return True
        return self._send(vin, request_id, payload, expires_ms)

    def _properties(self, expires_ms: int) -> bytes:
        """PUBLISH properties: the Message-Expiry-Interval is the seconds the request has left
        (at least 1), capped by mqtt_message_expiry_s when that is set."""
        if not expires_ms:
            return self._props
        left = max(1, -(-(expires_ms - now_ms()) // 1000))
        return expiry_property(min(left, self._expiry_s) if self._expiry_s else left)

    def _send(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        client = self._client
        if not client.linked():
            return False
        mid = client.publish_fast(
            self._topics.delivery(vin, request_id).encode(), payload, self._properties(expires_ms)
        )
        self._unacked[mid] = (vin, request_id)
        if self._unanswered_since is None and self.ack_topic:
            self._unanswered_since = time.monotonic()
        return True

    def _release(self) -> None:
        """Send held deliveries in order while the window has room, until the next suspect, which
        goes alone: once nothing else is unacknowledged, and nothing else is sent until the broker
        answers it."""
        held = self._held
        while held and self._isolated is None and self._connected and len(self._unacked) < self._window:
            vin, request_id, payload, expires_ms = held[0]
            suspect = (vin, request_id) in self._suspects
            if suspect and self._unacked:
                return  # the pipeline empties first
            held.popleft()
            if self._send(vin, request_id, payload, expires_ms) and suspect:
                self._isolated = next(reversed(self._unacked))

    def _refused(self, key: tuple[str, str], reason: str, *, final: bool) -> None:
        if self._on_refused is not None:
            self._on_refused(key[0], key[1], reason, final)

    def _blame(self, key: tuple[str, str], reason: str) -> None:
        """Count one refusal of `key`; tell dispatch, finally once it reaches the bound."""
        count = self._suspects.pop(key, 0) + 1
        self._suspects[key] = count
        if len(self._suspects) > _SUSPECTS_MAX:
            self._suspects.popitem(last=False)
        log.warning(
            "delivery_refused", vin=key[0], request_id=key[1], reason=reason, refusals=count, limit=self._max_refusals
        )
        self._refused(key, reason, final=count >= self._max_refusals)

    # -- connecting ------------------------------------------------------------------------
    async def _connect_forever(self) -> None:
        delay = _RETRY_FIRST_S
        while not self._stopping:
            self._gone.clear()
            self._was_up = False
            try:
                # Blocking handshakes in a worker thread; paho hands the socket over (_on_socket_open).
                await asyncio.to_thread(self._client.reconnect)
            except (OSError, ValueError) as exc:
                log.warning("mqtt_connect_failed", host=self._host, port=self._port, error=str(exc), retry_s=delay)
            else:
                await self._gone.wait()
                if self._was_up:
                    delay = _RETRY_FIRST_S
            if self._stopping:
                return
            self._client = self._new_client()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    async def _shutdown(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connector
        if self._sock is not None:
            self._client.disconnect()  # queued; paho closes the socket once it is written
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_STOP_TIMEOUT_S):
                    await self._gone.wait()
        self._unwatch()

    # -- paho's socket on the event loop ------------------------------------------------------
    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn on the loop's thread: now if this is it, else soon (paho calls back from the
        connecting worker thread too)."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _on_socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._on_loop(self._watch, sock)

    def _watch(self, sock: Any) -> None:
        if self._stopping:
            sock.close()  # connected while shutting down: nobody will serve it
            return
        self._sock = sock
        self._loop.add_reader(sock, self._read)
        self._housekeeping_timer = self._loop.call_later(_HOUSEKEEPING_S, self._housekeeping)
        self._want_flush()  # the CONNECT packet

    def _on_socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        # Called before paho closes it: stop watching the descriptor while it is still open.
        self._on_loop(self._socket_gone, sock)

    def _socket_gone(self, sock: Any) -> None:
        if sock is self._sock:
            self._unwatch()
            self._gone.set()

    def _unwatch(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            self._loop.remove_reader(sock)
            if self._writing:
                self._loop.remove_writer(sock)
        self._writing = False
        if self._housekeeping_timer is not None:
            self._housekeeping_timer.cancel()
            self._housekeeping_timer = None

    def _read(self) -> None:
        client = self._client
        client.loop_read()
        # Bytes already read (ours, or TLS's decrypted ones) that the socket will not signal again.
        while self._sock is not None and (
            client.buffered() or (isinstance(self._sock, ssl.SSLSocket) and self._sock.pending())
        ):
            client.loop_read()
        if self._after_read is not None:
            # What this read freed is dispatched now and written with it: one loop turn per read,
            # not three (read, the dispatcher's turn, the write's turn).
            self._after_read()
            if self._flush_handle is not None:
                self._flush_handle.cancel()
                self._flush()

    def _on_want_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._on_loop(self._want_flush)

    def _want_flush(self) -> None:
        # Everything queued in this loop iteration is written together, right after it.
        if self._flush_handle is None and self._sock is not None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        sock = self._sock
        if sock is None:
            return
        self._client.loop_write()
        # What the socket did not take waits until it is writable again.
        pending = self._sock is not None and self._client.want_write()
        if pending != self._writing:
            if pending:
                self._loop.add_writer(sock, self._flush)
            else:
                self._loop.remove_writer(sock)
            self._writing = pending

    def _housekeeping(self) -> None:
        self._housekeeping_timer = None
        if self._sock is not None:
            self._client.loop_misc()
        self._check_acks_arrive()
        if self._sock is not None:
            self._housekeeping_timer = self._loop.call_later(_HOUSEKEEPING_S, self._housekeeping)

    def _check_acks_arrive(self) -> None:
        """Warn once per silence when deliveries went out and no ack message came back within
        the in-flight timeout: without the rule every delivery waits for it, then goes again."""
        since = self._unanswered_since
        if since is None or self._ack_warned or time.monotonic() - since < self._ack_timeout_s:
            return
        self._ack_warned = True
        log.warning(
            "rule_acks_missing",
            topic=self.ack_topic,
            waited_s=round(time.monotonic() - since, 1),
            hint="is the ack rule in place and enabled? `sdv-fanout emqx check` says",
        )

    # -- paho callbacks (the loop's thread) ---------------------------------------------------
    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.error("mqtt_connect_refused", reason=str(reason))
            return
        self._connected = self._was_up = True
        log.info("mqtt_connected", host=self._host, port=self._port, clientid=self.clientid)
        if self.ack_topic:
            # Every connection starts clean: subscribe again, ahead of the deliveries that
            # on_state sends, so the broker routes their acks to this connection. At QoS 0,
            # whatever QoS the rule republishes at: the broker then neither holds each ack in
            # our session's in-flight window nor waits for our PUBACK, and a clean connection
            # loses unacknowledged QoS 1 messages at a drop anyway (a lost ack costs one
            # re-send after inflight_timeout_s, as before).
            client.subscribe(self.ack_topic, qos=0)
        self._on_state(True)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        if any(r.is_failure for r in reasons):
            log.error("ack_subscribe_refused", topic=self.ack_topic, reason=[str(r) for r in reasons])

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        # What _Client does not take on its fast path (a DUP, properties): the same handling.
        if msg.topic == self.ack_topic:
            self._ack_message(bytes(msg.payload))

    def _ack_message(self, payload: bytes) -> None:
        """A message on our ack topic. paho PUBACKs it once this returns; a lost ack costs one
        more delivery only."""
        self._unanswered_since = None
        self._ack_warned = False
        if self._on_ack is not None:
            try:
                self._on_ack(payload)
            except Exception:  # never into paho's read loop: the link carries every delivery
                log.exception("rule_ack_failed", topic=self.ack_topic)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        key = self._unacked.pop(mid, None)
        if key is None:
            done = self._status_unacked.pop(mid, None)
            if done is not None:
                done(reason.value)
            return
        if mid == self._isolated:
            self._isolated = None
        if reason.is_failure:  # the broker refused this very message (e.g. 0x87 not authorized)
            self._blame(key, "puback_" + reason.getName().lower().replace(" ", "_"))
        elif self._suspects:
            self._suspects.pop(key, None)
        if self._held:
            self._release()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        was, self._connected = self._connected, False
        # What the broker had not acknowledged may be what made it drop us: blame it. A suspect
        # goes alone, so after the first drop only the culprit is blamed again.
        unacked, self._unacked = list(self._unacked.values()), {}
        self._status_unacked.clear()  # the status publisher re-sends them (on_state)
        self._held.clear()
        self._isolated = None
        if was and not self._stopping:
            for key in unacked:
                self._blame(key, "link_dropped")
        if was:
            if self._stopping:
                log.info("mqtt_disconnected", reason="shutdown")
            else:
                log.warning("mqtt_disconnected", reason=str(reason))
            self._on_state(False)
