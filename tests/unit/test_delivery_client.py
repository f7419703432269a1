"""The delivery client's trimmed paho paths (delivery._Client) against paho's own, on crafted packets."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from exhook_server.delivery import _Client, expiry_property

ACKS = "$SDV-FANOUT/acked/sdv-fanout-host-1"


def publish_packet(topic: str, mid: int, payload: bytes, *, props: bytes = b"", flags: int = 0x02) -> bytes:
    """A whole MQTT 5 PUBLISH (fixed header included), QoS from `flags` (QoS 0: no packet id)."""
    t = topic.encode()
    pid = struct.pack("!H", mid) if flags & 0x06 else b""
    body = struct.pack("!H", len(t)) + t + pid + bytes([len(props)]) + props + payload
    assert len(body) < 128
    return bytes([0x30 | flags, len(body)]) + body


@pytest.fixture
def client() -> Iterator[tuple[_Client, list[Any], socket.socket]]:
    """A _Client reading one end of a socket pair, recording fast, paho and on_publish callbacks."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    c = _Client(CallbackAPIVersion.VERSION2, client_id="sdv-fanout-host-1", protocol=5)
    seen: list[Any] = []
    c.fast_topic = ACKS.encode()
    c.fast_message = lambda payload: seen.append(("fast", payload))
    c.on_message = lambda _c, _u, msg: seen.append(("paho", msg.topic, msg.payload, msg.mid))
    c.on_publish = lambda _c, _u, mid, rc, _p: seen.append(("puback", mid, rc.value))
    c.on_socket_register_write = lambda *_a: None  # as MqttDelivery: packets wait for its flush
    c._sock = ours
    yield c, seen, theirs
    c._sock = None
    ours.close()
    theirs.close()


def read_all(c: _Client) -> None:
    """What MqttDelivery._read does: read until nothing waits in our buffer."""
    c.loop_read()
    while c.buffered():
        c.loop_read()


def queued(c: _Client) -> list[bytes]:
    return [bytes(p["packet"]) for p in c._out_packet]


def test_ack_messages_in_one_read_each_take_the_fast_path_and_get_their_puback(client: Any) -> None:
    """Three ack messages arriving in one segment: each payload reaches fast_message in order and
    each gets its PUBACK, with no message object built by paho."""
    c, seen, peer = client
    peer.sendall(b"".join(publish_packet(ACKS, mid, f"ack {mid}".encode()) for mid in (1, 2, 300)))
    read_all(c)
    assert seen == [("fast", b"ack 1"), ("fast", b"ack 2"), ("fast", b"ack 300")]
    assert queued(c) == [b"\x40\x02\x00\x01", b"\x40\x02\x00\x02", b"\x40\x02\x01\x2c"]


def test_qos0_ack_messages_take_the_fast_path_and_need_no_puback(client: Any) -> None:
    """The ack subscription is QoS 0: such messages reach fast_message in order and nothing is
    queued in answer; a QoS 0 message on another topic still goes to paho."""
    c, seen, peer = client
    peer.sendall(
        publish_packet(ACKS, 0, b"ack a", flags=0x00)
        + publish_packet("other/topic", 0, b"x", flags=0x00)
        + publish_packet(ACKS, 0, b"", flags=0x00)
        + publish_packet(ACKS, 0, b"ack b", flags=0x00)
    )
    read_all(c)
    assert seen == [("fast", b"ack a"), ("paho", "other/topic", b"x", 0), ("fast", b""), ("fast", b"ack b")]
    assert queued(c) == []


def test_packets_split_across_reads_or_longer_than_127_bytes_arrive_whole(client: Any) -> None:
    """A PUBLISH whose remaining length takes two bytes (as a real ack message's does), cut inside
    its fixed header and again in its payload, and a PUBACK cut after its first byte: each is
    handled once it is all there, and the packets after them too."""
    c, seen, peer = client
    mid = c.publish("agent/V1/proxy/request/r", b"x", qos=1).mid
    t = ACKS.encode()
    body = struct.pack("!H", len(t)) + t + b"\x00" + b"a" * 200  # QoS 0: no packet id
    long_ack = bytes([0x30, len(body) & 0x7F | 0x80, len(body) >> 7]) + body
    stream = long_ack + struct.pack("!BBH", 0x40, 2, mid) + publish_packet(ACKS, 0, b"after", flags=0x00)
    start = 0
    for cut in (2, 100, len(long_ack) + 1, len(stream)):
        peer.sendall(stream[start:cut])
        start = cut
        read_all(c)
    assert seen == [("fast", b"a" * 200), ("puback", mid, 0), ("fast", b"after")]
    assert [p[0] for p in queued(c)] == [0x32]  # our PUBLISH only: QoS 0 acks get no PUBACK


