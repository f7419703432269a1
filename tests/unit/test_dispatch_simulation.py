"""A seeded randomized simulation of a fleet against each real dispatcher, on each store.

"memory": LMDB mode's Dispatcher (ring, queues, workers) over `MemoryRows` (the store's rules in
memory). "postgresql": SharedDispatcher on a throwaway database, batches, cancels and the expiry
sweep through storage/pg, the store's state read back from its tables (tests/dispatch_stores.py).
The test body, the fleet and the checks are the same for both.

A small broker model plays MQTT: deliveries reach a vehicle's live connection,
wait in a persistent session while it is offline, and die with a discarded or
terminated session. Events are interleaved at random: connect, resume, disconnect,
heartbeat, batches (some with an expires_at, some awaiting the vehicle's answer),
PUBACKs (some forged by another vehicle), answers (some late or guessed, some forged by another vehicle), cancels of
named VINs and of every vehicle (walked in chunks behind a cut), time passing (the
response timeouts), the expiry sweep (apart: the queue must skip an expired row before
it), deferred commits of acked rows (LMDB's group committer: memory only), and our broker link
dropping. After each step the dispatcher is left to finish (on PostgreSQL: polled until idle).

Invariants, checked at every step against the store's view (`MemoryRows`, or PostgreSQL's tables):
- one delivery at most holds a vehicle's slot: the last one sent, until its PUBACK (or,
  awaiting an answer, until the answer or the response timeout), until our link drops or
  its session ends; a cancelled or expired row's delivery still holds it;
- only to a vehicle online, only its own rows, the oldest the store may send: never past
  its expires_at (which the delivery carries), never a row a cancel took;
- the worker ends what happened: the PUBACK of the delivery out ends it delivered with its
  attempts, the awaited answer from the vehicle itself responded with that answer, the
  response timeout failed; forged PUBACKs, late and forged answers end nothing; a cancel counts exactly
  the deliveries out;
- never a row of a request its campaign policy holds (paused at random, resumed with its rows
  offered again, as the server does when a gate opens): the oldest row not held goes instead;
- never a normal row while a high-priority one of that vehicle may be sent (high per batch, or
  per request by its policy, switched at random): high rows go first, oldest first;
- campaign pacing: never more than max_in_flight deliveries of the capped request holding a
  slot, never more starts of the rated one than its first token plus its rate since the policy
  (on PostgreSQL through its buckets and counts in the database: sdv_pacing_lease,
  sdv_pacing_out); on memory, checked at each publish, never a row of a request without capacity
  (the oldest row with capacity goes); idle vehicles are offered capacity as the pacer ticks;
- campaigns given abort criteria at random are judged after every step by the server's own
  `Aborts` over the store's counts: an abort is recorded once per policy (a second one writes
  nothing), its cancel's chunks count exactly the deliveries out, the request's batches are
  refused while it stands and stored again once a new policy re-opens it;
- at the end every row is drained and every pair the store took has exactly one outcome;
  a cancelled pair the vehicle PUBACKed later was amended.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import structlog.testing

from exhook_server.abort import Aborts
from exhook_server.backends.postgres.backend import PgBudget
from exhook_server.config import Config
from exhook_server.dispatch.commands import EndReason, Session
from exhook_server.dispatch.gates import Gates
from exhook_server.dispatch.pacing import Budget, LocalBudget, Pacer
from exhook_server.policy import AbortCriterion, Policy
from storage.errors import RequestAborted
from storage.lmdb.outcomes import Outcome
from storage.model import CancelChunk, Generation
from testkit.pg_cluster import PgCluster
from tests.dispatch_fakes import MemoryRows, Pair, sha1
from tests.dispatch_stores import OpenStore, SimStore, Wiring, open_memory, open_postgresql

SEEDS = [1, 2, 3, 4, 5, 6]
VEHICLES = 120
STEPS = 1500
#: PostgreSQL runs every event as a transaction (a few ms each): fewer seeds and steps.
PG_SEEDS = [1, 2]
#: Seeds run with vehicle events over MQTT too (memory; PostgreSQL takes its first seed).
MQTT_SEEDS = [1, 2, 3]
PG_STEPS = 800
#: Rows a cancel of every vehicle ends per transaction (max_rows_per_commit).
CANCEL_CHUNK = 7
RESPONSE_TIMEOUT_S = 30.0
#: Paced campaigns (memory): one with max_in_flight, one with max_per_minute, from the start.
CAPPED, CAP = "task_ota_0", 2
RATED, PER_MINUTE = "task_cfg_1", 3
PACED = frozenset({CAPPED, RATED})

#: An `ack` call the worker must make: (vin, request_id, sha1, outcome, attempts, response).
Expected = tuple[str, str, bytes, Outcome, int, bytes]


@dataclass
class Delivery:
    """One publish of ours to a vehicle, and where it stands in the vehicle's slot."""

    vin: str
    request_id: str
    payload: bytes
    await_response: bool = False
    #: Publishes of this (request_id, payload) in a row, this one included (the worker's count).
    attempts: int = 1
    #: out: sent, not PUBACKed; voided: our link or its session lost it (sent again as a re-send);
    #: awaiting: PUBACKed, its answer awaited; done: the slot is free.
    state: str = "out"
    acked_at: float = 0.0

    @property
    def sha1(self) -> bytes:
        return sha1(self.payload)


