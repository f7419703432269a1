"""The delivery budget: how fast this process starts deliveries (`max_deliveries_per_s`).

One token bucket (exhook_server/dispatch/bucket.py) on an injected clock: a delivery start takes a
token, a vehicle that finds none waits in a queue, one entry per vehicle (so at most one per
online vehicle). Every tick the tokens there are granted to waiting vehicles, high priority
first, and within a lane round-robin over the request ids they wait with, oldest first for
each; `on_wake` offers them their next row again. A grant keeps a token for its vehicle (taken
when used) for `GRANT_S` at most. Not thread-safe: the event loop's thread owns it.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

from exhook_server import metrics
from exhook_server.dispatch.bucket import TokenBucket

#: How often waiting vehicles are granted the tokens accrued.
TICK_S = 0.02
#: How long a grant keeps its token for its vehicle (the offer runs within milliseconds).
GRANT_S = 1.0
#: Burst: at most this many seconds of the rate start at once after a quiet spell.
BURST_S = 1.0


class _Lane:
    """The vehicles of one priority waiting for a token, per request id in rotation order."""

    __slots__ = ("by_request", "turns")

    def __init__(self) -> None:
        self.by_request: dict[str, dict[str, None]] = {}
        self.turns: collections.deque[str] = collections.deque()

    def add(self, request_id: str, vin: str) -> None:
        waiting = self.by_request.get(request_id)
        if waiting is None:
            waiting = self.by_request[request_id] = {}
            self.turns.append(request_id)
        waiting[vin] = None

    def remove(self, request_id: str, vin: str) -> None:
        waiting = self.by_request[request_id]
        del waiting[vin]
        if not waiting:
            del self.by_request[request_id]
            self.turns.remove(request_id)

    def pop(self) -> str | None:
        """The first vehicle of the request id whose turn it is (that request goes last)."""
        if not self.turns:
            return None
        request_id = self.turns.popleft()
        waiting = self.by_request[request_id]
        vin = next(iter(waiting))
        del waiting[vin]
        if waiting:
            self.turns.append(request_id)
        else:
            del self.by_request[request_id]
        return vin


class DeliveryBudget:
    """At most `rate_per_s` delivery starts per second here, `BURST_S` of it at once."""

    def __init__(
        self,
        rate_per_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_wake: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._clock = clock
        self._bucket = TokenBucket(rate_per_s, max(1.0, rate_per_s * BURST_S), clock)
        self.on_wake = on_wake
        self._high = _Lane()
        self._normal = _Lane()
        #: VIN → (high, request id) it waits with.
        self._waiting: dict[str, tuple[bool, str]] = {}
        #: VIN → when it was granted a token (clock).
        self._granted: dict[str, float] = {}

    def admit(self, vin: str, request_id: str, high: bool) -> bool:
        """May `vin` start a delivery of `request_id` (`high`: of its high-priority lane) now?
        It takes a token: its grant's, or a free one while nobody waits. Otherwise the vehicle
        waits (its lane and request id as given now) and False."""
        granted = self._granted.pop(vin, None)
        if granted is not None and self._bucket.take():
            return True
        if not self._waiting and self._bucket.available() - len(self._granted) >= 1 and self._bucket.take():
            return True
        self._wait(vin, request_id, high)
        return False

    def _wait(self, vin: str, request_id: str, high: bool) -> None:
        before = self._waiting.get(vin)
        if before == (high, request_id):
            return
        if before is None:
            metrics.DELIVERIES_DEFERRED.inc()
        else:
            (self._high if before[0] else self._normal).remove(before[1], vin)
        self._waiting[vin] = (high, request_id)
        (self._high if high else self._normal).add(request_id, vin)
        metrics.DELIVERIES_WAITING.set(len(self._waiting))

    def forget(self, vin: str) -> None:
        """`vin` went offline: it waits no more, and a token granted to it is free again."""
        self._granted.pop(vin, None)
        before = self._waiting.pop(vin, None)
        if before is not None:
            (self._high if before[0] else self._normal).remove(before[1], vin)
            metrics.DELIVERIES_WAITING.set(len(self._waiting))

    def waiting(self) -> int:
        """Vehicles waiting for a token."""
        return len(self._waiting)

    def tick(self) -> list[str]:
        """Grant the tokens there are to waiting vehicles (high priority first, round-robin over
        request ids); the vehicles granted, also told to `on_wake`."""
        now = self._clock()
        expired = [vin for vin, at in self._granted.items() if now - at >= GRANT_S]
        for vin in expired:
            del self._granted[vin]
        free = math.floor(self._bucket.available() + 1e-9) - len(self._granted)
        woken: list[str] = []
        while free > 0 and self._waiting:
            found = self._high.pop()
            if found is None:
                found = self._normal.pop()
            assert found is not None  # someone waits, in one lane or the other
            vin = found
            del self._waiting[vin]
            self._granted[vin] = now
            woken.append(vin)
            free -= 1
        if woken:
            metrics.DELIVERIES_WAITING.set(len(self._waiting))
            if self.on_wake is not None:
                self.on_wake(woken)
        return woken

    async def run(self, tick_s: float = TICK_S) -> None:
        """Forever: `tick` every `tick_s`."""
        while True:
            self.tick()
            await asyncio.sleep(tick_s)
