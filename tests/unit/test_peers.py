"""Peer links between the server processes of one group: each `Peers` on its own event loop and
thread, as each would run in its own process."""

from __future__ import annotations

import asyncio
import secrets
import threading
from typing import Any

from exhook_server.dispatch.peers import Group, Peers
from tests.harness import poll


class _PeerThread(threading.Thread):
    """One group member: starts, sends one item to the other, stops when told, then its loop closes."""

    def __init__(self, index: int, key: str, received: list[Any]) -> None:
        super().__init__(name=f"peer-{index}", daemon=True)
        self.index = index
        self.key = key
        self.received = received
        self.reported: list[dict[str, Any]] = []
        self.stop_now = threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: self.reported.append(context))
        peers = Peers(Group(self.index, 2, self.key, 0), self.received.append, lambda query: query)
        await peers.start()
        peers.send(1 - self.index, f"from {self.index}")
        await asyncio.to_thread(self.stop_now.wait, 30)
        await peers.stop()


def test_stopped_peer_leaves_no_link_for_its_closing_loop_to_cancel() -> None:
    """A process that stops while its peer still runs ends the peer's link itself: asyncio reports nothing."""
    received: list[Any] = []
    key = f"test-{secrets.token_hex(4)}"
    first, second = _PeerThread(0, key, received), _PeerThread(1, key, received)
    first.start()
    second.start()
    try:
        poll(lambda: len(received) == 2, timeout_s=10)
        first.stop_now.set()  # `second` still runs, its link to `first` open, while `first`'s loop closes
        first.join(10)
        assert not first.is_alive()
    finally:
        first.stop_now.set()
        second.stop_now.set()
        first.join(10)
        second.join(10)
    assert sorted(received) == ["from 0", "from 1"]
    reported = [c.get("message") for c in first.reported + second.reported]
    assert not reported, f"asyncio reported: {reported}"
