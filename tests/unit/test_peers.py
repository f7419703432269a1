"""Peer links between the server processes of one group: each `Peers` on its own event loop and
thread, as each would run in its own process."""

from __future__ import annotations

import asyncio
import secrets
import threading
from typing import Any

from structlog.testing import capture_logs

from exhook_server.backends.lmdb.peers import Group, Peers
from testkit.harness import poll


class _PeerThread(threading.Thread):
    """One group member: starts, sends one item to the other, stops when told, then its loop closes."""

    def __init__(self, index: int, key: str, received: list[Any], linger_s: float) -> None:
        super().__init__(name=f"peer-{index}", daemon=True)
        self.index = index
        self.key = key
        self.received = received
        self.linger_s = linger_s
        self.reported: list[dict[str, Any]] = []
        self.stop_now = threading.Event()
        self.stopping = threading.Event()
        self.peers: Peers | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(lambda _loop, context: self.reported.append(context))
        self.peers = Peers(Group(self.index, 2, self.key, 0), self.received.append, lambda query: query)
        await self.peers.start()
        self.peers.send(1 - self.index, f"from {self.index}")
        await asyncio.to_thread(self.stop_now.wait, 30)
        self.stopping.set()
        await self.peers.stop(linger_s=self.linger_s)

    def send(self, item: Any) -> None:
        """Send `item` to the other member, from any thread."""
        assert self.loop is not None and self.peers is not None
        self.loop.call_soon_threadsafe(self.peers.send, 1 - self.index, item)


def _pair(first_linger_s: float) -> tuple[_PeerThread, _PeerThread, list[Any]]:
    received: list[Any] = []
    key = f"test-{secrets.token_hex(4)}"
    first, second = _PeerThread(0, key, received, first_linger_s), _PeerThread(1, key, received, 5.0)
    first.start()
    second.start()
    poll(lambda: len(received) == 2, timeout_s=10)
    return first, second, received


def _stop(*members: _PeerThread) -> None:
    for member in members:
        member.stop_now.set()
    for member in members:
        member.join(10)


def test_stopped_peer_leaves_no_link_for_its_closing_loop_to_cancel() -> None:
    """A process that stops while its peer still runs ends the peer's link itself: asyncio reports nothing."""
    first, second, received = _pair(first_linger_s=0.05)
    try:
        first.stop_now.set()  # `second` still runs, its link to `first` open, while `first`'s loop closes
        first.join(10)
        assert not first.is_alive()
    finally:
        _stop(first, second)
    assert sorted(received) == ["from 0", "from 1"]
    reported = [c.get("message") for c in first.reported + second.reported]
    assert not reported, f"asyncio reported: {reported}"


def test_stopping_peer_reads_until_the_other_stops_too() -> None:
    """While the group stops, a peer keeps reading what the other still sends: nothing is lost or logged."""
    with capture_logs() as logs:
        first, second, received = _pair(first_linger_s=30)
        try:
            first.stop_now.set()
            poll(first.stopping.is_set)
            second.send("sent while the first one stops")
            poll(lambda: "sent while the first one stops" in received)
            second.stop_now.set()  # its link to `first` closes: `first` need not wait out its linger
            first.join(10)
            assert not first.is_alive()
        finally:
            _stop(first, second)
    assert not [e for e in logs if e.get("log_level") in ("warning", "error", "critical")], logs
    assert not first.reported + second.reported
