"""Campaign pacing: which requests may not start a delivery now, for their rate or concurrency.

`max_per_minute` (grown by its `ramp`) is one token bucket for the whole fleet, held by a `Budget`
(one process's, a process group's, or PostgreSQL's); each tick this process leases what it needs
in chunks of at most `LEASE_S` of the rate, and each start spends one. `max_in_flight` bounds the
deliveries out (`out`: the workers' in-flight entries, and those `carry` holds over a restart). A
request without a token or at its cap is `blocked()`: its rows are passed over like a held one's.
Vehicles that found nothing to send meanwhile are remembered (`idle`, bounded) with the requests
then blocked, and offered again once one of those opens, a few per token or freed slot each tick:
never a scan of the fleet. Not thread-safe: the event loop's thread owns it.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from exhook_server import metrics
from exhook_server.dispatch.bucket import TokenBucket
from exhook_server.policy import Policy
from storage.model import now_ms

log = structlog.get_logger("sdv_fanout.pacing")

#: Burst of a campaign's bucket: at most this many seconds of its rate go at once.
BURST_S = 5.0
#: A lease asks for at most this many seconds of the rate (what one process may hold unspent).
LEASE_S = 0.1
#: How often leases are topped up and idle vehicles offered capacity.
TICK_S = 0.05
#: Idle vehicles remembered at most (the oldest forgotten first: their next heartbeat brings them).
MAX_IDLE = 100_000
#: Vehicles offered capacity per tick at most, whatever the rates.
MAX_WAKE = 1000

_NONE: frozenset[str] = frozenset()


def burst_of(rate_per_s: float) -> float:
    """A campaign bucket's burst: `BURST_S` of its rate, one token at least."""
    return max(1.0, rate_per_s * BURST_S)


@dataclass(frozen=True, slots=True)
class Lease:
    """Tokens of one request asked of the fleet-wide bucket."""

    request_id: str
    rate_per_s: float
    burst: float
    want: int


class Budget(Protocol):
    """Where the fleet-wide buckets live."""

    async def lease(self, asks: list[Lease]) -> list[int]:
        """Take up to `want` tokens of each request's bucket (created at one token, its rate and
        burst set to those given); what each got, in order."""
        ...

    async def forget(self, request_ids: list[str]) -> None:
        """The requests' buckets are no longer needed (their policy went)."""
        ...

    async def out(self, request_ids: list[str]) -> dict[str, int] | None:
        """The deliveries out of each request, fleet-wide, where another process or instance may
        end them (PostgreSQL); None where this process sees every one end (its workers count)."""
        ...