@dataclass
class Vehicle:
    vin: str
    session: Session | None = None  # live connection
    persistent: bool = False
    #: Broker-side session state: deliveries not yet acked (sent to the connection or queued).
    unacked: list[Delivery] = field(default_factory=list)
    has_session: bool = False  # a broker session exists (live or persistent-idle)
    last_session: Session | None = None
    #: The last delivery published to it: the only one that may hold its slot.
    last: Delivery | None = None
    #: PUBACKed deliveries awaiting the vehicle's answer (it answers each once).
    to_answer: list[Delivery] = field(default_factory=list)


class Fleet:
    """The broker model, the clock and the checks; the Dispatcher under test publishes into it."""

    #: The store under test, with its dispatcher (set once both exist: each needs the other).
    store: SimStore

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = 1000.0  # seconds: the workers' clock; epoch ms for the store is now * 1000
        self.vehicles = {f"VIN{n:05d}": Vehicle(f"VIN{n:05d}") for n in range(VEHICLES)}
        self.link_up = True
        self.port = 10_000
        self.violations: list[str] = []
        self.published = 0
        self.step = 0
        #: Publishes not checked yet: (vin, request_id, payload, expires_ms).
        self.unchecked: list[tuple[str, str, bytes, int]] = []
        #: Ack calls the step's events should cause (in any order across vehicles).
        self.expected: list[Expected] = []
        #: pair → step of its latest cancel; pair → steps of the PUBACKs of its deliveries.
        self.cancelled_at: dict[Pair, int] = {}
        self.pubacked: dict[Pair, list[int]] = {}
        self.events: Counter[str] = Counter()
        #: Request ids held by their campaign policy now (the dispatcher's gates).
        self.held: set[str] = set()
        #: Request ids whose campaign policy says priority high now (the dispatcher's gates).
        self.high: frozenset[str] = frozenset()
        #: Priorities are drawn apart, so the other events' stream stays what each seed gave before.
        self.prio_rng = random.Random(rng.random())
        #: Campaign pacing on the fleet's clock, and when its policies were set.
        self.pacer: Pacer | None = None
        self.paced_since = self.now
        self.rated_starts = 0
        self.abort_rng = random.Random(0)
        #: Request ids aborted by their campaign policy now (the store refuses their batches).
        self.aborted: set[str] = set()

    def held_now(self) -> frozenset[str]:
        return frozenset(self.held)

    def skip_now(self) -> frozenset[str]:
        """What the worker passes over now: held requests, and those without capacity."""
        blocked = self.pacer.blocked() if self.pacer is not None else frozenset()
        return frozenset(self.held) | blocked

    def high_now(self) -> frozenset[str]:
        return self.high

    def clock(self) -> float:
        return self.now

    def holds_slot(self, d: Delivery | None) -> bool:
        if d is None:
            return False
        return d.state == "out" or (d.state == "awaiting" and self.now - d.acked_at < RESPONSE_TIMEOUT_S)

    @property
    def rows(self) -> MemoryRows:
        """The store's state as the checks read it."""
        return self.store.view

    # -- the Publisher seam -------------------------------------------------------
    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        if not self.link_up:
            return False
        self.unchecked.append((vin, request_id, payload, expires_ms))
        if self.store.live:
            self.check_published()
        return True

    def check_published(self) -> None:
        """Check the publishes not checked yet against the store's view: at the publish on a store
        that is current at every moment; once the step has settled on one read back from
        PostgreSQL (a vehicle's publish is the last of its events in a step that touch its rows)."""
        published, self.unchecked = self.unchecked, []
        for vin, request_id, payload, expires_ms in published:
            try:
                self._published(vin, request_id, payload, expires_ms)
            except Exception as exc:  # the pool logs and drops a failing command: a check must not vanish so
                self.violations.append(f"step {self.step}: publish check failed: {exc!r}")

    def _published(self, vin: str, request_id: str, payload: bytes, expires_ms: int) -> None:
        self.published += 1
        v = self.vehicles[vin]
        where = f"step {self.step}: {vin}/{request_id}"
        row = self.rows.rows.get((vin, request_id))
        if row is None or row.payload != payload:
            self.violations.append(f"{where}: published, and it is not that VIN's row")
            return
        # What the worker passed over. Checked once settled (PostgreSQL), the pacer's blocked set is
        # that of after the publish: a paced request other than this one may have been blocked.
        skip = self.skip_now() if self.store.live else frozenset(self.held) | (PACED - {request_id})
        if request_id in skip:
            self.violations.append(f"{where}: published while its campaign policy holds it (or it has no capacity)")
        if request_id == CAPPED and self.pacer is not None:
            out = sum(
                1
                for o in self.vehicles.values()
                if o is not v and o.last is not None and o.last.request_id == CAPPED and self.holds_slot(o.last)
            )
            if out + 1 > CAP:
                self.violations.append(f"{where}: {out + 1} deliveries of it out, max_in_flight {CAP}")
        if request_id == RATED and self.pacer is not None:
            self.rated_starts += 1
            if self.rated_starts > 1 + PER_MINUTE / 60 * (self.now - self.paced_since) + 1e-9:
                self.violations.append(f"{where}: start {self.rated_starts} beyond {PER_MINUTE}/min since the policy")
        oldest = self.rows.oldest(vin, skip, self.high)
        if oldest is None or (oldest[0].request_id, oldest[1]) != (request_id, payload):
            self.violations.append(f"{where}: not the oldest row the store may send ({oldest and oldest[0]})")
        if not (row.high_priority or request_id in self.high):
            first = [r for r, p in self.rows.deliverable(vin, skip) if p.high_priority or r in self.high]
            if first:
                self.violations.append(f"{where}: a normal row sent while high-priority {first[0]} may be sent")
        if 0 < row.expires_ms <= self.now * 1000:
            self.violations.append(f"{where}: published past its expires_at")
        job = self.rows.cancels.get(request_id)
        if job is not None and row.ts <= job.cut:
            self.violations.append(f"{where}: published after a cancel took it")
        if expires_ms != row.expires_ms:
            self.violations.append(f"{where}: carries expires_ms {expires_ms}, its row {row.expires_ms}")
        if v.session is None:
            self.violations.append(f"{where}: published to a vehicle offline")
        if self.holds_slot(v.last):
            assert v.last is not None
            self.violations.append(f"{where}: second delivery while {v.last.request_id} holds the slot")
        # Sent again while the worker knows it unacked (out or voided): one more attempt.
        last, attempts = v.last, 1
        unacked = last is not None and last.state in ("out", "voided")
        if unacked and last is not None and (last.request_id, last.sha1) == (request_id, row.sha1):
            attempts = last.attempts + 1
        d = Delivery(vin, request_id, payload, row.await_response, attempts)
        v.last = d
        if v.has_session:
            v.unacked.append(d)

    # -- the vehicle's side ---------------------------------------------------------
    def new_session(self, vin: str) -> Session:
        self.port += 1
        return Session("emqx@n1", vin, "10.1.0.1", self.port)

    def void(self, v: Vehicle) -> None:
        """Its delivery out is lost (our link dropped, its session ended); a PUBACKed one awaiting
        its answer is not: the vehicle has it."""
        if v.last is not None and v.last.state == "out":
            v.last.state = "voided"

    def puback(self, v: Vehicle, d: Delivery) -> None:
        """What the worker must do with the vehicle's PUBACK of `d`."""
        last = v.last
        self.pubacked.setdefault((v.vin, d.request_id, d.sha1), []).append(self.step)
        if d.await_response:
            v.to_answer.append(d)
        if last is not None and (last.request_id, last.sha1) == (d.request_id, d.sha1):
            if last.state == "awaiting":
                return  # held until the answer
            if last.state in ("out", "voided"):
                if last.await_response:
                    last.state, last.acked_at = "awaiting", self.now
                    return
                last.state = "done"
                self.expected.append((v.vin, d.request_id, d.sha1, Outcome.DELIVERED, last.attempts, b""))
                return
        self.expected.append((v.vin, d.request_id, d.sha1, Outcome.DELIVERED, 1, b""))  # not what is out: any end

    def answer(self, v: Vehicle, request_id: str, payload: bytes, by: Vehicle) -> None:
        """What the worker must do with an answer on `v`'s response topic published by `by`."""
        last = v.last
        if (
            by is v
            and last is not None
            and last.request_id == request_id
            and last.await_response
            and last.state in ("out", "awaiting")
        ):
            last.state = "done"
            self.expected.append((v.vin, request_id, last.sha1, Outcome.RESPONDED, last.attempts, payload))
            self.events["answer_accepted"] += 1
        else:
            self.events["answer_ignored"] += 1

    def time_passes(self, seconds: float) -> None:
        self.now = self.store.quantum(self.now + seconds)
        for v in self.vehicles.values():
            d = v.last
            if d is not None and d.state == "awaiting" and self.now - d.acked_at >= RESPONSE_TIMEOUT_S:
                d.state = "done"
                self.expected.append((v.vin, d.request_id, d.sha1, Outcome.FAILED, d.attempts, b""))

    def out_for_cancel(self, request_id: str, chunk: list[tuple[str, bytes]]) -> int:
        """How many rows a cancel ended are out for delivery: sent and not done, or PUBACKed with
        their end not committed yet."""
        out = 0
        for vin, digest in chunk:
            self.cancelled_at[vin, request_id, digest] = self.step
            last = self.vehicles[vin].last
            sent = last is not None and last.state != "done" and (last.request_id, last.sha1) == (request_id, digest)
            out += sent or self.store.acking(vin, request_id, digest)
        return out

    def check_acks(self, mark: int) -> None:
        """The worker's `ack` calls since `mark` are exactly the ends the step's events call for
        (in any order across vehicles: each worker drains its own queue)."""
        got = sorted((a.vin, a.request_id, a.sha1, a.outcome, a.attempts, a.response) for a in self.store.acks[mark:])
        expected, self.expected = sorted(self.expected), []
        if got != expected:
            self.violations.append(f"step {self.step}: the worker ended {brief(got)}, expected {brief(expected)}")


