"""LMDB: the worker pool, routing each event to the worker that owns its VIN on a hash ring.

Hook handlers call the event methods here and return at once; the work runs behind the answer on
the workers' queues. The pool also keeps which VINs each MQTT client stands for (disconnect and
resume hooks carry only the client). With several server processes the ring spans all of their
workers: an event for a VIN (or client) another process owns is forwarded to it (`peers.Peers`),
so each VIN has exactly one owner, whose state needs no locks.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from exhook_server import metrics
from exhook_server.dispatch.commands import (
    Acknowledge,
    BrokerBack,
    BrokerLost,
    Command,
    Connected,
    Down,
    EndReason,
    MaybeSend,
    NewBatch,
    NodeRestarted,
    Refused,
    Requeue,
    Responded,
    Session,
    Sweep,
    Trigger,
)
from exhook_server.dispatch.pacing import Pacer
from exhook_server.dispatch.restarts import NodeStarts
from exhook_server.dispatch.ring import HashRing
from exhook_server.dispatch.worker import (
    Kept,
    LatencyListener,
    OutcomeListener,
    Pacing,
    Publisher,
    ResponseListener,
    RowSource,
    StartBudget,
    Worker,
)

log = structlog.get_logger("sdv_fanout.dispatch")

_NO_VINS: frozenset[str] = frozenset()
#: Commands handled per event-loop turn at most.
_DRAIN_MAX = 512

#: Dispatcher methods a peer process may ask this one to run for a client it owns.
_CLIENT_EVENTS = frozenset({"subscribed", "resumed", "heartbeat", "connected", "ended"})


@dataclass(frozen=True, slots=True)
class ClientEvent:
    """A client-level event handed to the process that owns the clientid (see _client_elsewhere)."""

    method: str
    args: tuple[Any, ...]


class Dispatcher:
    """N workers; a VIN's commands always go to the same worker, in order.

    Commands of this process's workers wait in one FIFO, drained by a loop callback: workers
    never await, so a task and an asyncio.Queue per worker would only add a future, a wake-up and
    a task step per command.
    """

    def __init__(
        self,
        rows: RowSource,
        publisher: Publisher,
        *,
        workers: int,
        inflight_timeout_s: float,
        vin_from_clientid: Callable[[str], bool] | None = None,
        process: int = 0,
        processes: int = 1,
        forward: Callable[[int, Any], None] | None = None,
        ask: Callable[[int, Any], Awaitable[Any]] | None = None,
        on_outcome: OutcomeListener | None = None,
        max_attempts: int = 0,
        response_timeout_s: float = 300.0,
        on_response: ResponseListener | None = None,
        held: Callable[[], frozenset[str]] | None = None,
        pacing: Pacing | None = None,
        high: Callable[[], frozenset[str]] | None = None,
        budget: StartBudget | None = None,
        on_latency: LatencyListener | None = None,
    ) -> None:
        if processes > 1 and forward is None:
            raise ValueError("a dispatcher in a group of processes needs a way to forward to them")
        # One ring over every worker of every process: a VIN hashes once to its owner, and a
        # clientid hashes the same way, so a vehicle whose clientid is its VIN stays in one process.
        if processes == 1:
            where = {f"w{i}": 0 for i in range(workers)}
        else:
            where = {f"p{p}w{i}": p for p in range(processes) for i in range(workers)}
        self.ring = HashRing(where)
        self._process_of_node = where
        self._process = process
        self._forward = forward
        self._ask = ask
        self._processes = processes
        local = [n for n, p in where.items() if p == process]
        self._inbox: collections.deque[tuple[Worker, Command]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_handle: asyncio.Handle | None = None
        self.workers = {
            n: Worker(
                n,
                rows,
                publisher,
                inflight_timeout_s=inflight_timeout_s,
                on_outcome=on_outcome,
                max_attempts=max_attempts,
                response_timeout_s=response_timeout_s,
                on_response=on_response,
                held=held,
                pacing=pacing,
                high=high,
                budget=budget,
                on_latency=on_latency,
            )
            for n in local
        }
        self._vin_from_clientid = vin_from_clientid
        self._pacing = pacing
        #: clientid → the VINs it subscribed or heartbeated for since start-up; none for a client
        #: that only stands for the VIN it is named after (see _remember).
        self._clients: dict[str, set[str]] = {}
        self._node_starts = NodeStarts()

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._inbox:
            self._schedule()

    async def stop(self) -> None:
        if self._drain_handle is not None:
            self._drain_handle.cancel()
            self._drain_handle = None
        self._loop = None

    def _enqueue(self, worker: Worker, cmd: Command) -> None:
        self._inbox.append((worker, cmd))
        if self._drain_handle is None and self._loop is not None:
            self._schedule()

    def _schedule(self) -> None:
        assert self._loop is not None
        self._drain_handle = self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Handle the queued commands, a bounded number per loop turn: hook calls arriving
        meanwhile are answered between turns, whatever the backlog."""
        self._drain_handle = None
        inbox = self._inbox
        for _ in range(min(len(inbox), _DRAIN_MAX)):
            worker, cmd = inbox.popleft()
            try:
                worker.handle(cmd)
            except Exception:  # one bad command must not stop the others
                log.exception("dispatch_command_failed", worker=worker.name, command=repr(cmd))
        if inbox and self._loop is not None:
            self._schedule()

    def drain_now(self) -> None:
        """Handle the queued commands now rather than on the next loop turn (the delivery client
        calls it after each read, so the deliveries its acks free go out with that read's write)."""
        handle = self._drain_handle
        if handle is not None:
            handle.cancel()
            self._drain()

    def backlog(self) -> int:
        """Commands queued and not yet handled, over all workers."""
        return len(self._inbox)

    # -- routing ---------------------------------------------------------------
    def submit(self, cmd: Command) -> None:
        """Queue a command on the worker that owns its VIN, here or in another process
        (event-loop thread only)."""
        assert not isinstance(cmd, BrokerLost | BrokerBack | Sweep | NewBatch | NodeRestarted)
        node = self.ring.owner(cmd.vin)
        worker = self.workers.get(node)
        if worker is not None:
            self._enqueue(worker, cmd)
        else:
            self._send_to(self._process_of_node[node], cmd)

    def _send_to(self, process: int, item: Any) -> None:
        assert self._forward is not None
        metrics.FORWARDED.inc()
        self._forward(process, item)

    def _client_elsewhere(self, method: str, *args: Any) -> bool:
        """Hand a client-level event to the process that owns the clientid: only it knows which
        VINs the client stands for. True when handed over."""
        if self._forward is None:
            return False
        session: Session = args[0]
        process = self._process_of_node[self.ring.owner(session.clientid)]
        if process == self._process:
            return False
        self._send_to(process, ClientEvent(method, args))
        return True

    def receive(self, item: Any) -> None:
        """An item another process forwarded here (event-loop thread)."""
        if isinstance(item, ClientEvent):
            assert item.method in _CLIENT_EVENTS
            getattr(self, item.method)(*item.args)
        elif isinstance(item, NewBatch):
            self.new_batch(item.vins)
        else:
            self.submit(item)

    def _broadcast(self, cmd: Command) -> None:
        for worker in self.workers.values():
            self._enqueue(worker, cmd)

    def _remember(self, clientid: str, vin: str) -> None:
        known = self._clients.get(clientid)
        if known is not None:
            known.add(vin)
            return
        itself = self._vin_from_clientid is not None and self._vin_from_clientid(clientid)
        # The convention (clientid = VIN) needs no entry, vins_of falls back to the clientid: a set
        # per client would be the biggest part of what is kept per online vehicle. A client named
        # like a VIN keeps standing for it when it also stands for others.
        if vin != clientid or not itself:
            self._clients[clientid] = {clientid, vin} if itself else {vin}

    def vins_of(self, clientid: str) -> frozenset[str] | set[str]:
        known = self._clients.get(clientid)
        if known:
            return known
        # Vehicles conventionally connect with their VIN as clientid.
        if self._vin_from_clientid is not None and self._vin_from_clientid(clientid):
            return frozenset((clientid,))
        return _NO_VINS

    # -- events from hooks -------------------------------------------------------
    def new_batch(self, vins: Iterable[str], request_id: str = "") -> None:
        by_node: dict[str, list[str]] = {}
        owner = self.ring.owner
        for vin in vins:
            by_node.setdefault(owner(vin), []).append(vin)
        elsewhere: dict[int, list[str]] = {}
        for node, mine in by_node.items():
            worker = self.workers.get(node)
            if worker is not None:
                self._enqueue(worker, NewBatch(tuple(mine)))
            else:
                elsewhere.setdefault(self._process_of_node[node], []).extend(mine)
        for process, theirs in elsewhere.items():
            self._send_to(process, NewBatch(tuple(theirs)))

    def subscribed(self, session: Session, vin: str) -> None:
        if self._client_elsewhere("subscribed", session, vin):
            return
        self._remember(session.clientid, vin)
        self.submit(MaybeSend(Trigger.SESSION_SUBSCRIBED, vin, session))

    def resumed(self, session: Session) -> None:
        if self._client_elsewhere("resumed", session):
            return
        for vin in self.vins_of(session.clientid):
            self.submit(MaybeSend(Trigger.SESSION_RESUMED, vin, session))

    def heartbeat(self, session: Session, vin: str) -> None:
        if self._client_elsewhere("heartbeat", session, vin):
            return
        self._remember(session.clientid, vin)
        self.submit(MaybeSend(Trigger.HEARTBEAT, vin, session))

    def acked(self, session: Session, vin: str, request_id: str, sha1: bytes) -> None:
        self.submit(Acknowledge(vin, session, request_id, sha1))

    def responded(self, session: Session, vin: str, request_id: str, payload: bytes, size: int) -> None:
        """A publish on the response topic of `vin` (checked by the VIN's worker)."""
        self.submit(Responded(vin, session, request_id, payload, size))

    async def cancelled(self, request_id: str, rows: tuple[tuple[str, bytes], ...]) -> int:
        """A cancel ended these (VIN, sha1) rows of `request_id`: how many were out for delivery
        (their workers mark them, so their outcome follows the delivery), over the group."""
        mine: list[tuple[str, bytes]] = []
        theirs: dict[int, list[tuple[str, bytes]]] = {}
        for vin, sha1 in rows:
            process = self._process_of_node[self.ring.owner(vin)]
            (mine if process == self._process else theirs.setdefault(process, [])).append((vin, sha1))
        count = self._mark_cancelled(request_id, mine)
        if theirs and self._ask is not None:
            asked = [self._ask(p, ("cancelled", request_id, tuple(part))) for p, part in theirs.items()]
            count += sum(await asyncio.gather(*asked))
        return count

    def _mark_cancelled(self, request_id: str, rows: Iterable[tuple[str, bytes]]) -> int:
        count = 0
        for vin, sha1 in rows:
            worker = self.worker_of(vin)
            if worker is not None and worker.mark_cancelled(vin, request_id, sha1):
                count += 1
        return count

    def connected(self, session: Session) -> None:
        if self._client_elsewhere("connected", session):
            return
        for vin in self.vins_of(session.clientid):
            self.submit(Connected(vin, session))

    def ended(self, session: Session, reason: EndReason) -> None:
        if self._client_elsewhere("ended", session, reason):
            return
        for vin in self.vins_of(session.clientid):
            self.submit(Down(vin, session, reason))

    def requeue(self, vin: str) -> None:
        self.submit(Requeue(vin))

    # -- events from the delivery client ---------------------------------------
    def broker_connected(self, up: bool) -> None:
        """Our MQTT connection changed state (event-loop thread)."""
        metrics.MQTT_CONNECTED.set(1 if up else 0)
        self._broadcast(BrokerBack() if up else BrokerLost())

    async def node_started(self, node: str, started_ms: int) -> None:
        """EMQX node `node` loaded us and started at `started_ms`: when that is a restart, every
        process of the group forgets the sessions it held on that node, before this returns."""
        await self._ask_all(("node_started", node, started_ms))

    def _node_started(self, node: str, started_ms: int) -> bool:
        if not self._node_starts.restarted(node, started_ms):
            return False
        log.warning("emqx_node_restarted", node=node, started_ms=started_ms, process=self._process)
        self._broadcast(NodeRestarted(node))
        return True

    def refused(self, vin: str, request_id: str, reason: str, final: bool) -> None:
        """The broker refused one of our deliveries (event-loop thread; see delivery.py)."""
        self.submit(Refused(vin, request_id, reason, final))

    def sweep(self) -> None:
        """Re-send timed-out deliveries (called periodically by the server)."""
        self._broadcast(Sweep())

    def restore_awaited(self, deliveries: Iterable[tuple[str, str, bytes, Kept]]) -> int:
        """At start-up: deliveries PUBACKed before it whose answer is still awaited (VIN, request
        id, sha1, what is kept of it); those of this process's VINs hold their slot again.
        Returns how many."""
        count = 0
        for vin, request_id, sha1, kept in deliveries:
            worker = self.worker_of(vin)
            if worker is not None:
                worker.restore_awaited(vin, request_id, sha1, kept)
                count += 1
        return count

    def carry_out(self, deliveries: Iterable[tuple[str, str, int]]) -> int:
        """At start-up: deliveries out before it (VIN, request id, until when (epoch ms) each
        counts as out); those of this process's VINs count for their campaign's max_in_flight.
        Returns how many."""
        if not isinstance(self._pacing, Pacer):
            return 0
        return self._pacing.carry((vin, rid, until) for vin, rid, until in deliveries if self.worker_of(vin))

    # -- introspection -----------------------------------------------------------
    def refresh_gauges(self) -> None:
        metrics.ONLINE_VEHICLES.set(self.online_count())
        metrics.IN_FLIGHT.set(self.in_flight_count())
        metrics.AWAITING_RESPONSE.set(
            sum(1 for w in self.workers.values() for e in w.inflight.values() if e.acked_at is not None)
        )

    # -- the whole group's view (Admin API) ---------------------------------------
    def answer(self, query: tuple[Any, ...]) -> Any:
        """This process's part of a group-wide question (asked by a peer's Admin API)."""
        if query[0] == "vehicle":
            worker = self.worker_of(query[1])
            return (None, None) if worker is None else (worker.presence.get(query[1]), worker.inflight.get(query[1]))
        if query[0] == "online":
            return self.online()
        if query[0] == "online_among":
            return sum(1 for vin in query[1] if (w := self.worker_of(vin)) is not None and vin in w.presence)
        if query[0] == "totals":
            return self.online_count(), self.in_flight_count(), self.backlog()
        if query[0] == "cancelled":
            return self._mark_cancelled(query[1], query[2])
        if query[0] == "node_started":
            return self._node_started(query[1], query[2])
        if query[0] == "pacing":
            rid = query[1]
            if isinstance(self._pacing, Pacer):  # the workers' entries and those carried over a restart
                return self._pacing.in_flight(rid), self._pacing.started_last_minute(rid)
            return sum(1 for w in self.workers.values() for e in w.inflight.values() if e.request_id == rid), 0
        raise ValueError(f"unknown query {query[0]!r}")

    async def _ask_all(self, query: tuple[Any, ...]) -> list[Any]:
        answers = [self.answer(query)]
        if self._ask is not None:
            others = [p for p in range(self._processes) if p != self._process]
            answers += await asyncio.gather(*(self._ask(p, query) for p in others))
        return answers

    async def vehicle_state(self, vin: str) -> tuple[Any, Any]:
        """(presence session, in-flight entry) of `vin`, from whichever process owns it."""
        worker = self.worker_of(vin)
        if worker is not None or self._ask is None:
            return self.answer(("vehicle", vin))  # type: ignore[no-any-return]
        return await self._ask(self._process_of_node[self.ring.owner(vin)], ("vehicle", vin))  # type: ignore[no-any-return]

    async def group_online(self) -> list[str]:
        """Every VIN online in any process of the group, sorted (for paging)."""
        return sorted(vin for part in await self._ask_all(("online",)) for vin in part)

    async def online_among(self, vins: Sequence[str]) -> int:
        """How many of `vins` are online in any process of the group (each answers for its own)."""
        return sum(await self._ask_all(("online_among", tuple(vins))))

    async def pacing_of(self, request_id: str) -> tuple[int, int, str]:
        """Deliveries of `request_id` in flight and started in the last minute, over the group."""
        parts = await self._ask_all(("pacing", request_id))
        return sum(p[0] for p in parts), sum(p[1] for p in parts), "group"

    async def group_totals(self) -> tuple[int, int, int]:
        """(online vehicles, deliveries in flight, queued commands) over the group."""
        parts = await self._ask_all(("totals",))
        return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)

    def worker_of(self, vin: str) -> Worker | None:
        """The local worker that owns `vin`; None when another process of the group owns it."""
        return self.workers.get(self.ring.owner(vin))

    def online(self) -> list[str]:
        """Every VIN with a live session, sorted (for paging)."""
        return sorted(vin for w in self.workers.values() for vin in w.presence)

    def online_count(self) -> int:
        """VINs with a live session here (a count: no sorting, unlike online())."""
        return sum(len(w.presence) for w in self.workers.values())

    def in_flight_count(self) -> int:
        return sum(len(w.inflight) for w in self.workers.values())
