"""A campaign's policy: its fields, their validation, their stored form, and when its gate opens.

Pure values and functions of (payload, clock): nothing here touches a store. A policy message is
`{"request_id": R, ...fields}`; no field at all clears R's policy. Every refusal is a
`BatchRejected` with reason `bad_policy` naming the field, raised before anything is written.
`Policy.as_doc` is the form stored and echoed (`policy` status event, GetPolicy), and
`Policy.from_doc` reads it back. Windows are 5-field cron expressions evaluated by croniter in
the window's IANA time zone (zoneinfo), so DST follows the time zone database.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import orjson
from croniter import croniter

from exhook_server.batch import PRIORITIES, instant_ms
from exhook_server.errors import BatchRejected, Reason

#: Fields a policy may carry (besides request_id and correlation_id); any other is refused, so a
#: typo never passes for a policy in force.
FIELDS = ("max_per_minute", "ramp", "max_in_flight", "abort", "start_at", "windows", "paused", "priority")
#: Outcomes an abort criterion may count.
ABORT_OUTCOMES = ("failed", "expired", "answer_failed")
#: Largest count a rate, cap or minimum takes: a typo beyond it is refused, not obeyed.
MAX_COUNT = 1_000_000_000
#: Abort criteria and windows one policy holds at most (each is evaluated in the delivery path).
MAX_CRITERIA = 8
MAX_WINDOWS = 16
#: Longest window and longest ramp step: a week and a year, in seconds.
MAX_DURATION_S = 7 * 86_400
MAX_RAMP_EVERY_S = 366 * 86_400
#: A ramp's factor: above 1 (it must grow), at most 100 per step.
MAX_RAMP_FACTOR = 100.0


@dataclass(frozen=True, slots=True)
class Ramp:
    """The rate starts at `start_per_minute` and is multiplied by `factor` every `every_s`."""

    start_per_minute: int
    factor: float
    every_s: int


@dataclass(frozen=True, slots=True)
class AbortCriterion:
    """Abort when `outcome`'s share of the finished pairs reaches `ratio` after `min_finished`."""

    outcome: str
    ratio: float
    min_finished: int

    def as_doc(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "ratio": self.ratio, "min_finished": self.min_finished}

    def crossed(self, counts: Mapping[str, int]) -> bool:
        """Whether `counts` (a request's `finished` pairs and its count of each abort outcome)
        cross this criterion: at least `min_finished` finished, `outcome`'s share at least `ratio`."""
        finished = counts["finished"]
        return finished >= self.min_finished and counts[self.outcome] / finished >= self.ratio


@dataclass(frozen=True, slots=True)
class Window:
    """Deliveries may start for `duration_s` from each time `cron` fires in zone `tz`."""

    cron: str
    duration_s: int
    tz: str


