"""One dispatch worker: the presence and in-flight state of the VINs it owns, and the send rules.

All commands of a VIN reach the same worker in order, so its state needs no locks; `handle` never
waits. The rules (docs/architecture.md; in full on `Worker`): nothing is sent to a VIN without a
live session; at most one delivery per VIN is in flight; the oldest pending row goes first; a row is
published at most `max_attempts` times; a PUBACK counts only from the vehicle's own client; a row
awaiting the vehicle's answer keeps the slot until the answer or `response_timeout_s`. Attempts and
the awaited state outlive the process: the row source keeps them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import structlog

from exhook_server import log as xlog
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
from storage.model import Outcome, Row, now_ms

log = structlog.get_logger("sdv_fanout.dispatch")


class Publisher(Protocol):
    """Sends one delivery; the only way dispatch reaches MQTT."""

    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        """Queue a QoS 1 delivery (with an MQTT 5 Message-Expiry-Interval when `expires_ms`,
        epoch ms, is set); False when there is no broker connection right now."""
        ...


class Kept(NamedTuple):
    """What the row source keeps of a row's deliveries (`RowSource.tried`)."""

    #: Times the row has been published, as far as the store knows.
    attempts: int = 0
    #: The row's answer, not its PUBACK, ends it (await_response).
    awaits: bool = False
    #: Seconds since the vehicle PUBACKed it, its answer awaited since; None: not PUBACKed.
    acked_age_s: float | None = None
    #: The session that PUBACKed it.
    session: Session | None = None


NOTHING_KEPT = Kept()


class RowSource(Protocol):
    """The storage port dispatch needs."""

    def oldest(
        self, vin: str, skip: frozenset[str] | None = None, high: frozenset[str] | None = None
    ) -> tuple[Row, bytes] | None:
        """The next pending row of `vin` with its payload, or None: its high-priority rows (their
        batch asked it, or their request id is in `high`) oldest first, then the others oldest
        first. Rows of the request ids in `skip` (held by their campaign policy) are passed over,
        the next row goes instead."""
        ...

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
        """The row is done (delivered, answered, or failed for good): end it with `outcome` if
        it still holds `sha1` (durably soon, hidden from `oldest` at once), or amend its
        outcome if it was cancelled while out; True when that was started, False when there
        was nothing of that sha1 to end."""
        ...

    def acking(self, vin: str, request_id: str, sha1: bytes) -> bool:
        """True while an `ack` of exactly this row has started and not yet committed: the
        vehicle has it, whatever a cancel records meanwhile (the ack then amends it)."""
        ...

    def tried(self, vin: str, request_id: str, sha1: bytes, stored_ms: int = -1) -> Kept:
        """What is kept of the row's deliveries from before this process started (all zero
        when nothing, the row is gone or holds another payload, or it was stored since: then
        the worker's memory is the whole story, as it is for the one delivery it holds).
        `stored_ms`: the row's timestamp when the caller has it (spares a read for a row
        stored since the start)."""
        ...

    def sent(self, vin: str, row: Row, attempts: int) -> None:
        """`row` was published to `vin`, `attempts` times so far (kept with a later commit)."""
        ...

    def awaiting(self, vin: str, request_id: str, sha1: bytes, attempts: int, session: Session) -> None:
        """`session` PUBACKed the delivery; its answer is awaited from now on."""
        ...


class Pacing(Protocol):
    """What a campaign's pacing asks of dispatch (dispatch/pacing.py)."""

    def blocked(self) -> frozenset[str]:
        """Request ids that may not start a delivery now (no token, or at max_in_flight)."""
        ...

    def started(self, request_id: str, vin: str) -> None:
        """A delivery of `request_id` was published to `vin`."""
        ...

    def out(self, request_id: str, delta: int) -> None:
        """A delivery of `request_id` entered (+1) or left (-1) the in-flight table."""
        ...

    def idle(self, vin: str) -> None:
        """`vin` found nothing to send while some request was blocked."""
        ...


