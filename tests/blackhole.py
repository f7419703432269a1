"""A TCP proxy on loopback that can black-hole its connections, then reset them.

Between a client and a real broker: forwards both ways until `blackhole()`; from then on it keeps
reading both sides and forwards nothing (the bytes vanish, as on a link that silently drops
packets: neither end notices until a timeout). `reset()` ends every connection with a TCP RST
and forwards again for the connections that follow. One thread runs every socket (a selector),
so a reset never races a forward.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

LOOPBACK = "127.0.0.1"
_CHUNK = 1 << 16


class BlackholeProxy:
    """`127.0.0.1:<port>` → `127.0.0.1:<target_port>`; start(), then stop()."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        #: socket → its peer, for every forwarded connection (both directions).
        self._peer: dict[socket.socket, socket.socket] = {}
        self._upstream: set[socket.socket] = set()
        self._calls: list[tuple[Callable[[], Any], threading.Event]] = []
        self._lock = threading.Lock()
        self._blackholed = False
        self._stopping = False
        #: Bytes from clients that the black hole swallowed, and connections accepted so far.
        self.swallowed = 0
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, name="blackhole-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"mqtt://{LOOPBACK}:{self.port}"

    def start(self) -> BlackholeProxy:
        self._sel.register(self._listener, selectors.EVENT_READ, self._accept)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._calls_due)
        self._thread.start()
        return self

    def blackhole(self) -> None:
        """Forward nothing more; keep reading (and discarding) what either side sends."""
        self._call(lambda: setattr(self, "_blackholed", True))

    def reset(self) -> int:
        """Send a RST on both sides of every connection, close them, forward again; returns how
        many connections were reset."""
        return self._call(self._reset)  # type: ignore[no-any-return]

    def connections(self) -> int:
        return self._call(lambda: len(self._upstream))  # type: ignore[no-any-return]

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._reset)
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join(10)
        self._sel.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> BlackholeProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the proxy's thread ---------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run fn on the proxy's thread and return its result."""
        done = threading.Event()
        result: list[Any] = []
        with self._lock:
            self._calls.append((lambda: result.append(fn()), done))
        self._wake_w.send(b"x")
        if not done.wait(timeout_s):
            raise TimeoutError("the proxy's thread did not answer")
        return result[0]

    def _calls_due(self, _sock: socket.socket) -> None:
        self._wake_r.recv(4096)
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, done in calls:
            fn()
            done.set()

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._sel.select(timeout=1.0):
                key.data(key.fileobj)

    def _accept(self, _sock: socket.socket) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.accepted += 1
        try:
            upstream = socket.create_connection((LOOPBACK, self.target_port), timeout=5)
        except OSError:
            _abort(client)
            return
        for sock in (client, upstream):
            sock.setblocking(True)
            sock.settimeout(5)
        self._peer[client], self._peer[upstream] = upstream, client
        self._upstream.add(upstream)
        self._sel.register(client, selectors.EVENT_READ, self._forward)
        self._sel.register(upstream, selectors.EVENT_READ, self._forward)

    def _forward(self, sock: socket.socket) -> None:
        peer = self._peer.get(sock)
        if peer is None:
            return
        try:
            data = sock.recv(_CHUNK)
        except OSError:
            data = b""
        if not data:  # one side closed or failed: close the other too
            self._close_pair(sock, rst=False)
            return
        if self._blackholed:
            if sock not in self._upstream:
                self.swallowed += len(data)
            return
        try:
            peer.sendall(data)
        except OSError:
            self._close_pair(sock, rst=False)

    def _close_pair(self, sock: socket.socket, *, rst: bool) -> None:
        peer = self._peer.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._peer.pop(s, None)
            self._upstream.discard(s)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            if rst:
                _abort(s)
            else:
                s.close()

    def _reset(self) -> int:
        count = len(self._upstream)
        for upstream in list(self._upstream):
            self._close_pair(upstream, rst=True)
        self._blackholed = False
        return count


def _abort(sock: socket.socket) -> None:
    """Close with a RST (SO_LINGER on, zero timeout), not a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