@dataclass(frozen=True, slots=True)
class Policy:
    """What governs every row of one request id; every field optional (None / empty: no rule)."""

    max_per_minute: int | None = None
    ramp: Ramp | None = None
    max_in_flight: int | None = None
    abort: tuple[AbortCriterion, ...] = ()
    #: Epoch ms before which nothing of the request is sent.
    start_at_ms: int | None = None
    windows: tuple[Window, ...] = ()
    paused: bool = False
    priority: str = "normal"

    def as_doc(self) -> dict[str, Any]:
        """The fields set, as JSON (what is stored and echoed); start_at as epoch ms."""
        doc: dict[str, Any] = {}
        if self.max_per_minute is not None:
            doc["max_per_minute"] = self.max_per_minute
        if self.ramp is not None:
            r = self.ramp
            doc["ramp"] = {"start_per_minute": r.start_per_minute, "factor": r.factor, "every_s": r.every_s}
        if self.max_in_flight is not None:
            doc["max_in_flight"] = self.max_in_flight
        if self.abort:
            doc["abort"] = [c.as_doc() for c in self.abort]
        if self.start_at_ms is not None:
            doc["start_at"] = self.start_at_ms
        if self.windows:
            doc["windows"] = [{"cron": w.cron, "duration_s": w.duration_s, "tz": w.tz} for w in self.windows]
        if self.paused:
            doc["paused"] = True
        if self.priority != "normal":
            doc["priority"] = self.priority
        return doc

    def encode(self) -> bytes:
        """The stored form (`as_doc` as JSON bytes)."""
        return orjson.dumps(self.as_doc())

    @classmethod
    def decode(cls, raw: bytes) -> Policy:
        """A stored policy read back (it was validated when set)."""
        found = parse_fields(orjson.loads(raw))
        assert found is not None
        return found

    @property
    def paces(self) -> bool:
        """Whether the policy bounds the rate or the concurrency of R's deliveries."""
        return self.max_per_minute is not None or self.max_in_flight is not None

    def rate_per_minute(self, elapsed_ms: int) -> float | None:
        """Deliveries per minute allowed `elapsed_ms` after the policy was set (None: no bound):
        the ramp's start rate multiplied by its factor once per `every_s` elapsed, up to
        `max_per_minute`."""
        if self.max_per_minute is None:
            return None
        ramp = self.ramp
        if ramp is None:
            return float(self.max_per_minute)
        steps = max(0, elapsed_ms) // (ramp.every_s * 1000)
        # factor > 1: past log(max/start)/log(factor) steps the ramp is over (no huge powers).
        top = math.log(self.max_per_minute / ramp.start_per_minute) / math.log(ramp.factor)
        if steps >= top:
            return float(self.max_per_minute)
        return min(float(self.max_per_minute), ramp.start_per_minute * ramp.factor**steps)

    def open_until(self, now_ms: int) -> int | None:
        """When the gate open at `now_ms` (`opens_at(now_ms) == now_ms`) closes: the end of the
        windows open then, and of any that open before that end (None: no window, it stays open)."""
        if not self.windows:
            return None
        until = now_ms
        for _ in range(MAX_WINDOWS * 64):  # overlapping windows chain; bounded all the same
            ends = [e for w in self.windows if (e := window_closes_at(w, until)) is not None]
            if not ends:
                return until
            until = max(ends)
        return until

    def opens_at(self, now_ms: int) -> int | None:
        """When a delivery of the request may start, as seen at `now_ms`: `now_ms` itself if now,
        a later epoch ms when start_at or the next window opens it, None while paused."""
        if self.paused:
            return None
        at = max(now_ms, self.start_at_ms or 0)
        if not self.windows:
            return at
        return min(window_opens_at(w, at) for w in self.windows)


def window_opens_at(window: Window, now_ms: int) -> int:
    """`now_ms` when inside `window`, else the epoch ms its next occurrence starts."""
    if window_closes_at(window, now_ms) is not None:
        return now_ms
    now = datetime.datetime.fromtimestamp(now_ms / 1000, tz=ZoneInfo(window.tz))
    following: datetime.datetime = croniter(window.cron, now).get_next(datetime.datetime)
    return _ms(following)


def window_closes_at(window: Window, now_ms: int) -> int | None:
    """When the occurrence of `window` open at `now_ms` ends (epoch ms); None when none is open."""
    now = datetime.datetime.fromtimestamp(now_ms / 1000, tz=ZoneInfo(window.tz))
    # The latest start at or before now: a window started then is open if its duration covers now.
    last: datetime.datetime = croniter(window.cron, now + datetime.timedelta(microseconds=1)).get_prev(
        datetime.datetime
    )
    closes = _ms(last) + window.duration_s * 1000
    return closes if closes > now_ms else None


def _ms(when: datetime.datetime) -> int:
    return math.floor(when.timestamp() * 1000)


def parse_fields(doc: Mapping[str, Any]) -> Policy | None:
    """The policy a message's fields give (request_id and correlation_id ignored); None when it
    names no field (a clear). Raises BatchRejected(bad_policy) for the first field wrong."""
    unknown = sorted(k for k in doc if k not in FIELDS and k not in ("request_id", "correlation_id"))
    if unknown:
        raise _bad(unknown[0][:40], f"{unknown[0][:40]!r} is not a policy field (fields: {', '.join(FIELDS)})")
    if not any(k in doc for k in FIELDS):
        return None
    max_per_minute = _count(doc, "max_per_minute")
    ramp = _ramp(doc.get("ramp"), max_per_minute)
    max_in_flight = _count(doc, "max_in_flight")
    start_at = doc.get("start_at")
    start_at_ms = None if start_at is None else instant_ms(start_at, "start_at", Reason.BAD_POLICY)
    paused = doc.get("paused", False)
    if not isinstance(paused, bool):
        raise _bad("paused", "paused must be true or false")
    priority = doc.get("priority", "normal")
    if priority not in PRIORITIES:
        raise _bad("priority", 'priority must be "high" or "normal"')
    return Policy(
        max_per_minute,
        ramp,
        max_in_flight,
        _criteria(doc.get("abort")),
        start_at_ms,
        _windows(doc.get("windows")),
        paused,
        priority,
    )


