"""The events member's MQTT 5 reader (exhook_server/subscriber.py), fed bytes as the broker sends them."""

from __future__ import annotations

import asyncio
import functools
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from exhook_server.config import Config
from exhook_server.subscriber import MAX_PACKET_BYTES, Subscriber, _Link, _varint, connect_packet


class Transport:
    """What the link writes, and whether it was aborted."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False
        #: pause_reading (False) and resume_reading (True) calls, in order.
        self.reading: list[bool] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def pause_reading(self) -> None:
        self.reading.append(False)

    def resume_reading(self) -> None:
        self.reading.append(True)


def in_loop(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run the test on an event loop of its own (the link reads the loop's clock)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


def publish(topic: str, payload: bytes, *, qos: int, packet_id: int = 7, props: bytes = b"") -> bytes:
    body = struct.pack("!H", len(topic)) + topic.encode()
    body += struct.pack("!H", packet_id) if qos else b""
    body += _varint(len(props)) + props + payload
    return bytes([0x30 | qos << 1]) + _varint(len(body)) + body


def link(gather_s: float = 0.0) -> tuple[_Link, Transport, list[tuple[str, bytes]]]:
    got: list[tuple[str, bytes]] = []
    sub = Subscriber(
        Config(),
        "sdv-fanout-events-t",
        [("$share/g/ecp/+/heartbeat", 0)],
        lambda t, p: got.append((t, p)),
        gather_s=gather_s,
    )
    lk = _Link(sub)
    tr = Transport()
    lk.connection_made(tr)
    tr.written.clear()
    return lk, tr, got


@in_loop
async def test_messages_split_anywhere_arrive_whole_and_qos1_is_acked_once_per_read() -> None:
    lk, tr, got = link()
    stream = publish("ecp/V1/heartbeat", b"{}", qos=0) + publish(
        "agent/V1/proxy/response/r1", b"answer", qos=1, packet_id=0x0102, props=b"\x01\x01"
    )
    for i in range(len(stream)):  # one byte at a time: every split point
        lk.data_received(stream[i : i + 1])
    assert got == [("ecp/V1/heartbeat", b"{}"), ("agent/V1/proxy/response/r1", b"answer")]
    assert tr.written == [b"\x40\x02\x01\x02"]
    tr.written.clear()
    lk.data_received(publish("a/b", b"1", qos=1, packet_id=1) + publish("a/b", b"2", qos=1, packet_id=2))
    assert tr.written == [b"\x40\x02\x00\x01\x40\x02\x00\x02"]  # both PUBACKs in one write


@pytest.mark.parametrize(
    "garbage",
    [
        bytes([0x30]) + _varint(MAX_PACKET_BYTES + 1),  # larger than we announced
        b"\x30\xff\xff\xff\xff\x01",  # a length longer than 4 bytes
        b"\x30\x03\x00\x09a",  # a topic longer than the packet
    ],
)
@in_loop
async def test_what_cannot_be_parsed_ends_the_connection(garbage: bytes) -> None:
    lk, tr, got = link()
    lk.data_received(garbage)
    assert tr.aborted and got == []


@in_loop
async def test_connect_announces_the_limits_and_a_refused_connack_closes() -> None:
    packet = connect_packet("c", "sdv-fanout", "pw", 30)
    assert b"\x21\x01\x00" in packet and b"\x27" + struct.pack("!I", MAX_PACKET_BYTES) in packet
    lk, tr, _ = link()
    lk.data_received(b"\x20\x03\x00\x87\x00")  # CONNACK: not authorized
    assert tr.aborted
    lk, tr, _ = link()
    lk.data_received(b"\x20\x03\x00\x00\x00")
    assert tr.written and tr.written[0][0] == 0x82  # SUBSCRIBE


@in_loop
async def test_a_refused_subscription_is_not_reported_up() -> None:
    states: list[bool] = []
    sub = Subscriber(Config(), "c", [("$share/g/a/+", 0)], lambda t, p: None, states.append)
    lk = _Link(sub)
    lk.connection_made(Transport())
    lk.data_received(b"\x90\x04\x00\x01\x00\x87")
    assert states == [] and not lk.subscribed
    lk.data_received(b"\x90\x04\x00\x01\x00\x00")
    assert states == [True] and lk.subscribed


@in_loop
async def test_after_a_read_the_link_waits_the_gathering_window_before_reading_again() -> None:
    lk, tr, got = link(gather_s=0.01)
    lk.data_received(publish("ecp/V1/heartbeat", b"1", qos=0))
    assert got == [("ecp/V1/heartbeat", b"1")] and tr.reading == [False]  # handled at once, then paused
    lk.data_received(publish("ecp/V2/heartbeat", b"2", qos=0))  # already read: no second pause
    assert len(got) == 2 and tr.reading == [False]
    deadline = asyncio.get_running_loop().time() + 5
    while tr.reading == [False] and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)
    assert tr.reading == [False, True]
    lk.data_received(publish("ecp/V3/heartbeat", b"3", qos=0))
    assert tr.reading == [False, True, False] and len(got) == 3
    plain, tr0, _ = link()
    plain.data_received(publish("ecp/V1/heartbeat", b"1", qos=0))
    assert tr0.reading == []  # 0: read at once, never paused
