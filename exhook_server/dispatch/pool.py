"""The worker pool: routes each event to the worker that owns its VIN, on a hash ring.

Hook handlers call the event methods here and return at once; the work runs
behind the answer on the workers' queues. The pool also keeps which VINs each
MQTT client stands for, because disconnect and resume hooks carry only the
client, not the VIN.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

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
    Requeue,
    Session,
    Sweep,
    Trigger,
)
from exhook_server.dispatch.ring import HashRing
from exhook_server.dispatch.worker import Publisher, RowSource, Worker

log = structlog.get_logger("sdv_fanout.dispatch")

_NO_VINS: frozenset[str] = frozenset()


class Dispatcher:
    """N workers, one asyncio queue each; a VIN's commands always go to the same worker, in order."""

    def __init__(
        self,
        rows: RowSource,
        publisher: Publisher,
        *,
        workers: int,
        inflight_timeout_s: float,
        vin_from_clientid: Callable[[str], bool] | None = None,
    ) -> None:
        names = [f"w{i}" for i in range(workers)]
        self.ring = HashRing(names)
        self._queues: dict[str, asyncio.Queue[Command]] = {n: asyncio.Queue() for n in names}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.workers = {
            n: Worker(n, rows, publisher, inflight_timeout_s=inflight_timeout_s, requeue=self._requeue_threadsafe)
            for n in names
        }
        self._vin_from_clientid = vin_from_clientid
        #: clientid → the VINs it subscribed or heartbeated for since start-up.
        self._clients: dict[str, set[str]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._run(n), name=f"dispatch-{n}") for n in self._queues]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, name: str) -> None:
        queue, worker = self._queues[name], self.workers[name]
        while True:
            cmd = await queue.get()
            try:
                worker.handle(cmd)
            except Exception:  # one bad command must not stop the worker
                log.exception("dispatch_command_failed", worker=name, command=repr(cmd))

    def backlog(self) -> int:
        """Commands queued and not yet handled, over all workers."""
        return sum(q.qsize() for q in self._queues.values())

    # -- routing ---------------------------------------------------------------
    def submit(self, cmd: Command) -> None:
        """Queue a command on the worker that owns its VIN (event-loop thread only)."""
        assert not isinstance(cmd, BrokerLost | BrokerBack | Sweep | NewBatch)
        self._queues[self.ring.owner(cmd.vin)].put_nowait(cmd)

    def _broadcast(self, cmd: Command) -> None:
        for queue in self._queues.values():
            queue.put_nowait(cmd)

    def _requeue_threadsafe(self, cmd: Command) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.submit, cmd)

    def _remember(self, clientid: str, vin: str) -> None:
        self._clients.setdefault(clientid, set()).add(vin)

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
        by_worker: dict[str, list[str]] = {}
        owner = self.ring.owner
        for vin in vins:
            by_worker.setdefault(owner(vin), []).append(vin)
        for name, mine in by_worker.items():
            self._queues[name].put_nowait(NewBatch(tuple(mine)))

    def subscribed(self, session: Session, vin: str) -> None:
        self._remember(session.clientid, vin)
        self.submit(MaybeSend(Trigger.SESSION_SUBSCRIBED, vin, session))

    def resumed(self, session: Session) -> None:
        for vin in self.vins_of(session.clientid):
            self.submit(MaybeSend(Trigger.SESSION_RESUMED, vin, session))

    def heartbeat(self, session: Session, vin: str) -> None:
        self._remember(session.clientid, vin)
        self.submit(MaybeSend(Trigger.HEARTBEAT, vin, session))

    def acked(self, session: Session, vin: str, request_id: str, sha1: bytes) -> None:
        self.submit(Acknowledge(vin, session, request_id, sha1))

    def connected(self, session: Session) -> None:
        for vin in self.vins_of(session.clientid):
            self.submit(Connected(vin, session))

    def ended(self, session: Session, reason: EndReason) -> None:
        for vin in self.vins_of(session.clientid):
            self.submit(Down(vin, session, reason))

    def requeue(self, vin: str) -> None:
        self.submit(Requeue(vin))

    # -- events from the delivery client ---------------------------------------
    def broker_connected(self, up: bool) -> None:
        """Our MQTT connection changed state (event-loop thread)."""
        metrics.MQTT_CONNECTED.set(1 if up else 0)
        self._broadcast(BrokerBack() if up else BrokerLost())

    def sweep(self) -> None:
        """Re-send timed-out deliveries (called periodically by the server)."""
        self._broadcast(Sweep())

    # -- introspection -----------------------------------------------------------
    def refresh_gauges(self) -> None:
        metrics.ONLINE_VEHICLES.set(sum(len(w.presence) for w in self.workers.values()))
        metrics.IN_FLIGHT.set(sum(len(w.inflight) for w in self.workers.values()))

    def worker_of(self, vin: str) -> Worker:
        return self.workers[self.ring.owner(vin)]

    def online(self) -> list[str]:
        """Every VIN with a live session, sorted (for paging)."""
        return sorted(vin for w in self.workers.values() for vin in w.presence)

    def in_flight_count(self) -> int:
        return sum(len(w.inflight) for w in self.workers.values())
