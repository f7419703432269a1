"""Dispatch over PostgreSQL: any instance handles any hook of any vehicle.

The rules are the worker's (`worker.Worker`), run on each vehicle's stored state. Vehicle events are
gathered for `batch_window_s` into batches (one event per vehicle, a vehicle in one batch at a time, so
its events keep their order): one statement loads the vehicles, a worker per event decides, one
statement saves what changed for each vehicle still as loaded (`save_many`; the others run again).
Sends are published and outcomes reported only after that commit; heartbeats are gathered for
`heartbeat_window_s` and filtered in one statement. Everything queued is bounded (`max_queued`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import time
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
    NOTHING_KEPT,
    InFlight,
    Kept,
    LatencyListener,
    OutcomeListener,
    Pacing,
    Publisher,
    ResponseListener,
    StartBudget,
    VehicleState,
    Worker,
    count_sent,
)
from storage.model import Outcome, Row
from storage.postgres import dispatch as pgd
from storage.postgres import pacing as pg_pacing
from storage.postgres.errors import RETRYABLE
from storage.postgres.types import Connection, Pool

log = structlog.get_logger("sdv_fanout.dispatch")

#: The commands that name one vehicle.
VinCommand = MaybeSend | Acknowledge | Responded | Connected | Down | Refused | Requeue

#: Deliverable rows read with a vehicle's state: the worker needs at most two in one event (a
#: row it ends for good, then the next); one more for safety.
_PREFETCH = 3
#: Vehicles one page of a sweep, a broker reconnect or a bulk filter covers.
_PAGE = 1000
#: A running batch this slow (waiting for a row another session holds, say) no longer holds back
#: the next one.
_SLOW_BATCH_S = 0.05
#: Times an event may find its vehicle held by another instance (or changed by it between the
#: load and the save) before it is dropped.
_MAX_TRIES = 50
#: Separates a session's fields in its stored text (never part of a node name, clientid or host).
_SEP = "\x1f"


def encode_session(session: Session) -> str:
    return _SEP.join((session.node, session.clientid, session.peerhost, str(session.peerport)))


def decode_session(text: str) -> Session:
    node, clientid, host, port = text.split(_SEP)
    return Session(node, clientid, host, int(port))


def _state(loaded: pgd.Loaded) -> VehicleState:
    """The worker's view of a vehicle's stored state."""
    presence = decode_session(loaded.presence) if loaded.presence is not None else None
    m = loaded.marker
    if m is None:
        return presence, None, None
    if m.voided:
        return presence, None, (m.request_id, m.sha1, m.attempts, m.await_response)
    # The row out is usually among the vehicle's first rows loaded (the oldest deliverable):
    # its stored time gives the stored -> PUBACK latency (unknown otherwise: none is counted).
    stored = next((r.ts_ms for r, _ in loaded.rows if (r.request_id, r.sha1) == (m.request_id, m.sha1)), 0)
    entry = InFlight(
        m.request_id,
        m.sha1,
        decode_session(m.session),
        m.sent_ms / 1000,
        m.attempts,
        m.await_response,
        None if m.acked_ms is None else m.acked_ms / 1000,
        m.cancelled,
        stored,
    )
    return presence, entry, None


def _marker(state: VehicleState) -> pgd.Marker | None:
    """The stored form of the worker's delivery for a vehicle."""
    _, entry, voided = state
    if entry is not None:
        acked = None if entry.acked_at is None else round(entry.acked_at * 1000)
        return pgd.Marker(
            entry.request_id,
            entry.sha1,
            encode_session(entry.session),
            round(entry.sent_at * 1000),
            entry.attempts,
            entry.await_response,
            acked,
            entry.cancelled,
        )
    if voided is not None:
        rid, sha1, attempts, await_response = voided
        return pgd.Marker(rid, sha1, "", 0, attempts, await_response, voided=True)
    return None