@pytest.mark.parametrize(
    ("topic", "props", "flags"),
    [
        ("other/topic", b"", 0x02),  # not the ack topic
        (ACKS, b"\x01\x01", 0x02),  # a property (payload format indicator)
        (ACKS, b"", 0x0A),  # DUP
    ],
    ids=["other-topic", "with-properties", "dup"],
)
def test_anything_else_takes_paho_path(client: Any, topic: str, props: bytes, flags: int) -> None:
    """Another topic, properties or a DUP flag go through paho's decoding and on_message, PUBACKed alike."""
    c, seen, peer = client
    peer.sendall(publish_packet(topic, 7, b"payload", props=props, flags=flags))
    read_all(c)
    assert seen == [("paho", topic, b"payload", 7)]
    assert queued(c) == [b"\x40\x02\x00\x07"]


def test_plain_and_refused_pubacks_reach_on_publish_with_their_reason(client: Any) -> None:
    """PUBACKs without reason code, with 0x00, with 0x00 and no properties (EMQX's), with 0x87, and with
    0x00 and a property, each report their mid and reason."""
    c, seen, peer = client
    mids = [c.publish(f"agent/V{n}/proxy/request/r", b"x", qos=1).mid for n in range(5)]
    peer.sendall(
        struct.pack("!BBH", 0x40, 2, mids[0])
        + struct.pack("!BBHB", 0x40, 3, mids[1], 0x00)
        + struct.pack("!BBHBB", 0x40, 4, mids[2], 0x00, 0)
        + struct.pack("!BBHBB", 0x40, 4, mids[3], 0x87, 0)
        + struct.pack("!BBHBBBBB", 0x40, 7, mids[4], 0x00, 3, 0x1F, 0, 0)  # reason string ""
    )
    read_all(c)
    assert seen == [("puback", mid, 0x87 if mid == mids[3] else 0x00) for mid in mids]
    assert not c._out_messages


def test_queued_packets_leave_in_one_write(client: Any) -> None:
    """Several queued packets are written with one send, byte for byte what paho would write."""
    c, _seen, peer = client
    for mid in (1, 2, 3):
        c._send_puback(mid)
    c.loop_write()
    assert peer.recv(100) == b"\x40\x02\x00\x01\x40\x02\x00\x02\x40\x02\x00\x03"
    assert not c._out_packet


@pytest.mark.parametrize("expiry_s", [0, 1, 86_400 * 400], ids=["no-expiry", "1s", "400-days"])
@pytest.mark.parametrize("size", [0, 100, 200, 20_000, 3_000_000], ids=["0B", "100B", "200B", "20kB", "3MB"])
def test_a_fast_publish_writes_what_paho_publish_writes(client: Any, expiry_s: int, size: int) -> None:
    """publish_fast's PUBLISH is byte for byte paho's own for the same topic, payload, packet id and
    Message-Expiry-Interval (remaining lengths of 1 to 4 bytes)."""
    c, _seen, _peer = client
    topic, payload = (
        "agent/LSVTEST00000000001/proxy/request/task_ota_1",
        bytes(range(256)) * (size // 256) + b"x" * (size % 256),
    )
    props = None
    if expiry_s:
        props = Properties(PacketTypes.PUBLISH)
        props.MessageExpiryInterval = expiry_s
    paho_mid = c.publish(topic, payload, qos=1, properties=props).mid
    ours = c.publish_fast(topic.encode(), payload, expiry_property(expiry_s) if expiry_s else b"\x00")
    assert ours == paho_mid + 1
    theirs, mine = queued(c)
    n = len(topic)  # the packet ids differ: compare with ours in paho's place
    at = next(i for i in range(1, 5) if theirs[i] < 0x80) + 1  # after the remaining length
    pid = at + 2 + n
    assert mine == theirs[:pid] + ours.to_bytes(2, "big") + theirs[pid + 2 :]


def test_pubacks_of_fast_publishes_reach_on_publish_plain_refused_or_with_properties(client: Any) -> None:
    """A plain PUBACK, a refusal (0x87) and a PUBACK with a property, each of a fast publish: on_publish
    gets its packet id and reason, once; a second PUBACK of the same id is ignored."""
    c, seen, peer = client
    mids = [c.publish_fast(f"agent/V{n}/proxy/request/r".encode(), b"x") for n in range(3)]
    peer.sendall(
        struct.pack("!BBH", 0x40, 2, mids[0])
        + struct.pack("!BBHBB", 0x40, 4, mids[1], 0x87, 0)
        + struct.pack("!BBHBBBBB", 0x40, 7, mids[2], 0x00, 3, 0x1F, 0, 0)  # reason string ""
        + struct.pack("!BBH", 0x40, 2, mids[0])
    )
    read_all(c)
    assert seen == [("puback", mids[0], 0x00), ("puback", mids[1], 0x87), ("puback", mids[2], 0x00)]
    assert not c._fast_mids
