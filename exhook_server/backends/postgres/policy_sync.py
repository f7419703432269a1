"""PostgreSQL: a policy in force on every live instance before its publish is answered.

Each instance keeps a connection of its own LISTENing on storage/postgres/policies.CHANNEL (every
set or clear NOTIFYs it at commit) and ACK_CHANNEL: on a notice it reads the policy back, puts it in
force (`on_policy`) and acknowledges. `tell` (the storing instance) waits, at most `timeout_s`, for
the acks of every other listener that was LISTENing when the policy committed (those whose "ready"
or "here" reached us before the notice: NOTIFYs arrive in commit order) and is still connected; on
timeout it answers anyway (the policy is durable; every instance's reload is the safety net), with
a log line and a metric. A lost connection is made again, and every policy reloaded (`on_policies`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from exhook_server import metrics
from storage.model import StoredPolicy
from storage.postgres import connect, policies
from storage.postgres.errors import FAILURES, raise_if_cancelling
from storage.postgres.types import Connection, Pool

log = structlog.get_logger("sdv_fanout.policy_sync")

#: The listener connection's application_name: how `tell` sees which listeners are connected.
APPLICATION = "sdv-fanout-policy"
#: Notices and answers queued for the listener at most (beyond: dropped, and every policy reloaded).
MAX_QUEUED = 10_000
#: Policies whose acks are remembered at most (an ack may come before `tell` asks for it).
MAX_SEEN = 1024
#: Other listeners remembered at most.
MAX_KNOWN = 1024
#: How often a waiting `tell` checks that the listeners it waits for are still connected.
ALIVE_CHECK_S = 0.2
#: How long a connect or a probe of the listener may take.
_PROBE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class _Seen:
    """One notice (request id, ms) as this listener saw it."""

    #: The other listeners to wait for (None: the notice has not reached us yet).
    expected: frozenset[int] | None = None
    acked: set[int] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class PolicySync:
    """This instance's policy listener and the wait of `tell` (see the module docstring)."""

    def __init__(
        self,
        url: str,
        pool: Callable[[], Pool],
        timeout_s: float,
        *,
        on_policy: Callable[[str, bytes | None, int], None],
        on_policies: Callable[[list[StoredPolicy]], None],
        retry_s: float = 1.0,
        probe_s: float = 2.0,
    ) -> None:
        self._url = url
        self._pool = pool
        self._timeout_s = timeout_s
        self._on_policy = on_policy
        self._on_policies = on_policies
        self._retry_s = retry_s
        self._probe_s = probe_s
        #: The listener's backend pid while it listens (None: not connected).
        self.pid: int | None = None
        #: Other listeners known to LISTEN, in the order learnt.
        self._known: dict[int, None] = {}
        self._seen: collections.OrderedDict[tuple[str, int], _Seen] = collections.OrderedDict()
        self._queue: asyncio.Queue[tuple[int, str, str] | None] = asyncio.Queue(MAX_QUEUED)
        self._dropped = False

    def listeners(self) -> frozenset[int]:
        """The other listeners (their backend pids) this one has heard of."""
        return frozenset(self._known)

    # -- the storing instance --------------------------------------------------------------
    async def tell(self, request_id: str, ms: int) -> None:
        """Return once every other live listener confirmed the policy of `request_id` stored at
        `ms`, or after `timeout_s` (logged, counted)."""
        if self._timeout_s <= 0:
            return
        if self.pid is None:
            metrics.POLICY_PROPAGATION.labels("unconfirmed").inc()
            log.warning("policy_unconfirmed", request_id=request_id, reason="listener_down")
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self._timeout_s
        seen = self._entry((request_id, ms))
        gone: set[int] = set()
        next_check = start + ALIVE_CHECK_S
        while True:
            seen.changed.clear()
            waiting = None if seen.expected is None else seen.expected - seen.acked - gone
            if waiting is not None and not waiting:
                metrics.POLICY_PROPAGATION.labels("confirmed").inc()
                log.debug(
                    "policy_confirmed",
                    request_id=request_id,
                    instances=len(seen.expected or ()) - len(gone),
                    waited_ms=round((loop.time() - start) * 1000),
                )
                return
            now = loop.time()
            if now >= deadline:
                metrics.POLICY_PROPAGATION.labels("timeout").inc()
                log.warning(
                    "policy_propagation_timeout",
                    request_id=request_id,
                    waiting_for=len(waiting) if waiting is not None else None,
                    timeout_s=self._timeout_s,
                )
                return
            if waiting and now >= next_check:
                gone |= waiting - await self._connected(waiting)
                next_check = loop.time() + ALIVE_CHECK_S
                continue
            try:
                async with asyncio.timeout(min(deadline, next_check) - now):
                    await seen.changed.wait()
            except TimeoutError:
                pass

    async def _connected(self, pids: frozenset[int]) -> set[int]:
        """Which of `pids` are still connected listeners; the others are forgotten. A store that
        cannot answer: all of them (waited for until the timeout)."""
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S), self._pool().acquire() as conn:
                alive = await policies.connected(conn, sorted(pids), APPLICATION)
        except (*FAILURES, TimeoutError):
            raise_if_cancelling()
            return set(pids)
        for pid in pids - alive:
            self._known.pop(pid, None)
        return alive

    def _entry(self, key: tuple[str, int]) -> _Seen:
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _Seen()
            if len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)
        return seen

    # -- every instance --------------------------------------------------------------------
    async def run(self) -> None:
        """Forever: listen (see the module docstring); a lost connection is made again after `retry_s`."""
        while True:
            conn: Connection | None = None
            try:
                conn = await connect.own_connection(
                    self._url,
                    timeout_s=_PROBE_TIMEOUT_S * 5,
                    cancel_wait_s=_PROBE_TIMEOUT_S,
                    application_name=APPLICATION,
                )
                await self._listen(conn)
            except (*FAILURES, TimeoutError) as exc:
                raise_if_cancelling()
                log.warning("policy_listener_lost", error=repr(exc))
            finally:
                self.pid = None
                if conn is not None:
                    conn.terminate()
            await asyncio.sleep(self._retry_s)

    def _notified(self, _conn: object, pid: int, channel: str, payload: object) -> None:
        try:
            self._queue.put_nowait((pid, channel, str(payload)))
        except asyncio.QueueFull:
            self._dropped = True

    def _terminated(self, _conn: object) -> None:
        self.pid = None
        try:
            self._queue.put_nowait(None)
        except asyncio.QueueFull:
            self._dropped = True

    async def _listen(self, conn: Connection) -> None:
        self._queue = asyncio.Queue(MAX_QUEUED)
        conn.add_termination_listener(self._terminated)
        await conn.add_listener(policies.CHANNEL, self._notified)
        await conn.add_listener(policies.ACK_CHANNEL, self._notified)
        await self._reload(conn)
        await policies.announce(conn, "ready")
        pid = conn.get_server_pid()
        self.pid = pid
        log.info("policy_listener_ready", pid=pid)
        while True:
            try:
                async with asyncio.timeout(self._probe_s):
                    item = await self._queue.get()
            except TimeoutError:
                # A connection lost without a word (a network partition) shows here.
                await conn.fetchval("SELECT 1", timeout=_PROBE_TIMEOUT_S)
                continue
            if item is None:
                raise ConnectionError("the policy listener's connection closed")
            if self._dropped:
                self._dropped = False
                log.warning("policy_notices_dropped", queued=MAX_QUEUED)
                await self._reload(conn)
            await self._handle(conn, pid, *item)

    async def _reload(self, conn: Connection) -> None:
        self._on_policies(await policies.all_policies(conn))

    async def _handle(self, conn: Connection, own: int, pid: int, channel: str, payload: str) -> None:
        if channel == policies.CHANNEL:
            try:
                key = policies.read_notice(payload)
            except ValueError:
                log.error("policy_notice_unreadable", payload=payload[:100])
                return
            seen = self._entry(key)
            if seen.expected is None:
                seen.expected = frozenset(self._known)
                seen.changed.set()
            stored = await policies.policy(conn, key[0])
            if stored is None:
                self._on_policy(key[0], None, key[1])
            else:
                self._on_policy(key[0], stored.doc, stored.set_ms)
            await policies.announce(conn, "ack " + payload)
            return
        if pid == own:
            return
        if pid not in self._known:
            log.info("policy_listener_seen", pid=pid)
            self._known[pid] = None
            if len(self._known) > MAX_KNOWN:
                del self._known[next(iter(self._known))]
        if payload == "ready":
            await policies.announce(conn, "here")
        elif payload.startswith("ack "):
            try:
                key = policies.read_notice(payload[4:])
            except ValueError:
                return
            seen = self._entry(key)
            seen.acked.add(pid)
            seen.changed.set()