class _BatchPacing:
    """Pacing as one batch of vehicle events sees it: the instance's tokens (`Pacer`), the
    requests blocked when the batch loaded its rows (passed over in the load: still blocked for
    these events, so a vehicle that found nothing for them waits for their capacity even if a tick
    opened them meanwhile), and the room left under each capped request's max_in_flight as
    counted for this batch."""

    def __init__(self, pacer: Pacer, room: dict[str, int], loaded_blocked: frozenset[str] = frozenset()) -> None:
        self._pacer = pacer
        self._room = room
        self._loaded_blocked = loaded_blocked
        self.full = {rid for rid, left in room.items() if left <= 0}

    def blocked(self) -> frozenset[str]:
        blocked = self._pacer.blocked()
        if self._loaded_blocked and not self._loaded_blocked <= blocked:
            blocked = blocked | self._loaded_blocked
        return blocked | self.full if self.full else blocked

    def started(self, request_id: str, vin: str) -> None:
        self._pacer.started(request_id)
        left = self._room.get(request_id)
        if left is not None:
            self._room[request_id] = left - 1
            if left <= 1:
                self.full.add(request_id)

    def out(self, request_id: str, delta: int) -> None:
        pass  # counted in the database (sdv_pacing_out), not by a worker that lives for one event

    def idle(self, vin: str) -> None:
        self._pacer.idle(vin, self.blocked())


class _EventRows:
    """The worker's RowSource for one event: the rows read with the vehicle's state; ends are
    recorded and written in the event's transaction (the worker only reports them once written)."""

    def __init__(self, rows: list[tuple[Row, bytes]]) -> None:
        self._rows = rows
        self.ends: list[tuple[str, bytes, Outcome, int, bytes]] = []

    def oldest(
        self, vin: str, skip: frozenset[str] | None = None, high: frozenset[str] | None = None
    ) -> tuple[Row, bytes] | None:
        # The rows are in delivery order as loaded (with the same `high`): the first one goes.
        ended = {(rid, sha1) for rid, sha1, *_ in self.ends}
        for row, payload in self._rows:
            if (row.request_id, row.sha1) not in ended and not (skip and row.request_id in skip):
                return row, payload
        return None

    def ack(
        self,
        vin: str,
        request_id: str,
        sha1: bytes,
        *,
        outcome: Outcome = Outcome.DELIVERED,
        attempts: int = 1,
        response: bytes = b"",
    ) -> bool:
        self.ends.append((request_id, sha1, outcome, attempts, response))
        return True

    def acking(self, vin: str, request_id: str, sha1: bytes) -> bool:
        return False  # an ack is written inside its event: never half done between events

    # The vehicle's delivery state, attempts and PUBACK included, is stored with every event
    # (`_marker`): nothing more to keep, and nothing kept apart from it.
    def tried(self, vin: str, request_id: str, sha1: bytes, stored_ms: int = -1) -> Kept:
        return NOTHING_KEPT

    def sent(self, vin: str, row: Row, attempts: int) -> None:
        pass

    def awaiting(self, vin: str, request_id: str, sha1: bytes, attempts: int, session: Session) -> None:
        pass


class _Sends:
    """The worker's Publisher for one event: publishes wait for the commit."""

    def __init__(self, connected: Callable[[], bool]) -> None:
        self._connected = connected
        self.queued: list[tuple[str, str, bytes, int]] = []

    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        if not self._connected():
            return False
        self.queued.append((vin, request_id, payload, expires_ms))
        return True


class _Reports:
    """Sends, outcomes and answers the worker reported during one event, passed on after the
    commit (a send whose save was refused is neither counted nor logged)."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, str, str, bool]] = []
        self.outcomes: list[tuple[str, str, bytes, Outcome, int]] = []
        self.responses: list[tuple[str, str, bytes, bytes, int]] = []
        self.latencies: list[tuple[str, str, bytes, str, int, bool]] = []

    def started(self, vin: str, request_id: str, trigger: str, resend: bool) -> None:
        self.starts.append((vin, request_id, trigger, resend))

    def outcome(self, vin: str, request_id: str, sha1: bytes, outcome: Outcome, attempts: int) -> None:
        self.outcomes.append((vin, request_id, sha1, outcome, attempts))

    def response(self, vin: str, request_id: str, sha1: bytes, payload: bytes, size: int) -> None:
        self.responses.append((vin, request_id, sha1, payload, size))

    def latency(self, vin: str, request_id: str, sha1: bytes, stage: str, ms: int, ends: bool) -> None:
        self.latencies.append((vin, request_id, sha1, stage, ms, ends))


@dataclass(slots=True)
class _Queued:
    """A vehicle event waiting for a batch: what to do with the vehicle's worker, who waits for
    its result, and how often it ran into another instance's hold on the vehicle."""

    vin: str
    act: Callable[[Worker], Any]
    future: asyncio.Future[Any] | None
    why: str
    tries: int = 0