class LocalBudget:
    """The buckets in this process's memory: the budget of a process that is alone."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, asks: list[Lease]) -> list[int]:
        """`lease`, synchronously."""
        got = []
        for ask in asks:
            bucket = self._buckets.get(ask.request_id)
            if bucket is None:
                bucket = self._buckets[ask.request_id] = TokenBucket(ask.rate_per_s, ask.burst, self._clock, tokens=1)
            elif bucket.rate_per_s != ask.rate_per_s or bucket.burst != ask.burst:
                bucket.set_rate(ask.rate_per_s, ask.burst)
            got.append(bucket.take_up_to(ask.want))
        return got

    async def lease(self, asks: list[Lease]) -> list[int]:
        return self.take(asks)

    def drop(self, request_ids: list[str]) -> None:
        """`forget`, synchronously."""
        for rid in request_ids:
            self._buckets.pop(rid, None)

    async def forget(self, request_ids: list[str]) -> None:
        self.drop(request_ids)

    async def out(self, request_ids: list[str]) -> dict[str, int] | None:
        return None


@dataclass(slots=True)
class _Paced:
    policy: Policy
    #: When the policy was set (epoch ms): its ramp counts from there.
    set_ms: int
    #: Tokens leased and not spent yet.
    tokens: int = 0
    #: This request's share of max_in_flight here (None: no cap).
    cap: int | None = None
    #: Starts here per tick (epoch s of the tick, count), the last minute's: the rate achieved.
    starts: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    #: Starts since the last tick.
    fresh: int = 0
    #: It has max_per_minute (the policy's, kept at hand for the hot path).
    rated: bool = False


class Pacer:
    """The paced requests and what each may start now (see the module docstring)."""

    def __init__(
        self,
        budget: Budget,
        *,
        wall_ms: Callable[[], int] = now_ms,
        cap_share: Callable[[int], int] = lambda cap: cap,
        on_wake: Callable[[list[str]], None] | None = None,
        lease_s: float = LEASE_S,
        max_idle: int = MAX_IDLE,
    ) -> None:
        self._budget = budget
        self._wall_ms = wall_ms
        #: This process's part of a request's max_in_flight (the whole of it when alone).
        self._cap_share = cap_share
        self.on_wake = on_wake
        self._lease_s = lease_s
        self._max_idle = max_idle
        self._paced: dict[str, _Paced] = {}
        #: Deliveries in flight here per request id, paced or not (a cap may come later).
        self._out: collections.Counter[str] = collections.Counter()
        #: Idle vehicles, oldest first, each with the requests that were blocked when it went idle.
        self._idle: dict[str, frozenset[str]] = {}
        self._blocked: frozenset[str] = _NONE
        self._caps: dict[str, int] = {}
        #: Paced requests that started a delivery (or are new) since the last tick: only these
        #: are counted and leased for, so a tick costs the active campaigns, not every policy.
        self._touched: set[str] = set()
        self._forgotten: list[str] = []
        #: (VIN, request id) → until when (epoch ms) a delivery out before this process started
        #: counts as out; with the same in deadline order (`carry`).
        self._carried: dict[tuple[str, str], int] = {}
        self._carried_order: collections.deque[tuple[int, str, str]] = collections.deque()

    # -- policies ----------------------------------------------------------------------
    def set(self, request_id: str, policy: Policy | None, set_ms: int) -> None:
        """The policy of `request_id` is now `policy` (None: none), set at `set_ms`."""
        if self._apply(request_id, policy, set_ms):
            self._rebuild()

    def _apply(self, request_id: str, policy: Policy | None, set_ms: int) -> bool:
        """`set` without the blocked set's rebuild; whether anything changed."""
        before = self._paced.get(request_id)
        if policy is None or not policy.paces:
            if before is None:
                return False
            del self._paced[request_id]
            self._touched.discard(request_id)
            self._forgotten.append(request_id)
            return True
        if before is None or before.policy != policy or before.set_ms != set_ms:
            paced = _Paced(policy, set_ms, before.tokens if before else 0, rated=policy.max_per_minute is not None)
            if before is not None:
                paced.starts, paced.fresh = before.starts, before.fresh
            if policy.max_in_flight is not None:
                paced.cap = self._cap_share(policy.max_in_flight)
            self._paced[request_id] = paced
            log.info(
                "campaign_paced",
                request_id=request_id,
                max_per_minute=policy.max_per_minute,
                ramp=policy.as_doc().get("ramp"),
                max_in_flight=policy.max_in_flight,
                cap_here=paced.cap,
            )
            self._touched.add(request_id)  # leased at the next tick
            return True
        return False

    def replace_all(self, found: Iterable[tuple[str, Policy, int]]) -> None:
        """Every policy in force: (request id, policy, set_ms). One rebuild of the blocked set,
        and only when something changed: a reload of many unchanged policies costs a lookup each."""
        seen = set()
        changed = False
        for rid, policy, set_ms in found:
            seen.add(rid)
            changed |= self._apply(rid, policy, set_ms)
        for rid in [r for r in self._paced if r not in seen]:
            changed |= self._apply(rid, None, 0)
        if changed:
            self._rebuild()

    def policy(self, request_id: str) -> Policy | None:
        paced = self._paced.get(request_id)
        return None if paced is None else paced.policy

    # -- the delivery path ---------------------------------------------------------------
    def blocked(self) -> frozenset[str]:
        """The request ids whose rows may not start a delivery now."""
        return self._blocked

    def started(self, request_id: str, vin: str | None = None) -> None:
        """A delivery of `request_id` was published (to `vin`): it spends a token (the hot path:
        counting for the metric and the rate shown waits for the tick)."""
        if self._carried and vin is not None:
            self.ended(vin, request_id)  # sent again: the worker's entry counts it now
        paced = self._paced.get(request_id)
        if paced is None:
            return
        paced.fresh += 1
        self._touched.add(request_id)
        if paced.rated:
            paced.tokens -= 1
            if paced.tokens <= 0:
                paced.tokens = 0
                self._rebuild()

    def out(self, request_id: str, delta: int) -> None:
        """A delivery of `request_id` entered (+1) or left (-1) a worker's in-flight table."""
        if not delta:
            return
        count = self._out[request_id] + delta
        if count > 0:
            self._out[request_id] = count
        else:
            del self._out[request_id]
        paced = self._paced.get(request_id)
        if paced is not None and paced.cap is not None and (count >= paced.cap) != (count - delta >= paced.cap):
            self._rebuild()

    def carry(self, deliveries: Iterable[tuple[str, str, int]]) -> int:
        """Deliveries out before this process started, which no worker holds: (VIN, request id,
        until when (epoch ms) each counts as out, its in-flight timeout). Each counts until it
        ends (`ended`), its VIN is sent the request again (`started`) or that time passes (each
        tick). Returns how many count."""
        now = self._wall_ms()
        for vin, request_id, until_ms in sorted(deliveries, key=lambda d: d[2]):
            if until_ms > now and (vin, request_id) not in self._carried:
                self._carried[vin, request_id] = until_ms
                self._carried_order.append((until_ms, vin, request_id))
                self.out(request_id, 1)
        return len(self._carried)

    def ended(self, vin: str, request_id: str) -> None:
        """The pair (vin, request_id) ended: a delivery of it carried over a restart is not out."""
        if self._carried.pop((vin, request_id), None) is not None:
            self.out(request_id, -1)

    def _drop_carried(self, now_ms: int) -> None:
        """Deliveries carried over a restart whose in-flight timeout passed are not out any more."""
        order = self._carried_order
        while order and order[0][0] <= now_ms:
            until_ms, vin, request_id = order.popleft()
            if self._carried.get((vin, request_id)) == until_ms:
                self.ended(vin, request_id)

    def observe(self, request_id: str, count: int) -> None:
        """`count` deliveries of `request_id` are out fleet-wide, as counted in the store."""
        self.out(request_id, count - self._out.get(request_id, 0))

    def caps(self) -> dict[str, int]:
        """Request id → its max_in_flight share here, for those that have one."""
        return self._caps

    def started_last_minute(self, request_id: str) -> int:
        """Deliveries of a paced `request_id` started here in the last 60 s."""
        paced = self._paced.get(request_id)
        if paced is None:
            return 0
        since = self._wall_ms() // 1000 - 60
        return paced.fresh + sum(n for second, n in paced.starts if second > since)

    def in_flight(self, request_id: str) -> int:
        """Deliveries of `request_id` in flight here."""
        return self._out.get(request_id, 0)

    def idle(self, vin: str, blocked: frozenset[str] | None = None) -> None:
        """`vin` found nothing to send while some request was blocked (`blocked`, by default this
        pacer's): offer it capacity once one of those is no longer blocked."""
        waits = self._blocked if blocked is None else blocked
        idle = self._idle
        if vin not in idle and len(idle) >= self._max_idle:
            del idle[next(iter(idle))]
        idle[vin] = waits

    # -- each tick ---------------------------------------------------------------------
    async def tick(self) -> None:
        """Top up the leases of requests that spent tokens, then offer idle vehicles what
        capacity there is."""
        if self._forgotten:
            gone, self._forgotten = self._forgotten, []
            await self._budget.forget(gone)
        if self._caps:
            counted = await self._budget.out(sorted(self._caps))
            if counted is not None:
                for rid in self._caps:
                    self.observe(rid, counted.get(rid, 0))
        now = self._wall_ms()
        if self._carried_order:
            self._drop_carried(now)
        touched, self._touched = self._touched, set()
        self._count_starts(touched, now // 1000)
        asks = []
        for rid in touched:
            paced = self._paced.get(rid)
            rate = None if paced is None else paced.policy.rate_per_minute(now - paced.set_ms)
            if paced is None or rate is None:
                continue
            per_s = rate / 60
            chunk = max(1, math.ceil(per_s * self._lease_s))
            if paced.tokens < chunk:
                asks.append(Lease(rid, per_s, burst_of(per_s), chunk - paced.tokens))
        if asks:
            try:
                got = await self._budget.lease(asks)
            except BaseException:
                self._touched.update(a.request_id for a in asks)  # asked again at the next tick
                raise
            for ask, n in zip(asks, got, strict=True):
                paced_now = self._paced.get(ask.request_id)
                if paced_now is not None:
                    paced_now.tokens += n
                    if n < ask.want:  # the bucket ran dry: ask again at the next tick
                        self._touched.add(ask.request_id)
            self._rebuild()
        self._wake()

    def _count_starts(self, touched: Iterable[str], second: int) -> None:
        """Move the starts since the last tick into the metric and the last minute's counts."""
        fresh = 0
        for rid in touched:
            paced = self._paced.get(rid)
            if paced is not None and paced.fresh:
                fresh += paced.fresh
                starts = paced.starts
                starts.append((second, paced.fresh))
                paced.fresh = 0
                while starts[0][0] <= second - 60:
                    starts.popleft()
        if fresh:
            metrics.PACED_STARTS.inc(fresh)

    def _wake(self) -> None:
        if not self._idle or self.on_wake is None:
            return
        room = 0
        for rid, paced in self._paced.items():
            if rid in self._blocked:
                continue
            free = paced.tokens if paced.policy.max_per_minute is not None else MAX_WAKE
            if paced.cap is not None:
                free = min(free, paced.cap - self._out.get(rid, 0))
            room += max(0, free)
        # Twice the capacity: some of them have no row of the request that has it.
        n = min(len(self._idle), 2 * room, MAX_WAKE)
        if n <= 0:
            return
        # Only vehicles one of whose blocked requests is open now: one that waits only for requests
        # still blocked would find nothing again (on PostgreSQL, an event and its round trips each
        # tick). Those go to the back; a bounded look, so a tick costs at most 4n of them.
        idle, blocked = self._idle, self._blocked
        vins: list[str] = []
        for _ in range(min(len(idle), 4 * n)):
            vin = next(iter(idle))
            waits = idle.pop(vin)
            if waits and waits <= blocked:
                idle[vin] = waits
                continue
            vins.append(vin)
            if len(vins) == n:
                break
        if vins:
            self.on_wake(vins)

    def _full(self, request_id: str, paced: _Paced) -> bool:
        """No token left, or at its in-flight cap."""
        if paced.rated and paced.tokens < 1:
            return True
        return paced.cap is not None and self._out.get(request_id, 0) >= paced.cap

    def _rebuild(self) -> None:
        blocked = [rid for rid, paced in self._paced.items() if self._full(rid, paced)]
        self._caps = {rid: paced.cap for rid, paced in self._paced.items() if paced.cap is not None}
        self._blocked = frozenset(blocked) if blocked else _NONE
        metrics.CAMPAIGNS_PACED.set(len(self._blocked))

    async def run(self, tick_s: float = TICK_S) -> None:
        """Forever: `tick` every `tick_s`; a budget that cannot answer is logged once until it
        answers again (the leases held meanwhile run out: nothing paced starts)."""
        failing = False
        while True:
            try:
                await self.tick()
            except Exception as exc:  # the store, process 0 of a group: pacing must go on
                if not failing:
                    log.error("pacing_budget_unavailable", reason=type(exc).__name__, detail=str(exc))
                failing = True
            else:
                if failing:
                    log.info("pacing_budget_back")
                failing = False
            metrics.PACING_IDLE_VEHICLES.set(len(self._idle))
            await asyncio.sleep(tick_s)
