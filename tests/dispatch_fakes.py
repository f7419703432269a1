"""In-memory stand-ins for the dispatch seams (RowSource, Publisher) and a deterministic clock.

Used by the rule tests and the randomized simulation; the integration tests use
the real LMDB store and a real broker instead. `MemoryRows` keeps the store's
lifecycle rules too (storage/lmdb/batches.py, pending.py, cancel.py, outcomes.py): one outcome
per (VIN, request_id, sha1) pair, superseded on replacement, cancels of named VINs and
of every vehicle (a cut, then chunks), expiry, and the amendment of a cancelled pair by
its delivery's later PUBACK or answer.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from exhook_server.dispatch.commands import Session
from exhook_server.dispatch.worker import NOTHING_KEPT, Kept
from storage.lmdb.keys import FLAG_AWAIT_RESPONSE, FLAG_HIGH_PRIORITY, Row
from storage.lmdb.outcomes import Outcome

Pair = tuple[str, str, bytes]  # (VIN, request_id, sha1)

K = TypeVar("K", bound=tuple[Any, ...])
V = TypeVar("V")


class ByRequest(dict[K, V]):
    """A dict keyed by tuples whose second item is a request id, that also keeps its keys per
    request id (in the dict's own order): `of(request_id)` reads one request's entries without a
    walk over every other request's. Only item assignment, `del` and `pop` change it."""

    def __init__(self, *args: Any) -> None:
        super().__init__()
        self._of: dict[Hashable, dict[K, None]] = {}
        for key, value in dict(*args).items():
            self[key] = value

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self:
            self._of.setdefault(key[1], {})[key] = None
        super().__setitem__(key, value)

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        keys = self._of[key[1]]
        del keys[key]
        if not keys:
            del self._of[key[1]]

    def pop(self, key: K, *default: Any) -> Any:
        if key in self:
            value = self[key]
            del self[key]
            return value
        if default:
            return default[0]
        raise KeyError(key)

    def _refused(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ByRequest changes only by item assignment, del and pop")

    update = setdefault = popitem = clear = __ior__ = _refused  # type: ignore[assignment]

    def of(self, request_id: str) -> Iterator[tuple[K, V]]:
        """(key, value) of the request's entries, in the dict's order."""
        return ((key, self[key]) for key in self._of.get(request_id, ()))


def sha1(payload: bytes) -> bytes:
    return hashlib.sha1(payload).digest()


@dataclass
class Pending:
    """One pending row: what `ids` holds for (VIN, request_id)."""

    ts: int
    payload: bytes
    expires_ms: int = 0
    flags: int = 0

    @functools.cached_property
    def sha1(self) -> bytes:
        return sha1(self.payload)

    @property
    def await_response(self) -> bool:
        return bool(self.flags & FLAG_AWAIT_RESPONSE)

    @property
    def high_priority(self) -> bool:
        return bool(self.flags & FLAG_HIGH_PRIORITY)


@dataclass(frozen=True)
class Ended:
    """How a pair ended (an `outcomes` record)."""

    outcome: Outcome
    attempts: int = 0
    response: bytes = b""


@dataclass(frozen=True)
class AckCall:
    """One `ack` call of the worker, with what it answered."""

    vin: str
    request_id: str
    sha1: bytes
    outcome: Outcome
    attempts: int
    response: bytes
    result: bool


@dataclass
class CancelJob:
    """A cancel of every vehicle in progress (the store's `cancels` entry)."""

    cut: int
    after: str = ""
    done: int = 0


@dataclass
class MemoryRows:
    """Pending rows per VIN, with the same ordering, visibility and conditional end as the store."""

    rows: dict[tuple[str, str], Pending] = field(default_factory=ByRequest)
    #: The row timestamp source: each stored row is stamped later than every earlier one.
    clock: int = 0
    #: Acked rows whose end is not committed yet (committed by `commit_acks`): hidden from
    #: `oldest` meanwhile, as StoreRows hides them. (vin, request_id, sha1, outcome, attempts,
    #: response), in the order the group committer applies them.
    pending_acks: list[tuple[str, str, bytes, Outcome, int, bytes]] = field(default_factory=list)
    defer_acks: bool = False
    #: Epoch ms now: rows at or past their expires_ms are never offered, and `expire_due` ends them.
    now_ms: Callable[[], int] = lambda: 0
    #: One record per pair that is not pending (as the store's `outcomes` table).
    outcomes: dict[Pair, Ended] = field(default_factory=ByRequest)
    #: request_id → its cancel of every vehicle in progress.
    cancels: dict[str, CancelJob] = field(default_factory=dict)
    #: Request ids aborted under their campaign policy (the store's `aborts`): batches refused.
    aborted: set[str] = field(default_factory=set)
    #: Every `ack` call, in order (what the worker asked, not what the store did).
    acks: list[AckCall] = field(default_factory=list)
    #: Every pair the store ever took.
    taken: set[Pair] = field(default_factory=set)
    #: Cancelled pairs whose delivery's PUBACK or answer amended the outcome.
    amended: int = 0
    #: (VIN, request_id) → (sha1, times published, PUBACKed at epoch ms or None, session): what
    #: the store keeps of a pending row's deliveries (its `tries` and `awaited` tables).
    tries: dict[tuple[str, str], tuple[bytes, int, int | None, Session | None]] = field(default_factory=dict)
    #: Rows stamped before this were stored before the server (re)started: `tried` tells what is
    #: kept of them (see `restart`); of the others the worker's memory knows all.
    started: int = 0

    # -- writes the platform and housekeeping make ------------------------------------------
    def add(
        self,
        vin: str,
        request_id: str,
        payload: bytes,
        *,
        expires_ms: int = 0,
        await_response: bool = False,
        high_priority: bool = False,
    ) -> None:
        """Store (or replace) the row, as `ops.put_rows`: another payload supersedes the old one;
        a pair that had ended is pending again; a cancel in progress never takes it."""
        self.clock += 1
        digest = sha1(payload)
        key = (vin, request_id)
        old = self.rows.get(key)
        if old is None or old.sha1 != digest:
            if old is not None:
                self._end(vin, request_id, old, Outcome.SUPERSEDED)  # its tries go with it
            self.outcomes.pop((vin, request_id, digest), None)  # the same pair again: pending once more
        flags = (FLAG_AWAIT_RESPONSE if await_response else 0) | (FLAG_HIGH_PRIORITY if high_priority else 0)
        self.rows[key] = Pending(self.clock, payload, expires_ms, flags)
        self.taken.add((vin, request_id, digest))

    def cancel_vins(self, request_id: str, vins: list[str]) -> list[tuple[str, bytes]]:
        """Cancel the request's pending rows for these VINs in one go; (VIN, sha1) of each."""
        done = []
        for vin in vins:
            row = self.rows.get((vin, request_id))
            if row is not None:
                self._end(vin, request_id, row, Outcome.CANCELLED)
                done.append((vin, row.sha1))
        return done

    def start_cancel_all(self, request_id: str, max_rows: int) -> tuple[list[tuple[str, bytes]], bool]:
        """Record a cancel of every vehicle (its cut: every row stored so far) and run its first
        chunk; a second one while the first runs moves the cut and walks again."""
        old = self.cancels.get(request_id)
        self.cancels[request_id] = CancelJob(self.clock, done=old.done if old else 0)
        return self.cancel_chunk(request_id, max_rows)

    def cancel_chunk(self, request_id: str, max_rows: int) -> tuple[list[tuple[str, bytes]], bool]:
        """The next `max_rows` VINs (in VIN order) holding a row of the request; those stored up
        to the cut end cancelled. Returns them and whether more VINs are left."""
        job = self.cancels.get(request_id)
        if job is None:
            return [], False
        vins = sorted(v for v, rid in self.rows if rid == request_id and v > job.after)
        walk, more = vins[:max_rows], len(vins) > max_rows
        done = []
        for vin in walk:
            row = self.rows[vin, request_id]
            if row.ts <= job.cut:
                self._end(vin, request_id, row, Outcome.CANCELLED)
                done.append((vin, row.sha1))
        job.done += len(done)
        if more:
            job.after = walk[-1]
        else:
            del self.cancels[request_id]
        return done, more

    def expire_due(self) -> list[Pair]:
        """End `expired` every row at or past its expires_ms (the expiry sweep)."""
        now = self.now_ms()
        due = sorted((row.expires_ms, key) for key, row in self.rows.items() if 0 < row.expires_ms <= now)
        ended = []
        for _, (vin, request_id) in due:
            row = self.rows[vin, request_id]
            self._end(vin, request_id, row, Outcome.EXPIRED)
            ended.append((vin, request_id, row.sha1))
        return ended

    def _end(
        self, vin: str, request_id: str, row: Pending, outcome: Outcome, attempts: int = 0, response: bytes = b""
    ) -> None:
        pair = (vin, request_id, row.sha1)
        assert pair not in self.outcomes, f"{pair} ends twice"  # a pending pair has no record
        del self.rows[vin, request_id]
        self.tries.pop((vin, request_id), None)
        self.outcomes[pair] = Ended(outcome, attempts, response)

    # -- the RowSource port ---------------------------------------------------------------------
    def deliverable(self, vin: str, skip: frozenset[str] | None = None) -> list[tuple[str, Pending]]:
        """(request_id, row) of the rows that may be sent: not acked (hidden), not past their
        expiry, not taken by a cancel in progress, not of a request in `skip` (held by its
        campaign policy)."""
        hidden = self._hidden()
        now = self.now_ms()
        return [
            (rid, row)
            for (v, rid), row in self.rows.items()
            if v == vin
            and hidden.get((v, rid)) != row.sha1
            and not 0 < row.expires_ms <= now
            and not (rid in self.cancels and row.ts <= self.cancels[rid].cut)
            and not (skip and rid in skip)
        ]

    def oldest(
        self, vin: str, skip: frozenset[str] | None = None, high: frozenset[str] | None = None
    ) -> tuple[Row, bytes] | None:
        """The next row that may be sent (`deliverable`): the oldest of high priority (its flag,
        or its request id in `high`), else the oldest."""
        mine = self.deliverable(vin, skip)
        if not mine:
            return None
        rid, row = min(mine, key=lambda m: (not (m[1].high_priority or (high and m[0] in high)), m[1].ts, m[0]))
        return Row(vin, rid, row.ts, row.sha1, len(row.payload), row.expires_ms, row.flags), row.payload

    def ack(
        self,
        vin: str,
        request_id: str,
        digest: bytes,
        *,
        outcome: Outcome = Outcome.DELIVERED,
        attempts: int = 1,
        response: bytes = b"",
    ) -> bool:
        """As StoreRows.ack: a duplicate of an end on its way does nothing; a current row ends
        (at once, or at `commit_acks` when deferred); a cancelled pair is amended."""
        result = self._ack(vin, request_id, digest, outcome, attempts, response)
        self.acks.append(AckCall(vin, request_id, digest, outcome, attempts, response, result))
        return result

    def _hidden(self) -> dict[tuple[str, str], bytes]:
        """(VIN, request_id) → sha1 of the row whose end is on its way: one per pair, the last
        acked (StoreRows keeps vin → request_id → sha1)."""
        return {(vin, rid): digest for vin, rid, digest, *_ in self.pending_acks}

    def _ack(self, vin: str, request_id: str, digest: bytes, outcome: Outcome, attempts: int, response: bytes) -> bool:
        if self._hidden().get((vin, request_id)) == digest:
            return False  # a duplicate: its end is on its way
        current = self.rows.get((vin, request_id))
        ended = self.outcomes.get((vin, request_id, digest))
        if (current is None or current.sha1 != digest) and (ended is None or ended.outcome is not Outcome.CANCELLED):
            return False
        self.pending_acks.append((vin, request_id, digest, outcome, attempts, response))
        if not self.defer_acks:
            self.commit_acks()
        return True

    def acking(self, vin: str, request_id: str, digest: bytes) -> bool:
        """An `ack` of exactly this row started and not committed yet (as StoreRows.acking)."""
        return self._hidden().get((vin, request_id)) == digest

    def commit_acks(self) -> None:
        """Commit the acked ends, in order (`ops.delete_row_if`): each re-checks the row."""
        acks, self.pending_acks = self.pending_acks, []
        for vin, request_id, digest, outcome, attempts, response in acks:
            current = self.rows.get((vin, request_id))
            if current is not None and current.sha1 == digest:
                self._end(vin, request_id, current, outcome, attempts, response)
                continue
            ended = self.outcomes.get((vin, request_id, digest))
            # outcomes.amend_cancelled: a cancelled pair learns how its delivery ended.
            if ended is not None and ended.outcome is Outcome.CANCELLED and outcome is not Outcome.CANCELLED:
                self.outcomes[vin, request_id, digest] = Ended(outcome, max(attempts, ended.attempts), response)
                self.amended += 1

    def tried(self, vin: str, request_id: str, digest: bytes, stored_ms: int = -1) -> Kept:
        """As StoreRows.tried (every record committed at once)."""
        row = self.rows.get((vin, request_id))
        if row is None or row.sha1 != digest or row.ts >= self.started:
            return NOTHING_KEPT
        kept = self.tries.get((vin, request_id))
        if kept is None or kept[0] != digest:
            return Kept(0, row.await_response)
        _, attempts, acked_ms, session = kept
        if acked_ms is None or not row.await_response:
            return Kept(attempts, row.await_response)
        return Kept(attempts, True, max(0.0, (self.now_ms() - acked_ms) / 1000), session)

    def sent(self, vin: str, row: Row, attempts: int) -> None:
        current = self.rows.get((vin, row.request_id))
        if current is not None and current.sha1 == row.sha1:
            self.tries[vin, row.request_id] = (row.sha1, attempts, None, None)

    def awaiting(self, vin: str, request_id: str, digest: bytes, attempts: int, session: Session) -> None:
        current = self.rows.get((vin, request_id))
        if current is not None and current.sha1 == digest:
            self.tries[vin, request_id] = (digest, attempts, self.now_ms(), session)

    def restart(self) -> None:
        """The server process ends (kill -9) and starts again: acked ends not committed yet are
        lost; every row stored so far was stored before the start."""
        self.pending_acks = []
        self.started = self.clock + 1

    # -- reads for tests --------------------------------------------------------------------
    def counts(self, request_id: str, payload: bytes) -> dict[str, int]:
        """The generation's counts, without zeros (as `outcomes.generation` keeps them)."""
        digest = sha1(payload)
        counts = {"pending": sum(1 for (_, rid), r in self.rows.items() if (rid, r.sha1) == (request_id, digest))}
        for (_, rid, d), ended in self.outcomes.items():
            if (rid, d) == (request_id, digest):
                counts[ended.outcome.label] = counts.get(ended.outcome.label, 0) + 1
        counts["total"] = sum(counts.values())
        return {k: v for k, v in counts.items() if v}


@dataclass
class RecordingPublisher:
    """Records every publish; `up=False` plays a lost broker connection."""

    sent: list[tuple[str, str, bytes]] = field(default_factory=list)
    up: bool = True

    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        if not self.up:
            return False
        self.sent.append((vin, request_id, payload))
        return True


@dataclass
class ManualClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now