@dataclass(slots=True)
class _Decided:
    """One event of a batch after the worker's rules ran: what to write, publish and report once
    the save has said it was written."""

    queued: _Queued
    result: Any
    save: pgd.Save | None
    sends: _Sends
    reports: _Reports
    recheck: bool
    verdict: int = pgd.SAVED
    ended: frozenset[tuple[str, bytes]] = frozenset()


class SharedDispatcher:
    """The Dispatcher of an instance whose vehicles' state is in PostgreSQL (pool.Dispatcher's
    interface, so hooks, acks, the Admin API and housekeeping use either).

    Most hooks never need a vehicle's lock. Heartbeats are gathered for `heartbeat_window_s` and
    asked about in one statement (`storage.postgres.dispatch.heartbeats`): only a vehicle whose
    recorded connection changed or that has work and a free slot gets an event. A new batch asks the
    same of its VINs (`present_wanting`). The timeout sweep and a broker reconnect page through the
    vehicles concerned. An event that cannot be queued (`max_queued`) is dropped with a warning and a
    metric, and the vehicle's next heartbeat or the sweep recovers it.
    """

    def __init__(
        self,
        pool: Pool,
        publisher: Publisher,
        *,
        lanes: int,
        inflight_timeout_s: float,
        sender: Callable[[], str],
        connected: Callable[[], bool],
        vin_from_clientid: Callable[[str], bool] | None = None,
        on_outcome: OutcomeListener | None = None,
        max_attempts: int = 0,
        response_timeout_s: float = 300.0,
        on_response: ResponseListener | None = None,
        heartbeat_window_s: float = 0.02,
        batch_window_s: float = 0.005,
        batch_max: int = 200,
        max_queued: int = 100_000,
        event_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        held: Callable[[], frozenset[str]] | None = None,
        high: Callable[[], frozenset[str]] | None = None,
        budget: StartBudget | None = None,
        pacing: Pacer | None = None,
        on_latency: LatencyListener | None = None,
    ) -> None:
        self._pool = pool
        #: This instance's delivery budget (max_deliveries_per_s); None: unbounded.
        self._budget = budget
        #: Campaign pacing: rates from this instance's leases, max_in_flight counted in the database.
        self._pacing = pacing
        self._on_latency = on_latency
        #: Request ids held by their campaign policy (dispatch/gates.py): their rows are not loaded.
        self._held = held
        #: Request ids whose policy gives their rows high priority (dispatch/gates.py).
        self._high = high
        self._publisher = publisher
        self._inflight_timeout_s = inflight_timeout_s
        self._response_timeout_s = response_timeout_s
        self._max_attempts = max_attempts
        self._on_outcome = on_outcome
        self._on_response = on_response
        self._sender = sender
        self._connected = connected
        self._vin_from_clientid = vin_from_clientid
        self._window_s = heartbeat_window_s
        self._max_queued = max_queued
        self._event_timeout_s = event_timeout_s
        self._clock = clock
        self._timeouts = pgd.Timeouts(round(inflight_timeout_s * 1000), round(response_timeout_s * 1000))
        self._batch_window_s = batch_window_s
        self._batch_max = batch_max
        #: Batches that may run at once, one pool connection each.
        self._slots = lanes
        self.ring = HashRing({f"l{i}": 0 for i in range(lanes)})
        #: The database outlives instances: every start of a node is acted on (what is dropped is
        #: only what was recorded before it), once per instance.
        self._node_starts = NodeStarts(lambda: 0)
        #: Vehicle events not yet in a batch, in arrival order; the VINs of the running batches.
        self._waiting: collections.deque[_Queued] = collections.deque()
        self._busy: set[str] = set()
        self._running = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        #: Events queued or in a running batch.
        self._queued = 0
        #: clientid -> VINs it stands for besides its own name (see pool.Dispatcher._remember).
        self._clients: dict[str, set[str]] = {}
        #: VIN -> the session of its latest heartbeat not yet looked at (the gathering window).
        self._beats: dict[str, Session] = {}
        self._beat = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._sweeping = False

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._gather_events(), name="events"),
            asyncio.create_task(self._gather_heartbeats(), name="heartbeats"),
        ]

    async def stop(self) -> None:
        """Handle the vehicle events already queued (a PUBACK or an answer taken from the broker
        exists nowhere else), for at most `event_timeout_s`, then stop."""
        deadline = time.monotonic() + self._event_timeout_s
        while self._queued and self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        tasks = self._tasks + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []

    def backlog(self) -> int:
        """Events queued and not yet handled (heartbeats in the gathering window included)."""
        return self._queued + len(self._beats)

    def drain_now(self) -> None:
        """Nothing to do: events run in tasks of their own, not on a loop turn's queue."""

    # -- running vehicle events, in batches ------------------------------------------
    def _submit(
        self, vin: str, act: Callable[[Worker], Any], future: asyncio.Future[Any] | None = None, why: str = ""
    ) -> bool:
        if self._queued >= self._max_queued:
            metrics.DISPATCH_DROPPED.labels(why or "event").inc()
            log.warning("dispatch_event_dropped", vin=vin, reason="queue_full", event=why)
            if future is not None:
                future.set_result(None)
            return False
        self._waiting.append(_Queued(vin, act, future, why))
        self._queued += 1
        self._wake.set()
        return True

    def submit(self, cmd: VinCommand) -> None:
        """Queue a command for its vehicle."""
        self._submit(cmd.vin, lambda w: w.handle(cmd), why=type(cmd).__name__)

    async def _gather_events(self) -> None:
        """Forever: gather vehicle events for `batch_window_s` (or until a full batch waits),
        then run them as one batch. Events arriving while a batch runs wait for the next one
        unless a full batch is waiting or the running one is slow (`_SLOW_BATCH_S`: one vehicle
        whose rows another session holds must not stop every other vehicle); up to `lanes`
        batches run at once. One event per vehicle per batch, a vehicle in one batch at a time:
        each vehicle's events run one at a time, in arrival order."""
        while True:
            if not self._waiting or self._running >= self._slots:
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._waiting) < self._batch_max:
                await asyncio.sleep(self._batch_window_s)
                if self._running and len(self._waiting) < self._batch_max:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_SLOW_BATCH_S):
                            await self._idle.wait()
            batch = self._pick()
            if not batch:  # every waiting vehicle is in a running batch
                self._wake.clear()
                await self._wake.wait()
                continue
            self._running += 1
            self._idle.clear()
            self._spawn(self._run_batch(batch), "batch")

    def _pick(self) -> list[_Queued]:
        """Up to `batch_max` waiting events of distinct vehicles that no running batch holds,
        each the first waiting event of its vehicle (a bounded look at the front of the queue)."""
        picked: list[_Queued] = []
        passed: list[_Queued] = []
        seen: set[str] = set()
        for _ in range(min(len(self._waiting), 4 * self._batch_max)):
            q = self._waiting.popleft()
            if q.vin in seen or q.vin in self._busy:
                passed.append(q)
            else:
                picked.append(q)
                if len(picked) >= self._batch_max:
                    seen.add(q.vin)
                    break
            seen.add(q.vin)
        self._waiting.extendleft(reversed(passed))
        self._busy.update(q.vin for q in picked)
        return picked

    async def _run_batch(self, batch: list[_Queued]) -> None:
        again: list[_Queued] = []
        try:
            again = await self._batch(batch)
        except asyncio.CancelledError:
            raise
        except RETRYABLE as exc:
            # A row another session held past lock_timeout, a deadlock PostgreSQL broke, a
            # serialization failure: the save wrote nothing, so every event of it runs again.
            metrics.DISPATCH_EVENT_FAILURES.inc()
            log.warning("vehicle_batch_retried", vehicles=len(batch), error=repr(exc))
            again = batch
        except Exception as exc:  # one failed batch must not stop dispatch
            metrics.DISPATCH_EVENT_FAILURES.inc()
            log.error("dispatch_event_failed", vin=batch[0].vin, vehicles=len(batch), error=repr(exc))
            for q in batch:
                if q.future is not None and not q.future.done():
                    q.future.set_result(None)
        finally:
            self._busy.difference_update(q.vin for q in batch)
            self._running -= 1
            if not self._running:
                self._idle.set()
            kept = {id(q) for q in again}
            self._queued -= sum(1 for q in batch if id(q) not in kept)
            self._again(again)
            self._wake.set()

    def _again(self, events: list[_Queued]) -> None:
        """Put events that wrote nothing back at the front, in order (before any later event of
        their vehicle); one that has tried `_MAX_TRIES` times is dropped, for the vehicle's next
        heartbeat, the sweep or the in-flight timeout to bring what it would have done."""
        for q in reversed(events):
            q.tries += 1
            if q.tries >= _MAX_TRIES:
                self._queued -= 1
                metrics.DISPATCH_EVENT_FAILURES.inc()
                log.warning("vehicle_locked", vin=q.vin, reason="held_elsewhere", event=q.why)
                if q.future is not None and not q.future.done():
                    q.future.set_result(None)
            else:
                self._waiting.appendleft(q)

    async def _batch(self, batch: list[_Queued]) -> list[_Queued]:
        """Run one batch: load every vehicle (one statement), run each event's rules, save what
        changed (one statement, its own transaction), then publish and report what was saved.
        The events another instance got in the way of, to run again."""
        now = self._clock()
        now_ms = round(now * 1000)
        async with self._pool.acquire() as conn:
            async with asyncio.timeout(self._event_timeout_s):
                held = self._held() if self._held is not None else frozenset()
                high = self._high() if self._high is not None else frozenset()
                pacing = self._pacing
                loaded_blocked = pacing.blocked() if pacing is not None else frozenset()
                if loaded_blocked:
                    held = held | loaded_blocked
                loaded = await pgd.load_many(conn, [q.vin for q in batch], now_ms, _PREFETCH, sorted(held), high)
                trips = 1
                caps = pacing.caps() if pacing is not None else {}
                capped = sorted({r.request_id for lo in loaded.values() for r, _ in lo.rows if r.request_id in caps})
                # Sends of a request with max_in_flight are counted, decided and saved under its
                # PACING lock, in one transaction: no two batches, on any instance, overshoot it.
                async with conn.transaction() if capped else contextlib.nullcontext():
                    room: dict[str, int] = {}
                    if capped:
                        out = await pg_pacing.out(conn, capped)
                        room = {rid: caps[rid] - out.get(rid, 0) for rid in capped}
                        trips += 1
                    view = _BatchPacing(pacing, room, loaded_blocked) if pacing is not None else None
                    decided = [self._decide(q, loaded[q.vin], now, held, high, view) for q in batch]
                    saving = sorted((d for d in decided if d.save is not None), key=lambda d: d.queued.vin)
                    if saving:
                        # In VIN order: the save deletes rows in the store's lock order.
                        verdicts = await pgd.save_many(conn, now_ms, [d.save for d in saving if d.save is not None])
                        trips += 1
                        for d, (verdict, done) in zip(saving, verdicts, strict=True):
                            assert d.save is not None
                            d.verdict = verdict
                            d.ended = frozenset((e[0], e[1]) for e, ok in zip(d.save.ends, done, strict=False) if ok)
                if capped and pacing is not None:
                    for rid in capped:  # what this batch counted and started, until the next count
                        pacing.observe(rid, caps[rid] - room[rid])
            # Saved: published and reported now, whatever the recheck below runs into.
            again = []
            for d in decided:
                if d.verdict != pgd.SAVED:
                    again.append(d.queued)
                    continue
                self._report(d)
            recheck = [d.queued.vin for d in decided if d.recheck and d.verdict == pgd.SAVED]
            if recheck:
                trips += 1
                await self._recheck(conn, recheck)
        metrics.DB_ROUND_TRIPS.labels("event").inc(trips)
        return again

    async def _recheck(self, conn: Connection, vins: list[str]) -> None:
        """A batch's filter reads presence and the slot outside the vehicles' locks: it may have
        found a vehicle offline or its slot taken just before a save whose load read the queue
        before the batch committed, brought it online or freed the slot with nothing more to
        send. Such vehicles are looked at once more after the save's commit, so no new row waits
        for the next heartbeat; if that look fails, the leader's wake-up pass finds them."""
        try:
            async with asyncio.timeout(self._event_timeout_s):
                found = await pgd.with_work(conn, vins, self._now_ms())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            metrics.DISPATCH_EVENT_FAILURES.inc()
            log.warning("recheck_failed", vin=vins[0], vehicles=len(vins), error=repr(exc))
            return
        for vin in found:
            self._submit(vin, functools.partial(_handle, MaybeSend(Trigger.NEW_BATCH, vin)), why="recheck")

    def _decide(
        self,
        q: _Queued,
        loaded: pgd.Loaded,
        now: float,
        held: frozenset[str] = frozenset(),
        high: frozenset[str] = frozenset(),
        pacing: Pacing | None = None,
    ) -> _Decided:
        """The worker's rules on one vehicle's loaded state (read with the request ids `held`
        passed over, in delivery order with those in `high` first): what its event changed."""
        vin = q.vin
        sends = _Sends(self._connected)
        reports = _Reports()
        rows_seen = _EventRows(loaded.rows)
        worker = Worker(
            "event",
            rows_seen,
            sends,
            inflight_timeout_s=self._inflight_timeout_s,
            clock=lambda: now,
            on_outcome=reports.outcome,
            max_attempts=self._max_attempts,
            response_timeout_s=self._response_timeout_s,
            on_response=reports.response,
            held=(lambda: held) if held else None,
            high=(lambda: high) if high else None,
            budget=self._budget,
            pacing=pacing,
            on_latency=reports.latency,
            wall_ms=lambda: round(now * 1000),
            on_sent=reports.started,
        )
        before = _state(loaded)
        worker.restore(vin, before)
        result = q.act(worker)
        after = worker.state_of(vin)
        presence = None if after[0] == before[0] else (encode_session(after[0]) if after[0] else None,)
        marker = _marker(after)
        saved_marker = None if marker == loaded.marker else (marker,)
        save = None
        if presence or saved_marker or rows_seen.ends:
            sender = self._sender() if saved_marker and sends.queued else None
            sends_row = bool(saved_marker and saved_marker[0] is not None and sends.queued)
            save = pgd.Save(vin, loaded, presence, saved_marker, sender, rows_seen.ends, sends_row)
        changed = before[1] is not None or before[0] != after[0]
        recheck = changed and after[0] is not None and after[1] is None and not sends.queued
        return _Decided(q, result, save, sends, reports, recheck)

    def _report(self, d: _Decided) -> None:
        """After the save: publish what the event sent, pass on the outcomes and answers of the
        pairs it ended, and its result to whoever waits for it."""
        for item in d.sends.queued:
            self._publisher.publish(*item)
        for started in d.reports.starts:
            count_sent(*started)
        for vin_, rid, sha1, outcome, attempts in d.reports.outcomes:
            if (rid, sha1) in d.ended and self._on_outcome is not None:
                self._on_outcome(vin_, rid, sha1, outcome, attempts)
        for vin_, rid, sha1, payload, size in d.reports.responses:
            if (rid, sha1) in d.ended and self._on_response is not None:
                self._on_response(vin_, rid, sha1, payload, size)
        for vin_, rid, sha1, stage, ms, ends in d.reports.latencies:
            # A latency that ends its pair counts when this event ended it, as its outcome does.
            if (not ends or (rid, sha1) in d.ended) and self._on_latency is not None:
                self._on_latency(vin_, rid, sha1, stage, ms, ends)
        if d.queued.future is not None and not d.queued.future.done():
            d.queued.future.set_result(d.result)

    def _spawn(self, work: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def pacing_of(self, request_id: str) -> tuple[int, int, str]:
        """Deliveries of `request_id` out fleet-wide (the database's count), and started by this
        instance in the last minute."""
        async with self._pool.acquire() as conn:
            out = await pg_pacing.out(conn, [request_id])
        started = self._pacing.started_last_minute(request_id) if self._pacing is not None else 0
        return out.get(request_id, 0), started, "instance"

    # -- clients ---------------------------------------------------------------
    def _remember(self, clientid: str, vin: str) -> None:
        if vin == clientid and self._vin_from_clientid is not None and self._vin_from_clientid(clientid):
            return
        self._clients.setdefault(clientid, set()).add(vin)

    def vins_of(self, clientid: str) -> set[str] | frozenset[str]:
        known = self._clients.get(clientid, set())
        if self._vin_from_clientid is not None and self._vin_from_clientid(clientid):
            return known | {clientid}
        return known

    # -- events from hooks -------------------------------------------------------
    def new_batch(self, vins: Iterable[str], request_id: str = "") -> None:
        """A batch stored rows for `vins`: ask once which are online with a free slot, then an
        event for each of those."""
        self._spawn(self._new_batch(list(vins)), "new-batch")

    async def _new_batch(self, vins: list[str]) -> None:
        for start in range(0, len(vins), _PAGE):
            async with self._pool.acquire() as conn:
                found = await pgd.present_wanting(conn, vins[start : start + _PAGE], self._now_ms(), self._timeouts)
            metrics.DB_ROUND_TRIPS.labels("batch_filter").inc()
            for vin in found:
                self._submit(vin, functools.partial(_handle, NewBatch((vin,))), why="NewBatch")

    def subscribed(self, session: Session, vin: str) -> None:
        self._remember(session.clientid, vin)
        self.submit(MaybeSend(Trigger.SESSION_SUBSCRIBED, vin, session))

    def resumed(self, session: Session) -> None:
        for vin in self.vins_of(session.clientid):
            self.submit(MaybeSend(Trigger.SESSION_RESUMED, vin, session))

    def heartbeat(self, session: Session, vin: str) -> None:
        self._remember(session.clientid, vin)
        if vin not in self._beats and len(self._beats) >= self._max_queued:
            metrics.DISPATCH_DROPPED.labels("heartbeat").inc()
            return
        self._beats[vin] = session
        self._beat.set()

    async def _gather_heartbeats(self) -> None:
        """One statement per gathering window at most: heartbeats that arrive while one is asked
        about wait for the next window, unless a full page is already waiting. (Going on at once
        whenever any waited made the batch size rate x query time, whatever the window: 0.17
        round trips per heartbeat at 2,000/s instead of 0.02-0.06, bench/pg_serve.py.)"""
        while True:
            await self._beat.wait()
            self._beat.clear()
            await asyncio.sleep(self._window_s)  # the gathering window
            while self._beats:
                beats = dict(itertools.islice(self._beats.items(), _PAGE))
                for vin in beats:
                    del self._beats[vin]
                try:
                    await self._heartbeats(beats)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the next heartbeat of each vehicle asks again
                    metrics.DISPATCH_EVENT_FAILURES.inc()
                    log.error("heartbeat_check_failed", vehicles=len(beats), error=repr(exc))
                if len(self._beats) < _PAGE:
                    break  # the rest (if any) set _beat: the next window takes them

    async def _heartbeats(self, beats: dict[str, Session]) -> None:
        async with self._pool.acquire() as conn:
            async with asyncio.timeout(self._event_timeout_s):
                found = await pgd.heartbeats(conn, list(beats), self._now_ms(), self._timeouts)
        metrics.DB_ROUND_TRIPS.labels("heartbeat_filter").inc()
        for vin, recorded, wanting in found:
            session = beats[vin]
            known = recorded is not None and decode_session(recorded).same_connection(session)
            if wanting or not known:
                metrics.HEARTBEAT_EVENTS.inc()
                self.submit(MaybeSend(Trigger.HEARTBEAT, vin, session))

    def acked(self, session: Session, vin: str, request_id: str, sha1: bytes) -> None:
        self.submit(Acknowledge(vin, session, request_id, sha1))

    def responded(self, session: Session, vin: str, request_id: str, payload: bytes, size: int) -> None:
        self.submit(Responded(vin, session, request_id, payload, size))

    async def cancelled(self, request_id: str, rows: tuple[tuple[str, bytes], ...]) -> int:
        """A cancel ended these (VIN, sha1) rows of `request_id`: how many were out for delivery
        (their stored delivery is marked, so its outcome follows what the vehicle does)."""
        sha1s = dict(rows)
        async with self._pool.acquire() as conn:
            candidates = await pgd.with_marker_of(conn, request_id, list(sha1s))
        futures = []
        loop = asyncio.get_running_loop()
        for vin in candidates:
            future: asyncio.Future[Any] = loop.create_future()
            sha1 = sha1s[vin]
            if self._submit(vin, functools.partial(_mark_cancelled, vin, request_id, sha1), future, "cancel"):
                futures.append(future)
        return sum(1 for marked in await asyncio.gather(*futures) if marked)

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
        """Our MQTT connection changed state: when lost, what it had out is voided (sent again on
        the next trigger); when back, every online vehicle with work and a free slot gets a go."""
        metrics.MQTT_CONNECTED.set(1 if up else 0)
        self._spawn(self.wake_idle() if up else self._broker_lost(), "broker-state")

    async def node_started(self, node: str, started_ms: int) -> None:
        """EMQX node `node` loaded us and started at `started_ms`: the presence and deliveries out
        recorded on it before then belong to sessions that are gone (see pgd.forget_node)."""
        if not self._node_starts.restarted(node, started_ms):
            return
        async with self._pool.acquire() as conn:
            dropped, voided = await pgd.forget_node(conn, node, started_ms)
        if dropped or voided:  # else a first start seen, or a restart that left nothing of ours behind
            log.warning("emqx_node_restarted", node=node, started_ms=started_ms, dropped=dropped, voided=voided)

    async def _broker_lost(self) -> None:
        after = ""
        for _ in range(1 << 20):  # bounded: pages of _PAGE vehicles
            async with self._pool.acquire() as conn:
                vins = await pgd.sent_by(conn, self._sender(), after, _PAGE)
            for vin in vins:
                self._submit(vin, lambda w: w.handle(BrokerLost()), why="broker_lost")
            if len(vins) < _PAGE:
                return
            after = vins[-1]

    async def wake_idle(self) -> None:
        """An event for every online vehicle with work and a free slot, in pages of VINs (after
        our broker link came back, and periodically in the leader: see pgmode.wake_idle_loop)."""
        after: str | None = ""
        for _ in range(1 << 20):
            if after is None:
                return
            for _ in range(200):  # paced: a page at a time while the queue has room (10 s at most)
                if self._queued < self._max_queued // 2:
                    break
                await asyncio.sleep(0.05)
            async with self._pool.acquire() as conn:
                vins, after = await pgd.online_wanting(conn, after, _PAGE, self._now_ms(), self._timeouts)
            for vin in vins:
                self._submit(vin, lambda w: w.handle(BrokerBack()), why="wake_idle")

    def refused(self, vin: str, request_id: str, reason: str, final: bool) -> None:
        self.submit(Refused(vin, request_id, reason, final))

    def sweep(self) -> None:
        """Deliveries past the in-flight or response timeout, wherever they were sent from: an
        event each (called periodically by every instance; a vehicle another instance swept
        first is found fresh and left alone)."""
        if not self._sweeping:
            self._sweeping = True
            self._spawn(self._sweep(), "sweep")

    async def _sweep(self) -> None:
        try:
            async with self._pool.acquire() as conn:
                vins = await pgd.overdue(conn, self._now_ms(), self._timeouts, _PAGE)
            for vin in vins:
                self._submit(vin, lambda w: w.handle(Sweep()), why="sweep")
        finally:
            self._sweeping = False

    def _now_ms(self) -> int:
        return round(self._clock() * 1000)

    # -- introspection (Admin API, gauges) -----------------------------------------
    def refresh_gauges(self) -> None:
        self._spawn(self._refresh_gauges(), "gauges")

    async def _refresh_gauges(self) -> None:
        async with self._pool.acquire() as conn:
            online, out, awaiting = await pgd.totals(conn)
        metrics.ONLINE_VEHICLES.set(online)
        metrics.IN_FLIGHT.set(out)
        metrics.AWAITING_RESPONSE.set(awaiting)

    async def group_totals(self) -> tuple[int, int, int]:
        """(online vehicles, deliveries in flight) over every instance, and this one's queue."""
        async with self._pool.acquire() as conn:
            online, out, _ = await pgd.totals(conn)
        return online, out, self.backlog()

    async def vehicle_state(self, vin: str) -> tuple[Session | None, InFlight | None]:
        """(presence session, in-flight entry) of `vin` as stored."""
        async with self._pool.acquire() as conn, conn.transaction():
            loaded = await pgd.load(conn, vin, self._now_ms(), 0)
        presence, entry, _ = _state(loaded)
        return presence, entry

    async def online_among(self, vins: Sequence[str]) -> int:
        """How many of `vins` are online, on any instance."""
        async with self._pool.acquire() as conn:
            return await pgd.online_among(conn, vins)

    async def group_online(self) -> list[str]:
        """Every online VIN, sorted (for paging)."""
        found: list[str] = []
        after = ""
        async with self._pool.acquire() as conn:
            for _ in range(1 << 20):
                page = await pgd.online_page(conn, after, 10_000)
                found += page
                if len(page) < 10_000:
                    break
                after = page[-1]
        return found


def _handle(cmd: Command, worker: Worker) -> None:
    worker.handle(cmd)


def _mark_cancelled(vin: str, request_id: str, sha1: bytes, worker: Worker) -> bool:
    return worker.mark_cancelled(vin, request_id, sha1)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        metrics.DISPATCH_EVENT_FAILURES.inc()
        log.error("dispatch_task_failed", task=task.get_name(), error=repr(task.exception()))
