"""When a campaign's pending rows will all have been sent, under its policy (`policy R --preview`).

A pure function of (policy, when it was set, rows, now): the gate (paused, start_at, windows) and
the rate (max_per_minute, ramp) are exhook_server/policy.py's, walked forward from now in stretches
where both are constant. It predicts the starts of the deliveries the vehicles online now can
take; rows of vehicles offline wait for their vehicle, which no policy predicts. A delivery's
own round trip and `max_in_flight` are not modelled (a start is counted as its completion).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from exhook_server.policy import Policy
from storage.port import Reads

#: Stretches walked at most (a window a day and a ramp step an hour: years): beyond, no answer.
MAX_STRETCHES = 100_000


@dataclass(frozen=True, slots=True)
class Forecast:
    """What `sdv-fanout policy R --preview` shows."""

    #: R's pending rows, and of them those whose vehicle is online now (None: not known there).
    pending: int
    online_now: int | None
    #: When the last row that can go now has started (epoch ms); None: never under the policy
    #: (paused) or beyond MAX_STRETCHES.
    completes_at_ms: int | None
    #: The policy in force (its stored JSON, b"" when none is) and when it was set (0: none).
    policy: bytes = b""
    set_ms: int = 0


#: Up to `limit` VINs with a pending row of the request, in VIN order past `after` (Writes.pending_vins).
PendingVins = Callable[[str, str, int], Awaitable[list[str]]]
#: How many of these VINs are online now (Dispatch.online_among).
OnlineAmong = Callable[[Sequence[str]], Awaitable[int]]
#: VINs per page when counting online vehicles through dispatch, and pages at most (10 million VINs).
PAGE = 1_000
MAX_PAGES = 10_000


async def forecast(
    reads: Reads, request_id: str, now_ms: int, online_walk: Callable[[], Awaitable[int]] | None = None
) -> Forecast | None:
    """The forecast of `request_id` at `now_ms` from what the store holds (None: no generation of
    it). The vehicles online now: the store's presence (PostgreSQL), else `online_walk()` (a
    running LMDB server's dispatch, `count_online`), else unknown: every pending row counts."""
    found = await reads.generations(request_id)
    if not found:
        return None
    pending = sum(g.pending for g in found)
    stored = await reads.policy(request_id)
    policy = None if stored is None else Policy.decode(stored.doc)
    set_ms = 0 if stored is None else stored.set_ms
    online = await reads.online_pending(request_id)
    if online is None and online_walk is not None:
        online = await online_walk()
    rows = pending if online is None else online
    return Forecast(
        pending,
        online,
        completes_at(policy, set_ms, rows, now_ms),
        b"" if stored is None else stored.doc,
        set_ms,
    )


async def count_online(request_id: str, pending_vins: PendingVins, online_among: OnlineAmong) -> int:
    """Pending rows of `request_id` whose vehicle dispatch knows online, a page of VINs at a time."""
    online, after = 0, ""
    for _ in range(MAX_PAGES):
        page = await pending_vins(request_id, after, PAGE)
        if page:
            online += await online_among(page)
        if len(page) < PAGE:
            break
        after = page[-1]
    return online


def completes_at(policy: Policy | None, set_ms: int, rows: int, now_ms: int) -> int | None:
    """When `rows` deliveries of a request whose policy (set at `set_ms`) is `policy` will have
    started, starting at `now_ms`: at once when nothing bounds the rate (the moment the gate
    opens), else at the rate in force in each open stretch."""
    t, left = now_ms, float(rows)
    for _ in range(MAX_STRETCHES):
        if left <= 0:
            return t
        if policy is None:
            return t
        opens = policy.opens_at(t)
        if opens is None:
            return None
        t = opens
        rate = policy.rate_per_minute(t - set_ms)
        if rate is None:
            return t
        end = _next_change(policy, set_ms, t)
        can = rate * (end - t) / 60_000 if end is not None else math.inf
        if can >= left:
            return t + math.ceil(left * 60_000 / rate)
        assert end is not None
        left -= can
        t = end
    return None


def _next_change(policy: Policy, set_ms: int, t: int) -> int | None:
    """The end of the stretch from `t` in which the gate stays open and the rate constant."""
    ends = []
    if (closes := policy.open_until(t)) is not None:
        ends.append(closes)
    ramp = policy.ramp
    if ramp is not None and policy.rate_per_minute(t - set_ms) != policy.max_per_minute:
        step_ms = ramp.every_s * 1000
        ends.append(set_ms + (max(0, t - set_ms) // step_ms + 1) * step_ms)
    return min(ends, default=None)