def _bad(field: str, detail: str) -> BatchRejected:
    return BatchRejected(Reason.BAD_POLICY, detail, field=field)


def _int(value: Any, what: str, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(field, f"{what} must be an integer {low}..{high}")
    return value


def _count(doc: Mapping[str, Any], name: str) -> int | None:
    value = doc.get(name)
    return None if value is None else _int(value, name, name, 1, MAX_COUNT)


def _number(value: Any, what: str, field: str, low: float, high: float, *, open_low: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > low if open_low else value >= low) and value <= high:
        return float(value)
    raise _bad(field, f"{what} must be a number {'above' if open_low else 'from'} {low} up to {high}")


def _object(value: Any, field: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(field, f"{field} must be an object with {', '.join(keys)}")
    extra = sorted(k for k in value if k not in keys)
    missing = [k for k in keys if k not in value]
    if extra or missing:
        raise _bad(field, f"{field} takes exactly {', '.join(keys)}")
    return value


def _ramp(value: Any, max_per_minute: int | None) -> Ramp | None:
    if value is None:
        return None
    obj = _object(value, "ramp", ("start_per_minute", "factor", "every_s"))
    if max_per_minute is None:
        raise _bad("ramp", "ramp needs max_per_minute (the rate it grows to)")
    start = _int(obj["start_per_minute"], "ramp.start_per_minute", "ramp", 1, max_per_minute)
    factor = _number(obj["factor"], "ramp.factor", "ramp", 1.0, MAX_RAMP_FACTOR, open_low=True)
    every_s = _int(obj["every_s"], "ramp.every_s", "ramp", 1, MAX_RAMP_EVERY_S)
    return Ramp(start, factor, every_s)


def _criteria(value: Any) -> tuple[AbortCriterion, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CRITERIA:
        raise _bad("abort", f"abort must be a list of 1..{MAX_CRITERIA} criteria")
    found = []
    for item in value:
        obj = _object(item, "abort", ("outcome", "ratio", "min_finished"))
        if obj["outcome"] not in ABORT_OUTCOMES:
            raise _bad("abort", f"abort outcome must be one of {', '.join(ABORT_OUTCOMES)}")
        ratio = _number(obj["ratio"], "abort ratio", "abort", 0.0, 1.0, open_low=True)
        found.append(
            AbortCriterion(obj["outcome"], ratio, _int(obj["min_finished"], "min_finished", "abort", 1, MAX_COUNT))
        )
    return tuple(found)


def _windows(value: Any) -> tuple[Window, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not 0 < len(value) <= MAX_WINDOWS:
        raise _bad("windows", f"windows must be a list of 1..{MAX_WINDOWS} windows")
    found = []
    for item in value:
        obj = _object(item, "windows", ("cron", "duration_s", "tz"))
        cron, tz = obj["cron"], obj["tz"]
        if not isinstance(cron, str) or len(cron) > 200 or len(cron.split()) != 5 or not croniter.is_valid(cron):
            raise _bad("windows", "a window's cron must be a 5-field cron expression (minute hour day month weekday)")
        duration_s = _int(obj["duration_s"], "a window's duration_s", "windows", 1, MAX_DURATION_S)
        if not isinstance(tz, str) or not _zone_ok(tz):
            raise _bad("windows", "a window's tz must be an IANA time zone name (Europe/Berlin) or UTC")
        found.append(Window(" ".join(cron.split()), duration_s, tz))
    return tuple(found)


def _zone_ok(name: str) -> bool:
    if not name or len(name) > 64 or name.startswith(("/", ".")) or ".." in name:
        return False
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return False
    return True