class StartBudget(Protocol):
    """How fast this process starts deliveries (dispatch/budget.py: max_deliveries_per_s)."""

    def admit(self, vin: str, request_id: str, high: bool) -> bool:
        """May `vin` start its delivery of `request_id` now (False: it is offered again later)?"""
        ...

    def forget(self, vin: str) -> None:
        """`vin` went offline."""
        ...


#: Told when dispatch ends a pair: (vin, request_id, sha1, outcome, attempts).
OutcomeListener = Callable[[str, str, bytes, Outcome, int], None]
#: Told of an accepted answer: (vin, request_id, sha1, the answer's first bytes, its full size).
ResponseListener = Callable[[str, str, bytes, bytes, int], None]
#: Told of a delivery's latency: (vin, request_id, sha1, stage, ms, whether the pair ends with it).
#: Stages (storage/latency.py): "delivered" = stored -> PUBACK, "answered" = PUBACK -> answer.
LatencyListener = Callable[[str, str, bytes, str, int, bool], None]
#: Told of a delivery started: (vin, request_id, trigger, whether it is a re-send).
SentListener = Callable[[str, str, str, bool], None]


def count_sent(vin: str, request_id: str, trigger: str, resend: bool) -> None:
    """A delivery published: counted (sent or re-sent) and logged. A worker calls it as it sends;
    over PostgreSQL the dispatcher calls it once the event's save made the send real."""
    (metrics.DELIVERIES_RESENT if resend else metrics.DELIVERIES_SENT).inc()
    if xlog.debug_enabled:
        log.debug("delivery_sent", vin=vin, request_id=request_id, trigger=trigger, resend=resend)


@dataclass(slots=True)
class InFlight:
    request_id: str
    sha1: bytes
    session: Session
    sent_at: float
    #: Times this (request_id, sha1) has been published to the vehicle, this one included.
    attempts: int = 1
    #: The vehicle's answer, not its PUBACK, ends the row.
    await_response: bool = False
    #: When the PUBACK of a delivery awaiting its answer came (clock), else None.
    acked_at: float | None = None
    #: Its row was cancelled while out: the outcome follows what the vehicle does with it.
    cancelled: bool = False
    #: When its row was stored (epoch ms; 0: not known here), for the stored -> PUBACK latency.
    stored_ms: int = 0


class InFlightTable(dict[str, InFlight]):
    """VIN → its delivery in flight, telling pacing of each delivery that enters or leaves it."""

    __slots__ = ("_pacing",)

    def __init__(self, pacing: Pacing) -> None:
        super().__init__()
        self._pacing = pacing

    def __setitem__(self, vin: str, entry: InFlight) -> None:
        before = self.get(vin)
        if before is not None:
            self._pacing.out(before.request_id, -1)
        super().__setitem__(vin, entry)
        self._pacing.out(entry.request_id, 1)

    def __delitem__(self, vin: str) -> None:
        entry = self[vin]
        super().__delitem__(vin)
        self._pacing.out(entry.request_id, -1)

    def pop(self, vin: str, *default: Any) -> Any:
        if vin in self:
            entry = self[vin]
            del self[vin]
            return entry
        return super().pop(vin, *default)


#: What a worker holds for one vehicle: its live session, its delivery in flight, and the
#: (request_id, sha1, attempts, await_response) of a voided one (never both deliveries).
VehicleState = tuple[Session | None, InFlight | None, tuple[str, bytes, int, bool] | None]


V = TypeVar("V")
_NOTHING: frozenset[str] = frozenset()
#: The counters every delivery moves, their label bound once (a labels() lookup each saved).
_ACKED = {True: metrics.DELIVERIES_ACKED.labels("deleted"), False: metrics.DELIVERIES_ACKED.labels("kept")}
_OUTCOME_COUNTERS = {outcome: metrics.OUTCOMES.labels(outcome.label) for outcome in Outcome}
#: Rows one send may end on its way to a row it can send (failed at max_attempts, or found
#: past its response timeout after a restart); the next trigger goes on.
_ENDS_PER_SEND = 16


