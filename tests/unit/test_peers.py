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


def test_link_from_a_process_outside_the_group_is_refused_unread(tmp_path: Any) -> None:
    """Abstract sockets have no permissions: a local process that is not a sibling gets its link
    closed before a byte of its pickle is loaded."""
    import pickle
    import struct
    import subprocess
    import sys

    received: list[Any] = []
    key = f"test-{secrets.token_hex(4)}"
    member = _PeerThread(0, key, received)
    member.start()
    marker = tmp_path / "unpickled"
    try:
        address = Group(0, 2, key, 0).address(0)
        # Unpickling this frame would create the marker file.
        body = pickle.dumps([_Touch(str(marker))])
        frame = struct.pack(">I", len(body)) + body
        intruder = (
            "import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"deadline = time.monotonic() + 10\n"
            "while True:\n"
            "    try:\n"
            f"        s.connect({address!r}); break\n"
            "    except OSError:\n"
            "        if time.monotonic() > deadline: raise\n"
            "        time.sleep(0.01)\n"
            "try:\n"
            "    s.sendall(sys.stdin.buffer.read())\n"
            "    print(repr(s.recv(1)))\n"
            "except OSError:\n"
            "    print(repr(b''))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", intruder], input=frame, capture_output=True, timeout=20, check=True
        )
        assert done.stdout.strip() == b"b''"  # closed by the member without an answer
    finally:
        member.stop_now.set()
        member.join(10)
    assert received == [] and not marker.exists()


class _Touch:
    """Creates a file when unpickled (stands for whatever an intruder's pickle would run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))
