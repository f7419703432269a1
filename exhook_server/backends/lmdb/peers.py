"""LMDB: local IPC between the server processes of one host: dispatch items travel to the process
that owns their VIN (or client).

Each process listens on an abstract Unix socket (no file to clean up). Items for one peer go over
one connection in send order, as length-prefixed pickle frames, and wait in memory until the peer
answers. Pickle is trusted only from the group: abstract sockets have no file permissions, so a
link is accepted only from a process of our user that is this process or a sibling (same parent),
checked with SO_PEERCRED before anything is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from exhook_server.aio import cancel_all

log = structlog.get_logger("sdv_fanout.peers")

_LEN = struct.Struct(">I")
#: struct ucred: pid, uid, gid.
_UCRED = struct.Struct("3i")


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (from /proc), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields restart after the last ")".
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def is_group_member(sock: socket.socket) -> bool:
    """True when the process at the other end of `sock` runs as our user and is this process or
    one of its siblings (forked by the same parent)."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if uid != os.geteuid():
        return False
    return pid == os.getpid() or _parent_of(pid) == os.getppid()


#: A reconnect waits this long at first, doubling up to _RETRY_MAX_S.
_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 1.0
#: On stop, how long to wait for the other processes (stopping too) to close their links to us.
_LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class Group:
    """This process's place among the server processes of one `sdv-fanout serve`."""

    index: int
    size: int
    #: Unique per serve invocation (the parent's pid and a random tag): names the sockets.
    key: str
    #: The gRPC port every process of the group binds (SO_REUSEPORT).
    port: int

    def address(self, index: int) -> str:
        return f"\0sdv-fanout-{self.key}-{index}"


@dataclass(frozen=True, slots=True)
class _Ask:
    """A question for another process (the Admin API's view of state it owns)."""

    ident: int
    origin: int
    query: Any


@dataclass(frozen=True, slots=True)
class _Reply:
    ident: int
    answer: Any


class Peers:
    """Links from this process to every other process of its group.

    `send` is fire-and-forget (dispatch events); `ask` waits for the answer of `on_query` in
    the other process (read-only Admin views).
    """

    def __init__(self, group: Group, on_item: Callable[[Any], None], on_query: Callable[[Any], Any]) -> None:
        self.group = group
        self._on_item = on_item
        self._on_query = on_query
        self._asked: dict[int, asyncio.Future[Any]] = {}
        self._next_ident = 0
        self._out: dict[int, deque[Any]] = {i: deque() for i in range(group.size) if i != group.index}
        self._wake: dict[int, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._server: asyncio.AbstractServer | None = None
        #: Links other processes opened to us, and the tasks reading them (see stop).
        self._incoming: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        #: Items sent and received, for metrics and tests.
        self.sent = 0
        self.received = 0

    async def start(self) -> None:
        """Listen for peers, and start one sender per peer (they connect when the peer is up)."""
        self._server = await asyncio.start_unix_server(self._serve, path=self.group.address(self.group.index))
        for index in self._out:
            self._wake[index] = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._sender(index), name=f"peer-send-{index}"))

    async def stop(self, linger_s: float = _LINGER_S) -> None:
        """Stop sending, stop listening, and end every incoming link before returning.

        The group stops as a whole (SIGTERM reaches every process), so each peer closes its
        link to us as it stops; we wait up to `linger_s` for that, and only then close what is
        left ourselves. Closing first would make a peer that still sends log `peer_link_lost`
        on a clean shutdown. And an incoming link's reader task must end on its own, not be
        cancelled when the loop closes: CPython 3.11's stream server logs a cancelled connection
        task as an `Exception in callback ... CancelledError` traceback.
        """
        await cancel_all(self._tasks)
        if self._server is not None:
            self._server.close()
        if self._incoming:
            await asyncio.wait(list(self._incoming), timeout=linger_s)
        for writer in self._incoming.values():
            writer.close()  # the read ends with EOF: the task returns normally
        if self._incoming:
            await asyncio.wait(list(self._incoming), timeout=1.0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()

    def send(self, index: int, item: Any) -> None:
        """Queue `item` for process `index` (event-loop thread only); never blocks."""
        self._out[index].append(item)
        self._wake[index].set()

    async def ask(self, index: int, query: Any, timeout_s: float = 2.0) -> Any:
        """`on_query(query)` as answered by process `index`; TimeoutError if it does not answer."""
        self._next_ident += 1
        ident = self._next_ident
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asked[ident] = future
        self.send(index, _Ask(ident, self.group.index, query))
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            self._asked.pop(ident, None)

    # -- internals ---------------------------------------------------------------
    def _handle(self, item: Any) -> None:
        if isinstance(item, _Ask):
            self.send(item.origin, _Reply(item.ident, self._on_query(item.query)))
        elif isinstance(item, _Reply):
            future = self._asked.get(item.ident)
            if future is not None and not future.done():
                future.set_result(item.answer)
        else:
            self._on_item(item)

    async def _sender(self, index: int) -> None:
        queue, wake = self._out[index], self._wake[index]
        delay = _RETRY_FIRST_S
        while True:
            try:
                _, writer = await asyncio.open_unix_connection(self.group.address(index))
            except OSError:
                await asyncio.sleep(delay)  # the peer is still starting (or restarting)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            delay = _RETRY_FIRST_S
            try:
                while True:
                    await wake.wait()
                    wake.clear()
                    items = list(queue)
                    queue.clear()
                    body = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
                    writer.write(_LEN.pack(len(body)) + body)
                    self.sent += len(items)
                    await writer.drain()
            except (ConnectionError, OSError) as exc:
                # The peer died; the parent stops the whole group then. Dispatch state is soft
                # (heartbeats and the in-flight sweep repair it), so the lost frame is only logged.
                log.warning("peer_link_lost", peer=index, error=repr(exc))
            finally:
                writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        sock = writer.get_extra_info("socket")
        if sock is None or not is_group_member(sock):
            log.error("peer_refused", reason="not a process of this server group", credentials=_peer(sock))
            writer.close()
            return
        self._incoming[task] = writer
        try:
            while True:
                head = await reader.readexactly(_LEN.size)
                items = pickle.loads(await reader.readexactly(_LEN.unpack(head)[0]))
                self.received += len(items)
                for item in items:
                    try:
                        self._handle(item)
                    except Exception:  # one bad item must not cut the link
                        log.exception("peer_item_failed", item=repr(item))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer closed the link, or we did in stop()
        finally:
            del self._incoming[task]
            writer.close()


def _peer(sock: socket.socket | None) -> str:
    if sock is None:
        return "unknown"
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return f"pid={pid} uid={uid} gid={gid}"