class AbortSeams:
    """What `Aborts` asks of the store (Reads.outcome_counts, Writes.abort) over the simulated one,
    and the cancel walk it starts (`Cancels.walk`), handed to the simulation, which reports each
    chunk to dispatch as the ingestor's walk does."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.walks: list[CancelChunk] = []

    async def outcome_counts(self, request_id: str) -> tuple[list[Generation], int]:
        return await self.fleet.store.outcome_counts(request_id)

    async def abort(self, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> CancelChunk | None:
        return await self.fleet.store.abort(request_id, doc, now_ms, max_rows)

    def walk(self, first: CancelChunk) -> None:
        self.walks.append(first)


def brief(calls: list[Expected]) -> str:
    return ", ".join(f"{v}/{rid}/{s.hex()[:6]} {o.label} x{a} {r[:14]!r}" for v, rid, s, o, a, r in calls[:6])


async def simulate(
    seed: int, vin_from_clientid: bool, open_store: OpenStore, steps: int = STEPS, events: str = "hooks"
) -> Fleet:
    fleet = Fleet(random.Random(seed))
    # With vin_from_clientid the dispatcher keeps no client map for these vehicles (clientid = VIN).
    named = (lambda clientid: True) if vin_from_clientid else None
    # Acked rows end at once, or with a later commit (LMDB's group committer; memory only).
    link = lambda: fleet.link_up  # noqa: E731
    clock_ms = lambda: int(fleet.now * 1000)  # noqa: E731
    # The buckets in memory, or PostgreSQL's (pacing_buckets, leased through the store's pool).
    budget: Budget = (
        LocalBudget(fleet.clock) if open_store is open_memory else PgBudget(lambda: fleet.store.pool, clock_ms)
    )
    fleet.pacer = Pacer(budget, wall_ms=clock_ms, on_wake=lambda vins: fleet.store.dispatcher.new_batch(vins))
    fleet.pacer.set(CAPPED, Policy(max_in_flight=CAP), clock_ms())
    fleet.pacer.set(RATED, Policy(max_per_minute=PER_MINUTE), clock_ms())
    wiring = Wiring(
        fleet,
        fleet.clock,
        link,
        named,
        RESPONSE_TIMEOUT_S,
        defer_acks=seed % 2 == 0,
        held=fleet.held_now,
        high=fleet.high_now,
        pacing=fleet.pacer,
    )
    fleet.store = await open_store(wiring)
    #: Abort criteria are drawn apart, so the other events' stream stays what each seed gave before.
    fleet.abort_rng = random.Random(seed * 7919 + 26)
    try:
        await run(fleet, steps, events)
        fleet.store.commit_acks()
        await fleet.store.finish()
    finally:
        await fleet.store.close()
    return fleet


async def run(fleet: Fleet, steps: int, events: str = "hooks") -> None:
    """The random steps, then everyone online until every row is drained. With `events` "mqtt"
    (vehicle_events), heartbeats and answers come as the events member hands them over (the VIN's
    client, connection unknown), PUBACKs as the ack rule reports them (the acker's client id),
    and the broker's ACL refuses an answer published on another vehicle's topic."""
    over_mqtt = events == "mqtt"

    def seen(session: Session) -> Session:
        """The session dispatch gets for an event of `session`'s client."""
        return Session("", session.clientid, "") if over_mqtt else session

    rng, store = fleet.rng, fleet.store
    d = store.dispatcher
    vins = list(fleet.vehicles)
    rids = [f"task_{t}_{n}" for t in ("ota", "cfg") for n in range(4)]
    seams = AbortSeams(fleet)
    gates = Gates(lambda: int(fleet.now * 1000))  # the abort watch's own: dispatch has the fleet's held set
    clock_ms = lambda: int(fleet.now * 1000)  # noqa: E731
    aborts = Aborts(Config(cancel_chunk_rows=CANCEL_CHUNK), seams, seams, gates, seams, None, clock_ms, settle_s=0.0)  # type: ignore[arg-type]
    judged: set[str] = set()  # request ids whose policy has abort criteria

    async def offer(rid: str) -> None:
        """A gate opened: every VIN the store holds a row of `rid` for is offered it again, as the
        server asks the store (Writes.pending_vins); on PostgreSQL the view is read back whole
        first (between steps it holds only the vehicles a step touched)."""
        await store.refresh(vins)
        d.new_batch([vin for vin, rid_ in fleet.rows.rows if rid_ == rid], rid)

    async def report_chunk(rid: str, chunk: list[tuple[str, bytes]] | tuple[tuple[str, bytes], ...]) -> None:
        want = fleet.out_for_cancel(rid, list(chunk))
        got = await d.cancelled(rid, tuple(chunk))
        if got != want:
            fleet.violations.append(f"step {fleet.step}: cancel of {rid} counts {got} out, expected {want}")

    async def judge() -> None:
        """The server's abort watch, once per step, on every request with criteria."""
        for rid in sorted(judged - fleet.aborted):
            durable_write()
            if not await aborts.check(rid) or not seams.walks:
                continue
            first = seams.walks.pop()
            fleet.aborted.add(rid)
            fleet.events["aborted"] += 1
            await report_chunk(rid, first.cancelled)
            if await store.abort(rid, b"{}", int(fleet.now * 1000), CANCEL_CHUNK) is not None:
                fleet.violations.append(f"step {fleet.step}: {rid} aborted twice under one policy")

    async def set_criteria(rid: str) -> None:
        """A new policy for `rid` with one abort criterion (re-opening it if it was aborted)."""
        criterion = AbortCriterion(
            fleet.abort_rng.choice(["failed", "expired", "expired"]),  # failed outcomes are rare here
            fleet.abort_rng.choice([0.05, 0.1, 0.2]),
            fleet.abort_rng.randint(1, 20),
        )
        policy = Policy(abort=(criterion,))
        await store.set_policy(rid, policy.encode())
        gates.set(rid, policy)
        judged.add(rid)
        fleet.aborted.discard(rid)
        fleet.events["abort_policy"] += 1

    async def settle(tick: bool = True) -> None:
        if fleet.pacer is not None and tick:
            fleet.events["paced_blocked"] += bool(fleet.pacer.blocked())
            await fleet.pacer.tick()  # leases tokens, offers idle vehicles what capacity there is
        await store.settle()
        if fleet.unchecked:
            await store.refresh({vin for vin, *_ in fleet.unchecked})
            fleet.check_published()

    def durable_write() -> None:
        """The group committer may take acked rows' ends before a durable write, or after it
        (LMDB only: on PostgreSQL an ack ends its row in its event's transaction)."""
        if store.pending_acks() and rng.random() < 0.5:
            store.commit_acks()

    def connect(v: Vehicle, clean: bool) -> None:
        s = fleet.new_session(v.vin)
        if not clean and v.has_session:
            d.resumed(s)  # the broker redelivers the session's unacked messages itself
        else:
            if v.has_session and v.last_session is not None:
                d.ended(v.last_session, EndReason.DISCARDED)
                fleet.void(v)
            v.unacked.clear()  # a clean start loses the old session
        v.session = v.last_session = s
        v.has_session, v.persistent = True, not clean
        d.connected(s)
        if clean:
            d.subscribed(s, v.vin)

    def disconnect(v: Vehicle) -> None:
        assert v.session is not None
        s, v.session = v.session, None
        d.ended(s, EndReason.OFFLINE)
        if not v.persistent:
            d.ended(s, EndReason.TERMINATED)
            fleet.void(v)
            v.has_session = False
            v.unacked.clear()

    async def cancel_chunks() -> None:
        """The ingestor's walk of every cancel of every vehicle in progress: one chunk each."""
        for rid in await store.cancels_in_progress():
            durable_write()
            await report_chunk(rid, await store.cancel_chunk(rid, CANCEL_CHUNK))

    def answer(v: Vehicle, request_id: str, payload: bytes, by: Vehicle) -> None:
        assert by.session is not None
        fleet.answer(v, request_id, payload, by)
        d.responded(seen(by.session), v.vin, request_id, payload, len(payload))

    def puback(v: Vehicle, msg: Delivery) -> None:
        assert v.session is not None
        fleet.puback(v, msg)
        d.acked(seen(v.session), v.vin, msg.request_id, sha1(msg.payload))

    for fleet.step in range(steps):
        mark = len(store.acks)
        v = fleet.vehicles[rng.choice(vins)]
        r = rng.random()
        if await store.cancels_in_progress() and rng.random() < 0.5:
            await cancel_chunks()
        if r < 0.10:
            if v.session is None:
                connect(v, clean=not (v.has_session and rng.random() < 0.6))
        elif r < 0.15:
            if v.session is not None:
                disconnect(v)
        elif r < 0.24:
            if v.session is not None:
                d.heartbeat(seen(Session("emqx@n1", v.vin, "10.1.0.1")), v.vin)
        elif r < 0.46:
            batch = rng.sample(vins, rng.randint(1, 30))
            rid = rng.choice(rids)
            payload = rng.choice([b"shared", rid.encode(), rng.randbytes(8)])
            expires_ms = int(fleet.now * 1000) + rng.randint(2_000, 60_000) if rng.random() < 0.25 else 0
            awaited = rng.random() < 0.3
            high = fleet.prio_rng.random() < 0.2
            fleet.events["high_batch"] += high
            durable_write()
            try:
                taken = await store.batch(
                    batch, rid, payload, expires_ms=expires_ms, await_response=awaited, high_priority=high
                )
            except RequestAborted:
                fleet.events["refused_aborted"] += 1
                if rid not in fleet.aborted:
                    fleet.violations.append(f"step {fleet.step}: a batch of {rid} refused, not aborted")
            else:
                if rid in fleet.aborted:
                    fleet.violations.append(f"step {fleet.step}: a batch of aborted {rid} stored")
                for vin, digest in taken:  # replaced behind a cancel's cut: that cancel took the old row
                    fleet.cancelled_at[vin, rid, digest] = fleet.step
                d.new_batch(batch)
        elif r < 0.74:
            by = fleet.vehicles[rng.choice(vins)]
            if v.unacked and by is not v and by.session is not None and rng.random() < 0.15:
                # Forged: another vehicle got this one's delivery (a lax broker ACL) and PUBACKs it.
                msg = v.unacked[0]
                d.acked(seen(by.session), v.vin, msg.request_id, sha1(msg.payload))
                fleet.events["puback_forged"] += 1
            elif v.session is not None and v.unacked:
                puback(v, v.unacked.pop(0))
        elif r < 0.84:
            if v.session is not None and v.to_answer:
                msg = v.to_answer.pop(0)
                answer(v, msg.request_id, b"answer to " + msg.payload, v)
            elif v.session is not None and rng.random() < 0.5:  # late, or for a request it never had
                answer(v, rng.choice(rids), b"answer to a guess", v)
            else:  # forged: another vehicle publishes on this one's response topic
                by = fleet.vehicles[rng.choice(vins)]
                if by is not v and by.session is not None and v.last is not None and not over_mqtt:
                    answer(v, v.last.request_id, b"forged", by)
        elif r < 0.87:
            rid = rng.choice(rids)
            durable_write()
            if rng.random() < 0.5:
                chunk = await store.cancel_vins(rid, rng.sample(vins, rng.randint(1, 10)))
                fleet.events["cancel_some"] += 1
            else:
                chunk = await store.start_cancel_all(rid, CANCEL_CHUNK)
                fleet.events["cancel_all"] += 1
            want = fleet.out_for_cancel(rid, chunk)
            got = await d.cancelled(rid, tuple(chunk))
            if got != want:
                fleet.violations.append(f"step {fleet.step}: cancel of {rid} counts {got} out, expected {want}")
        elif r < 0.91:  # the periodic sweeps of dispatch (response timeouts) and of the store (expiry) run apart
            fleet.time_passes(rng.uniform(1.0, 20.0))
            d.sweep()
        elif r < 0.93:
            durable_write()
            fleet.events["expired"] += len(await store.expire_due())
        elif r < 0.95:
            store.commit_acks()
        elif r < 0.97 and fleet.prio_rng.random() < 0.3:  # a policy gives a campaign high priority, or takes it
            rid = rng.choice(rids)
            fleet.high = fleet.high - {rid} if rid in fleet.high else fleet.high | {rid}
            fleet.events["high_policy"] += 1
        elif r < 0.97:  # a campaign paused, or resumed: its rows are offered to their vehicles again
            rid = rng.choice(rids)
            if rid in fleet.held:
                fleet.held.discard(rid)
                await offer(rid)
                fleet.events["resumed"] += 1
            else:
                fleet.held.add(rid)
                fleet.events["paused"] += 1
        else:
            fleet.link_up = not fleet.link_up
            if not fleet.link_up:  # whatever our client had not delivered is void
                for each in fleet.vehicles.values():
                    fleet.void(each)
            d.broker_connected(fleet.link_up)
        if fleet.abort_rng.random() < 0.01:
            await set_criteria(fleet.abort_rng.choice(rids[4:]))  # the cfg campaigns: ota ones keep every outcome
        await settle()
        await judge()  # on a settled store, as every cancel here starts (the sim runs no cancel beside events)
        await settle(tick=False)  # one pacing tick a step: on PostgreSQL each costs round trips
        fleet.check_acks(mark)

    # Everyone comes online, the link is up, cancels finish, vehicles ack and answer everything
    # they get, and time runs past every expiry and response timeout.
    fleet.step = steps
    resumed, fleet.held = fleet.held, set()
    for rid in resumed:
        await offer(rid)
    if not fleet.link_up:
        fleet.link_up = True
        d.broker_connected(True)
    for v in fleet.vehicles.values():
        if v.session is None:
            connect(v, clean=True)
    await settle()
    for _ in range(2000):
        fleet.step += 1
        mark = len(store.acks)
        acted = bool(await store.cancels_in_progress() or store.pending_acks())
        await cancel_chunks()
        store.commit_acks()
        # One PUBACK or answer per vehicle, then the workers: the next delivery may be the
        # request an answer names, so what the answer does depends on what came before it.
        for v in fleet.vehicles.values():
            if v.unacked:
                puback(v, v.unacked.pop(0))
            elif v.to_answer:
                msg = v.to_answer.pop(0)
                answer(v, msg.request_id, b"answer to " + msg.payload, v)
            else:
                continue
            acted = True
        await settle()
        fleet.check_acks(mark)
        if not acted:
            mark = len(store.acks)
            fleet.time_passes(RESPONSE_TIMEOUT_S + 60.0)
            expired = await store.expire_due()
            d.sweep()
            await settle()
            fleet.check_acks(mark)
            if not expired and not await store.has_rows():
                break


def check_outcomes(fleet: Fleet) -> list[str]:
    """Every pair the store took ended once, as what happened to it."""
    rows = fleet.rows
    problems = []
    if set(rows.outcomes) != rows.taken:
        problems.append(f"{len(rows.taken - set(rows.outcomes))} pairs without an outcome")
    for pair, ended in rows.outcomes.items():
        if ended.outcome is Outcome.RESPONDED and not ended.response.startswith(b"answer to "):
            problems.append(f"{pair} responded with {ended.response!r}: not its vehicle's answer")
        if ended.outcome is Outcome.DELIVERED and pair not in fleet.pubacked:
            problems.append(f"{pair} delivered and never PUBACKed")
        later = [step for step in fleet.pubacked.get(pair, []) if step > fleet.cancelled_at.get(pair, step)]
        if ended.outcome is Outcome.CANCELLED and later:
            problems.append(f"{pair} PUBACKed after its cancel (step {later[0]}), still cancelled: not amended")
    return problems


_databases = itertools.count()
#: What either dispatcher logs when an event or one of its tasks failed, or an event was dropped.
FAILURES = {
    "dispatch_command_failed",
    "dispatch_event_failed",
    "dispatch_task_failed",
    "dispatch_event_dropped",
    "heartbeat_check_failed",
    "abort_check_failed",
}


def cases() -> list[object]:
    """(store, seed, vin_from_clientid, vehicle_events): every seed on memory, fewer on PostgreSQL
    and with events over MQTT (runtime)."""
    return [
        pytest.param(
            store, seed, named, events, id=f"{store}-{seed}-{'clientid-is-vin' if named else 'client-map'}-{events}"
        )
        for events, store_seeds in (
            ("hooks", (("memory", SEEDS), ("postgresql", PG_SEEDS))),
            ("mqtt", (("memory", MQTT_SEEDS), ("postgresql", PG_SEEDS[:1]))),
        )
        for store, seeds in store_seeds
        for seed in seeds
        for named in ((False, True) if events == "hooks" else (True,))
    ]


@pytest.mark.parametrize(("store_kind", "seed", "vin_from_clientid", "events"), cases())
def test_random_fleet_keeps_invariants_and_drains(
    store_kind: str,
    seed: int,
    vin_from_clientid: bool,
    events: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random interleavings (cancels, expiries and answers among them) never put two deliveries
    in a vehicle's slot, send only what may be sent, end each pair once as it happened, and drain."""
    open_store: OpenStore = open_memory
    steps = STEPS
    if store_kind == "postgresql":
        cluster: PgCluster = request.getfixturevalue("pg_cluster")
        dsn = cluster.new_database(f"simulation_{next(_databases)}")
        open_store, steps = open_postgresql(dsn, monkeypatch), PG_STEPS
    with structlog.testing.capture_logs() as logs:
        fleet = asyncio.run(simulate(seed, vin_from_clientid, open_store, steps, events))
    assert [e for e in logs if e["event"] in FAILURES] == []
    assert fleet.violations == [], f"seed {seed}: {fleet.violations[:5]}"
    assert fleet.rows.rows == {}, f"seed {seed}: {len(fleet.rows.rows)} rows never delivered"
    assert fleet.rows.cancels == {} and fleet.rows.pending_acks == []
    assert check_outcomes(fleet) == [], f"seed {seed}: {check_outcomes(fleet)[:5]}"
    outcomes = Counter(e.outcome.label for e in fleet.rows.outcomes.values())
    # Not vacuous: every way a pair ends took part, and answers were both taken and ignored.
    assert fleet.published > 100 and fleet.rows.amended > 0, (fleet.published, fleet.rows.amended)
    assert {"delivered", "superseded", "cancelled", "expired", "responded", "failed"} <= outcomes.keys(), outcomes
    assert fleet.events["answer_accepted"] and fleet.events["answer_ignored"], fleet.events
    assert fleet.events["puback_forged"], fleet.events
    assert fleet.events["high_batch"] and fleet.events["high_policy"], fleet.events
    assert fleet.events["aborted"] and fleet.events["refused_aborted"], fleet.events
    assert fleet.events["paced_blocked"] and fleet.rated_starts, fleet.events