def _put(table: dict[str, V], vin: str, value: V | None) -> None:
    if value is None:
        table.pop(vin, None)
    else:
        table[vin] = value


class Worker:
    """State and rules for the VINs one worker owns.

    `handle` never waits: reads are short LMDB read transactions, publishes are queued by the MQTT
    client, and an ack's row delete is committed behind it (the row source hides the acked row
    meanwhile, so the next one goes at once).

    Send rules: nothing is sent to a VIN without a live session; at most one delivery per VIN is in
    flight; the oldest pending row goes first; `session_resumed` re-points the in-flight entry (the
    broker session redelivers it) instead of sending again; an entry older than the in-flight
    timeout, or owned by a connection that is gone, is sent again; a PUBACK counts only when it
    comes from the vehicle's own client (the one the delivery went to, or the one it is online with).

    Lifecycle rules: a row is published at most `max_attempts` times, then it ends `failed` and the
    next one goes; a row awaiting the vehicle's answer keeps the slot after its PUBACK until the
    answer (outcome `responded`) or `response_timeout_s` (then `failed`); rows past their expires_at
    or being cancelled are never offered by the row source; a delivery whose row was cancelled while
    out keeps the slot, and its outcome follows what the vehicle does with it.

    Attempts and the answer-awaited state outlive the process: the worker tells the row source of
    every publish and of every PUBACK of a delivery awaiting its answer (`sent`, `awaiting`), and
    asks it (`tried`) about a row it holds nothing of, so a restart resumes the count and the wait.
    """

    def __init__(
        self,
        name: str,
        rows: RowSource,
        publisher: Publisher,
        *,
        inflight_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_outcome: OutcomeListener | None = None,
        max_attempts: int = 0,
        response_timeout_s: float = 300.0,
        on_response: ResponseListener | None = None,
        held: Callable[[], frozenset[str]] | None = None,
        pacing: Pacing | None = None,
        high: Callable[[], frozenset[str]] | None = None,
        budget: StartBudget | None = None,
        on_latency: LatencyListener | None = None,
        wall_ms: Callable[[], int] = now_ms,
        on_sent: SentListener = count_sent,
    ) -> None:
        self.name = name
        #: Told of each delivery it starts.
        self._on_sent = on_sent
        #: This process's delivery budget (max_deliveries_per_s); None: unbounded.
        self._budget = budget
        #: Told of each delivery's latencies; `wall_ms` is the clock rows are stored by.
        self._on_latency = on_latency
        self._wall_ms = wall_ms
        #: Campaign pacing (rates, max_in_flight); None: nothing paced.
        self._pacing = pacing
        #: The request ids whose rows may not start a delivery now (dispatch/gates.py); None: none.
        self._held = held
        #: The request ids whose policy gives their rows high priority (dispatch/gates.py).
        self._high = high
        self._rows = rows
        self._publisher = publisher
        self._timeout = inflight_timeout_s
        self._clock = clock
        self._on_outcome = on_outcome
        self._max_attempts = max_attempts
        self._response_timeout = response_timeout_s
        self._on_response = on_response
        #: VIN → the live session that can receive its deliveries. The biggest state of the
        #: server (one entry per online vehicle): the session shares the key's string when
        #: the clientid is the VIN, see `_own`.
        self.presence: dict[str, Session] = {}
        #: VIN → the one delivery waiting for its PUBACK.
        self.inflight: dict[str, InFlight] = {} if pacing is None else InFlightTable(pacing)
        #: VIN → (request_id, sha1, attempts, await_response) of a delivery published and not
        #: acked whose in-flight entry was voided since: sending it again is a re-send (one more
        #: attempt). While a delivery is in flight, its entry says so instead (one entry per VIN).
        self._unacked: dict[str, tuple[str, bytes, int, bool]] = {}

    def restore(self, vin: str, state: VehicleState) -> None:
        """Put a vehicle's state in place: a store that keeps it outside the process (PostgreSQL,
        exhook_server/backends/postgres/dispatch.py) runs these same rules on it one event at a time."""
        presence, entry, voided = state
        _put(self.presence, vin, presence)
        _put(self.inflight, vin, entry)
        _put(self._unacked, vin, voided)

    def state_of(self, vin: str) -> VehicleState:
        """A copy of what the worker holds for `vin` (see `restore`)."""
        entry = self.inflight.get(vin)
        return self.presence.get(vin), (dataclasses.replace(entry) if entry else None), self._unacked.get(vin)

    def handle(self, cmd: Command) -> None:
        if isinstance(cmd, NewBatch):
            presence = self.presence
            for vin in cmd.vins:
                if vin in presence:
                    self._try_send(vin, Trigger.NEW_BATCH)
        elif isinstance(cmd, MaybeSend):
            self._maybe_send(cmd)
        elif isinstance(cmd, Acknowledge):
            self._acknowledge(cmd)
        elif isinstance(cmd, Down):
            self._down(cmd)
        elif isinstance(cmd, Connected):
            current = self.presence.get(cmd.vin)
            if current is not None and not current.same_connection(cmd.session):
                del self.presence[cmd.vin]
        elif isinstance(cmd, Responded):
            self._responded(cmd)
        elif isinstance(cmd, Refused):
            self._refused(cmd)
        elif isinstance(cmd, Requeue):
            self._void(cmd.vin, force=True)
            self._try_send(cmd.vin, Trigger.REQUEUE)
        elif isinstance(cmd, BrokerLost):
            # Whatever our client had not delivered is gone with its connection.
            for vin in list(self.inflight):
                self._void(vin)
        elif isinstance(cmd, Sweep):
            now = self._clock()
            unanswered = [
                v
                for v, e in self.inflight.items()
                if e.acked_at is not None and now - e.acked_at >= self._response_timeout
            ]
            for vin in unanswered:  # online or not: the outcome should not wait for the vehicle
                self._give_up(vin, self.inflight[vin], "response_timeout")
                self._try_send(vin, Trigger.TIMEOUT)
            late = [v for v, e in self.inflight.items() if e.acked_at is None and now - e.sent_at >= self._timeout]
            for vin in late:
                self._try_send(vin, Trigger.TIMEOUT)
        elif isinstance(cmd, BrokerBack):
            for vin in list(self.presence):
                self._try_send(vin, Trigger.BROKER_BACK)
        elif isinstance(cmd, NodeRestarted):
            self._node_restarted(cmd.node)

    # -- state -------------------------------------------------------------------
    @staticmethod
    def _own(vin: str, session: Session) -> Session:
        """The session to keep for `vin`: when its clientid is the VIN (the convention), holding
        the same string object as the maps' key, so a VIN is stored once."""
        if session.clientid is not vin and session.clientid == vin:
            return session.with_clientid(vin)
        return session

    def _void(self, vin: str, *, force: bool = False) -> None:
        """Forget the VIN's in-flight delivery unacked: it may be sent again (as a re-send). A
        delivery the vehicle PUBACKed and whose answer is awaited stays (the vehicle has it),
        unless `force` (an operator's requeue)."""
        entry = self.inflight.get(vin)
        if entry is None or (entry.acked_at is not None and not force):
            return
        del self.inflight[vin]
        self._unacked[vin] = (entry.request_id, entry.sha1, entry.attempts, entry.await_response)

    def _node_restarted(self, node: str) -> None:
        """Sessions on `node` ended with its restart: forget them, and void what went out to them
        (a delivery PUBACKed and awaiting its answer stays: the vehicle has it). Without this, our
        link's return would send to connections that no longer exist while the vehicles' new ones
        already subscribe, and each of those sends the same delivery again."""
        for vin in [v for v, s in self.presence.items() if s.node == node]:
            del self.presence[vin]
        for vin in [v for v, e in self.inflight.items() if e.session.node == node]:
            self._void(vin)

    # -- rules -------------------------------------------------------------------
    def _maybe_send(self, cmd: MaybeSend) -> None:
        vin, session = cmd.vin, cmd.session
        if session is not None:
            session = self._own(vin, session)
            if cmd.trigger is Trigger.HEARTBEAT:
                current = self.presence.get(vin)
                # A heartbeat proves presence; keep the more precise identity from subscribe.
                if current is None or not current.same_connection(session):
                    self.presence[vin] = session
            else:
                self.presence[vin] = session
            entry = self.inflight.get(vin)
            if entry is not None and cmd.trigger is Trigger.SESSION_RESUMED:
                # The broker session still holds the delivery and redelivers it.
                entry.session = session
                return
            fresh_subscription = cmd.trigger is Trigger.SESSION_SUBSCRIBED
            if entry is not None and fresh_subscription and not entry.session.same_connection(session):
                # A new clean subscription: what the old connection held is gone.
                self._void(vin)
        self._try_send(vin, cmd.trigger)

    def _try_send(self, vin: str, trigger: Trigger) -> None:
        session = self.presence.get(vin)
        if session is None:
            return
        entry = self.inflight.get(vin)
        if entry is not None:
            now = self._clock()
            if entry.acked_at is not None:
                if now - entry.acked_at < self._response_timeout:
                    return  # the vehicle has it and is working on its answer
                self._give_up(vin, entry, "response_timeout")
            else:
                fresh = now - entry.sent_at < self._timeout
                if fresh and entry.session.same_connection(session):
                    return
                if entry.cancelled and not fresh:
                    self._give_up(vin, entry, "cancelled_unacked")
        held = self._held() if self._held is not None else None
        pacing = self._pacing
        blocked = pacing.blocked() if pacing is not None else _NOTHING
        if blocked:
            held = held | blocked if held else blocked
        high = self._high() if self._high is not None else None
        for _ in range(_ENDS_PER_SEND):
            if high:
                found = self._rows.oldest(vin, held or None, high)
            else:
                found = self._rows.oldest(vin, held) if held else self._rows.oldest(vin)
            if found is None:
                self._void(vin)
                if pacing is not None and blocked:
                    pacing.idle(vin)
                return
            row, payload = found
            prior = self._attempts(vin, row.request_id, row.sha1)
            if not prior:
                kept = self._rows.tried(vin, row.request_id, row.sha1, row.ts_ms)
                prior = kept.attempts
                if kept.acked_age_s is not None:
                    # PUBACKed before a restart and its answer still awaited: the vehicle has it.
                    if self._restore_awaited(vin, row.request_id, row.sha1, kept, session):
                        return
                    continue  # its response timeout passed meanwhile: it ended failed
            if self._max_attempts and prior >= self._max_attempts:
                # Sent max_attempts times and never taken: it must not block what follows.
                self._fail(vin, row.request_id, row.sha1, prior, "max_attempts")
                continue
            break
        else:
            return  # the next trigger goes on
        budget = self._budget
        if budget is not None:
            lane = row.high_priority or (high is not None and row.request_id in high)
            if not budget.admit(vin, row.request_id, lane):
                self._void(vin)  # what was out is not out any more: the budget offers the vehicle again
                return
        if not self._publisher.publish(vin, row.request_id, payload, expires_ms=row.expires_ms):
            return  # no broker connection: BrokerBack will try again
        attempts = prior + 1
        resend = attempts > 1
        self.inflight[vin] = InFlight(
            row.request_id,
            row.sha1,
            session,
            self._clock(),
            attempts,
            await_response=row.await_response,
            stored_ms=row.ts_ms,
        )
        self._unacked.pop(vin, None)
        if pacing is not None:
            pacing.started(row.request_id, vin)
        self._rows.sent(vin, row, attempts)
        self._on_sent(vin, row.request_id, trigger.value, resend)

    def _restore_awaited(self, vin: str, request_id: str, sha1: bytes, kept: Kept, session: Session) -> bool:
        """Hold the slot for a delivery PUBACKed before a restart whose answer is awaited, from
        its PUBACK on; True when still awaited, False when its response timeout passed (then it
        ends failed now)."""
        assert kept.acked_age_s is not None
        now = self._clock()
        entry = InFlight(request_id, sha1, kept.session or session, now, max(1, kept.attempts), True)
        entry.acked_at = now - kept.acked_age_s
        self.inflight[vin] = entry
        self._unacked.pop(vin, None)
        if kept.acked_age_s < self._response_timeout:
            return True
        self._give_up(vin, entry, "response_timeout")
        return False

    def restore_awaited(self, vin: str, request_id: str, sha1: bytes, kept: Kept) -> None:
        """At start-up: a delivery PUBACKed before the restart awaits its answer (the sweep
        applies its response timeout even while the vehicle stays away)."""
        if vin not in self.inflight and kept.session is not None:
            self._restore_awaited(vin, request_id, sha1, kept, kept.session)

    def _fail(self, vin: str, request_id: str, sha1: bytes, attempts: int, reason: str, **fields: Any) -> None:
        """End the row `failed` for `reason` (a cancelled one: amended to failed) and forget it;
        a broker's refusal (our link's problem, not the vehicle's) is logged as an error."""
        entry = self.inflight.get(vin)
        if entry is not None and entry.request_id == request_id and entry.sha1 == sha1:
            del self.inflight[vin]
        voided = self._unacked.get(vin)
        if voided is not None and voided[0] == request_id and voided[1] == sha1:
            del self._unacked[vin]
        if self._rows.ack(vin, request_id, sha1, outcome=Outcome.FAILED, attempts=attempts):
            self._ended(vin, request_id, sha1, Outcome.FAILED, attempts)
        metrics.DELIVERIES_FAILED.labels(reason).inc()
        emit = log.error if reason == "broker_refused" else log.warning
        emit("delivery_failed", vin=vin, request_id=request_id, reason=reason, attempts=attempts, **fields)

    def _give_up(self, vin: str, entry: InFlight, reason: str) -> None:
        """Stop waiting for the delivery `entry`: its row ends failed."""
        self._fail(vin, entry.request_id, entry.sha1, entry.attempts, reason)

    def _attempts(self, vin: str, request_id: str, sha1: bytes) -> int:
        """How often (request_id, sha1) has been published to `vin` as far as this worker
        holds it (0: never, or not since this server started: then ask the row source)."""
        entry = self.inflight.get(vin)
        if entry is not None and entry.request_id == request_id and entry.sha1 == sha1:
            return entry.attempts
        voided = self._unacked.get(vin)
        if voided is not None and voided[0] == request_id and voided[1] == sha1:
            return voided[2]
        return 0

    def _acknowledge(self, cmd: Acknowledge) -> None:
        vin, rid, digest = cmd.vin, cmd.request_id, cmd.sha1
        if not self._from_the_vehicle(cmd):
            # Someone else got the delivery (a broker ACL that lets a client read another
            # vehicle's topic): its PUBACK says nothing about the vehicle. The row stays out.
            metrics.ACKS_IGNORED.labels("not_the_vehicle").inc()
            log.warning("ack_ignored", vin=vin, request_id=rid, reason="not_the_vehicle", acker=cmd.session.clientid)
            return
        if self._awaits_answer(cmd):
            return  # the answer, not the PUBACK, frees the slot
        prior = self._attempts(vin, rid, digest)
        if not prior:
            # Sent before a restart (a resumed session redelivered it): the store knows more.
            kept = self._rows.tried(vin, rid, digest)
            if kept.awaits and vin not in self.inflight:
                self._restore_awaited(vin, rid, digest, self._took(vin, rid, digest, kept, cmd.session), cmd.session)
                return  # its answer, not the PUBACK, ends it
            prior = kept.attempts
        attempts = max(1, prior)
        deleted = self._rows.ack(vin, rid, digest, attempts=attempts)
        _ACKED[deleted].inc()
        if deleted:
            self._ended(vin, rid, digest, Outcome.DELIVERED, attempts)
            self._delivered(vin, self.inflight.get(vin), rid, digest, ends=True)
        voided = self._unacked.get(vin)
        if voided is not None and voided[0] == rid and voided[1] == digest:
            del self._unacked[vin]
        entry = self.inflight.get(vin)
        # Only the ack of exactly what is in flight frees the slot: an older delivery of the same
        # request id (replaced since, or duplicated by a reconnect) must not free it.
        if entry is not None and entry.request_id == rid and entry.sha1 == digest:
            del self.inflight[vin]
        self._try_send(vin, Trigger.NEW_BATCH)

    def _delivered(self, vin: str, entry: InFlight | None, request_id: str, sha1: bytes, *, ends: bool) -> None:
        """The first PUBACK of the delivery `entry`: its stored -> PUBACK latency, when known."""
        if self._on_latency is None or entry is None or not entry.stored_ms:
            return
        if entry.request_id == request_id and entry.sha1 == sha1:
            self._on_latency(vin, request_id, sha1, "delivered", self._wall_ms() - entry.stored_ms, ends)

    def _took(self, vin: str, request_id: str, sha1: bytes, kept: Kept, session: Session) -> Kept:
        """`kept` of a delivery awaiting its answer that `session` PUBACKed now (unless it had
        been before): the wait for its answer starts, and is kept."""
        if kept.acked_age_s is not None:
            return kept
        attempts = max(1, kept.attempts)
        self._rows.awaiting(vin, request_id, sha1, attempts, session)
        return Kept(attempts, True, 0.0, session)

    def _from_the_vehicle(self, cmd: Acknowledge) -> bool:
        """Whether the PUBACK comes from the vehicle's own client (`_is_own`). Knowing neither of
        its clients (e.g. a session's redelivery after a restart of this server, before its
        presence was seen), only a client whose id is the VIN."""
        if cmd.vin not in self.inflight and cmd.vin not in self.presence:
            return cmd.session.clientid == cmd.vin
        return self._is_own(cmd.vin, cmd.session.clientid)

    def _is_own(self, vin: str, clientid: str) -> bool:
        """Whether `clientid` is the vehicle's: the client its delivery in flight went to, or the
        one it is online with."""
        entry = self.inflight.get(vin)
        present = self.presence.get(vin)
        return (entry is not None and entry.session.clientid == clientid) or (
            present is not None and present.clientid == clientid
        )

    def _awaits_answer(self, cmd: Acknowledge) -> bool:
        """A PUBACK of a delivery awaiting the vehicle's answer: start its response timeout (the
        vehicle has it now). True when so."""
        vin = cmd.vin
        entry = self.inflight.get(vin)
        if entry is not None and entry.request_id == cmd.request_id and entry.sha1 == cmd.sha1:
            if not entry.await_response:
                return False
            if entry.acked_at is None:
                entry.acked_at = self._clock()
                self._rows.awaiting(vin, cmd.request_id, cmd.sha1, entry.attempts, cmd.session)
                self._delivered(vin, entry, cmd.request_id, cmd.sha1, ends=False)
            return True
        voided = self._unacked.get(vin)
        if entry is None and voided is not None and voided[:2] == (cmd.request_id, cmd.sha1) and voided[3]:
            # Voided (our link or its connection dropped) yet it reached the vehicle after all.
            del self._unacked[vin]
            now = self._clock()
            self.inflight[vin] = InFlight(cmd.request_id, cmd.sha1, cmd.session, now, voided[2], True, now)
            self._rows.awaiting(vin, cmd.request_id, cmd.sha1, voided[2], cmd.session)
            return True
        return False

    def _responded(self, cmd: Responded) -> None:
        """The vehicle's answer to a request: it ends the one in flight, if it is that one, it
        awaits an answer, and the answer comes from the vehicle's own client."""
        vin, rid = cmd.vin, cmd.request_id
        entry = self.inflight.get(vin)
        if entry is None or entry.request_id != rid:
            metrics.RESPONSES.labels("late").inc()
            log.info("response_ignored", vin=vin, request_id=rid, reason="late", publisher=cmd.session.clientid)
            return
        if not self._is_own(vin, cmd.session.clientid):
            metrics.RESPONSES.labels("forged").inc()
            log.warning("response_ignored", vin=vin, request_id=rid, reason="forged", publisher=cmd.session.clientid)
            return
        if not entry.await_response:
            metrics.RESPONSES.labels("not_awaited").inc()
            log.info("response_ignored", vin=vin, request_id=rid, reason="not_awaited")
            return
        del self.inflight[vin]
        self._unacked.pop(vin, None)
        metrics.RESPONSES.labels("accepted").inc()
        if self._rows.ack(
            vin, rid, entry.sha1, outcome=Outcome.RESPONDED, attempts=entry.attempts, response=cmd.payload
        ):
            self._ended(vin, rid, entry.sha1, Outcome.RESPONDED, entry.attempts)
            if self._on_latency is not None and entry.acked_at is not None:
                answered = round((self._clock() - entry.acked_at) * 1000)
                self._on_latency(vin, rid, entry.sha1, "answered", answered, True)
            if self._on_response is not None:
                self._on_response(vin, rid, entry.sha1, cmd.payload, cmd.size)
        self._try_send(vin, Trigger.NEW_BATCH)

    def mark_cancelled(self, vin: str, request_id: str, sha1: bytes) -> bool:
        """A cancel ended the row (vin, request_id, sha1): True when a delivery of it is out (the
        entry stays, so the slot stays taken until the vehicle answers or it times out)."""
        entry = self.inflight.get(vin)
        if entry is not None and entry.request_id == request_id and entry.sha1 == sha1:
            entry.cancelled = True
            return True
        voided = self._unacked.get(vin)
        if voided is not None and voided[:2] == (request_id, sha1):
            return True
        # PUBACKed just before the cancel, its delete not yet committed: that delete will find the
        # row cancelled and amend it to delivered, so it counts as out for delivery too.
        return self._rows.acking(vin, request_id, sha1)

    def _refused(self, cmd: Refused) -> None:
        """The broker refused a delivery: that row's attempt failed, nobody else's. Sent again
        (the delivery client sends it alone) until refused for good; then the row ends failed
        and the vehicle's next request goes."""
        vin, rid = cmd.vin, cmd.request_id
        entry = self.inflight.get(vin)
        if entry is not None and entry.request_id == rid:
            sha1, attempts = entry.sha1, entry.attempts
        elif vin in self._unacked and self._unacked[vin][0] == rid:
            _, sha1, attempts, _ = self._unacked[vin]  # voided meanwhile (our link dropped with it)
        else:
            return  # no longer what this vehicle has out
        metrics.DELIVERIES_REFUSED.labels(cmd.reason).inc()
        if cmd.final:
            self._fail(vin, rid, sha1, attempts, "broker_refused", last_refusal=cmd.reason)
        else:
            self._void(vin)
        self._try_send(vin, Trigger.REFUSED)

    def _ended(self, vin: str, request_id: str, sha1: bytes, outcome: Outcome, attempts: int) -> None:
        _OUTCOME_COUNTERS[outcome].inc()
        if self._on_outcome is not None:
            self._on_outcome(vin, request_id, sha1, outcome, attempts)

    def _down(self, cmd: Down) -> None:
        if cmd.reason is EndReason.TAKENOVER:
            return  # the session lives on in the new connection, which resumed it already
        current = self.presence.get(cmd.vin)
        if current is not None and current.same_connection(cmd.session):
            del self.presence[cmd.vin]
            if self._budget is not None:
                self._budget.forget(cmd.vin)
        entry = self.inflight.get(cmd.vin)
        gone = cmd.reason in (EndReason.DISCARDED, EndReason.TERMINATED)
        # OFFLINE keeps the entry: a resume redelivers it, a clean subscribe or the timeout replaces it.
        if entry is not None and gone and entry.session.same_connection(cmd.session):
            self._void(cmd.vin)
