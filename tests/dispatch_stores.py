"""The store and dispatcher a fleet simulation drives (test_dispatch_simulation.py), one adapter each.

`MemoryStore`: LMDB mode's `pool.Dispatcher` over `MemoryRows`, whose view is the rows themselves.
`PgStore`: `SharedDispatcher` on a throwaway database, writes through storage/pg; rows end inside the
dispatcher's transactions, so the view is read back from the tables once it is idle. The worker's
`ack` calls are recorded where it makes them, at its RowSource (as `MemoryRows` records them).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg
import pytest

from exhook_server.backends.lmdb.pool import Dispatcher
from exhook_server.backends.postgres import dispatch as shared
from exhook_server.backends.postgres.dispatch import SharedDispatcher
from exhook_server.dispatch.pacing import Pacer
from exhook_server.dispatch.port import Dispatch
from exhook_server.dispatch.worker import Publisher
from storage.errors import RequestAborted
from storage.lmdb.batches import BatchWritten, RowSpec
from storage.lmdb.keys import FLAG_AWAIT_RESPONSE, FLAG_HIGH_PRIORITY
from storage.lmdb.outcomes import Outcome
from storage.model import COUNT_NAMES, CancelChunk, Generation
from storage.postgres import batches, expiry, migrate, policies
from storage.postgres import reads as pg_reads
from storage.postgres.errors import as_storage_error
from tests.dispatch_fakes import AckCall, ByRequest, CancelJob, Ended, MemoryRows, Pair, Pending

#: Workers (memory) or lanes (PostgreSQL): vehicles' events run on several at once.
WORKERS = 4
#: Never reached: deliveries end by PUBACK, answer, response timeout, cancel or a lost link.
INFLIGHT_TIMEOUT_S = 1e9
#: How long a PostgreSQL dispatcher may take to handle one step's events (a few hundred at most).
SETTLE_TIMEOUT_S = 30.0
#: How often a PostgreSQL dispatcher is asked whether it is idle.
POLL_S = 0.0005
#: Rows one expiry sweep transaction ends: more than the simulation ever has.
EXPIRE_LIMIT = 100_000
#: A chunk: (VIN, sha1) of each row a cancel ended.
Chunk = list[tuple[str, bytes]]
#: Counts amendments in the test's database: a cancelled pair's outcome becoming what its delivery
#: did (by whichever statement the dispatcher ends rows with).
_COUNT_AMENDED = f"""
CREATE TABLE sim_amended (vin text, request_id text, sha1 bytea, code smallint);
CREATE FUNCTION sim_amended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.code = {int(Outcome.CANCELLED)} AND NEW.code <> {int(Outcome.CANCELLED)} THEN
        INSERT INTO sim_amended VALUES (NEW.vin, NEW.request_id, NEW.sha1, NEW.code);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER sim_amended AFTER UPDATE ON outcomes FOR EACH ROW EXECUTE FUNCTION sim_amended();
"""


class SimStore(Protocol):
    """What the simulation asks of a store and the dispatcher built on it."""

    #: The view is the store itself, current at every moment (memory), or a copy `refresh` reads
    #: back once the dispatcher is idle (PostgreSQL): publishes are checked at once or then.
    live: bool
    #: The rows, cancels in progress, outcomes, pairs taken and amendments, as `MemoryRows` keeps them.
    view: MemoryRows
    #: PostgreSQL's pool, through which the campaigns' buckets are leased (None: memory).
    pool: Any

    @property
    def dispatcher(self) -> Dispatch: ...

    @property
    def acks(self) -> list[AckCall]:
        """Every `ack` call of the dispatcher's workers, in order."""
        ...

    def quantum(self, t: float) -> float:
        """Clock time `t` as the dispatcher can keep it."""
        ...

    # -- what the platform and housekeeping write -------------------------------------------
    async def batch(
        self,
        vins: list[str],
        request_id: str,
        payload: bytes,
        *,
        expires_ms: int,
        await_response: bool,
        high_priority: bool = False,
    ) -> Chunk:
        """Store the rows; the rows of `request_id` they replaced that a cancel in progress had
        taken already (its walk had not come this far): those end cancelled, not superseded."""
        ...

    async def cancel_vins(self, request_id: str, vins: list[str]) -> Chunk: ...

    async def set_policy(self, request_id: str, doc: bytes) -> None:
        """Store `doc` as the request's campaign policy (re-opening it if it was aborted)."""

    async def outcome_counts(self, request_id: str) -> tuple[list[Generation], int]:
        """`Reads.outcome_counts` over this store."""
        ...

    async def abort(self, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> CancelChunk | None:
        """`Writes.abort` over this store: the abort and its cancel's first chunk, once per policy."""
        ...

    async def start_cancel_all(self, request_id: str, max_rows: int) -> Chunk: ...

    async def cancel_chunk(self, request_id: str, max_rows: int) -> Chunk: ...

    async def cancels_in_progress(self) -> list[str]: ...

    async def expire_due(self) -> list[Pair]: ...

    async def has_rows(self) -> bool: ...

    # -- acked rows whose end a group commit takes later (LMDB only) ---------------------------
    def pending_acks(self) -> bool: ...

    def commit_acks(self) -> None: ...

    def acking(self, vin: str, request_id: str, digest: bytes) -> bool: ...

    # -- the dispatcher's pace ---------------------------------------------------------------------
    async def settle(self) -> None:
        """Return once the dispatcher has handled every event it was given."""
        ...

    async def refresh(self, vins: Iterable[str]) -> None:
        """Read these vehicles' rows and the cancels in progress into `view`."""
        ...

    async def finish(self) -> None:
        """Stop the dispatcher; `view` then holds the whole final store."""
        ...

    async def close(self) -> None:
        """Stop the dispatcher and let go of the store (after `finish`, or a failure)."""
        ...


@dataclass(frozen=True)
class Wiring:
    """What the simulation hands the dispatcher built on a store."""

    publisher: Publisher
    #: The fleet's clock, in seconds.
    clock: Callable[[], float]
    #: Our broker link is up.
    connected: Callable[[], bool]
    vin_from_clientid: Callable[[str], bool] | None
    response_timeout_s: float
    #: Acked rows end with a later commit, as LMDB's group committer makes them (memory only).
    defer_acks: bool
    #: Request ids their campaign policy holds now (exhook_server/dispatch/gates.py).
    held: Callable[[], frozenset[str]] | None = None
    #: Request ids whose campaign policy says priority high now.
    high: Callable[[], frozenset[str]] | None = None
    #: Campaign pacing (exhook_server/dispatch/pacing.py).
    pacing: Pacer | None = None


#: Builds a store and its dispatcher.
OpenStore = Callable[[Wiring], Awaitable[SimStore]]


class MemoryStore:
    """`pool.Dispatcher` (LMDB mode) over `MemoryRows`."""

    live = True
    pool = None

    def __init__(self, w: Wiring) -> None:
        self.view = MemoryRows(now_ms=lambda: int(w.clock() * 1000))
        self.view.defer_acks = w.defer_acks
        d = Dispatcher(
            self.view,
            w.publisher,
            workers=WORKERS,
            inflight_timeout_s=INFLIGHT_TIMEOUT_S,
            vin_from_clientid=w.vin_from_clientid,
            response_timeout_s=w.response_timeout_s,
            held=w.held,
            high=w.high,
            pacing=w.pacing,
        )
        for worker in d.workers.values():
            worker._clock = w.clock  # the pool takes no clock; its workers do
        d.start()
        self.dispatcher: Dispatch = d

    @property
    def acks(self) -> list[AckCall]:
        return self.view.acks

    def quantum(self, t: float) -> float:
        return t

    async def batch(
        self,
        vins: list[str],
        request_id: str,
        payload: bytes,
        *,
        expires_ms: int,
        await_response: bool,
        high_priority: bool = False,
    ) -> Chunk:
        if request_id in self.view.aborted:
            raise RequestAborted(request_id)
        for vin in vins:
            self.view.add(
                vin,
                request_id,
                payload,
                expires_ms=expires_ms,
                await_response=await_response,
                high_priority=high_priority,
            )
        return []  # MemoryRows ends every replaced row superseded, behind a cancel's cut or not

    async def cancel_vins(self, request_id: str, vins: list[str]) -> Chunk:
        return self.view.cancel_vins(request_id, vins)

    async def set_policy(self, request_id: str, doc: bytes) -> None:
        self.view.aborted.discard(request_id)

    async def outcome_counts(self, request_id: str) -> tuple[list[Generation], int]:
        counts: dict[bytes, dict[str, int]] = {}
        rows, outcomes = self.view.rows, self.view.outcomes
        assert isinstance(rows, ByRequest) and isinstance(outcomes, ByRequest)
        ended = [(row.sha1, "pending") for _, row in rows.of(request_id)]
        ended += [(digest, e.outcome.label) for (_, _, digest), e in outcomes.of(request_id)]
        for digest, name in ended:
            if digest not in counts:
                counts[digest] = dict.fromkeys(COUNT_NAMES, 0)
            counts[digest][name] += 1
        for c in counts.values():
            c["total"] = sum(c.values())
        return [Generation(request_id, digest, 0, 0, c) for digest, c in counts.items()], 0

    async def abort(self, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> CancelChunk | None:
        if request_id in self.view.aborted:
            return None
        self.view.aborted.add(request_id)
        done, more = self.view.start_cancel_all(request_id, max_rows)
        return CancelChunk(request_id, tuple(done), len(done), more, None, "aborted")

    async def start_cancel_all(self, request_id: str, max_rows: int) -> Chunk:
        return self.view.start_cancel_all(request_id, max_rows)[0]

    async def cancel_chunk(self, request_id: str, max_rows: int) -> Chunk:
        return self.view.cancel_chunk(request_id, max_rows)[0]

    async def cancels_in_progress(self) -> list[str]:
        return list(self.view.cancels)

    async def expire_due(self) -> list[Pair]:
        return self.view.expire_due()

    async def has_rows(self) -> bool:
        return bool(self.view.rows)

    def pending_acks(self) -> bool:
        return bool(self.view.pending_acks)

    def commit_acks(self) -> None:
        self.view.commit_acks()

    def acking(self, vin: str, request_id: str, digest: bytes) -> bool:
        return self.view.acking(vin, request_id, digest)

    async def settle(self) -> None:
        """Let the workers run until every queue is empty (single-threaded, deterministic)."""
        for _ in range(10_000):
            await asyncio.sleep(0)
            if self.dispatcher.backlog() == 0:
                await asyncio.sleep(0)
                if self.dispatcher.backlog() == 0:
                    return
        raise AssertionError("dispatch did not settle")

    async def refresh(self, vins: Iterable[str]) -> None:
        pass  # the view is the store

    async def finish(self) -> None:
        await self.dispatcher.stop()

    async def close(self) -> None:
        await self.dispatcher.stop()


async def open_memory(w: Wiring) -> SimStore:
    """A `MemoryStore` (our broker link is the publisher's to refuse: `connected` is not needed)."""
    return MemoryStore(w)


class _CountingPool:
    """The dispatcher's pool, counting the connections it has out. An event's follow-ups are
    queued right after its connection comes back (a heartbeat filter's answer, for one), so the
    dispatcher is idle only when none is out and nothing is queued."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self.out = 0

    def acquire(self) -> _Acquired:
        return _Acquired(self, self._pool.acquire())


class _Acquired:
    """One `async with pool.acquire()` of the dispatcher, counted while the connection is out."""

    def __init__(self, owner: _CountingPool, inner: Any) -> None:
        self._owner = owner
        self._inner = inner

    async def __aenter__(self) -> Any:
        self._owner.out += 1
        try:
            return await self._inner.__aenter__()
        except BaseException:
            self._owner.out -= 1
            raise

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self._inner.__aexit__(*exc)
        finally:
            # Last, with no await after it: the caller goes on (queues follow-ups) before the loop
            # can run a check of idleness.
            self._owner.out -= 1


class PgStore:
    """`SharedDispatcher` (PostgreSQL mode) on a migrated throwaway database."""

    live = False

    def __init__(self, conn: Any, pool: Any, counting: _CountingPool, clock: Callable[[], float]) -> None:
        self._conn = conn
        self.pool = pool
        self._counting = counting
        self._clock = clock
        self.view = MemoryRows(now_ms=self._now_ms)
        self._acks: list[AckCall] = []
        #: The last store write's time: every write is stamped later than the one before, so rows
        #: queue in the order they were stored and a cancel's cut takes every row stored before it
        #: (the simulation stores many batches within one millisecond of its clock).
        self._written_ms = 0
        self.dispatcher: SharedDispatcher

    @property
    def acks(self) -> list[AckCall]:
        return self._acks

    def quantum(self, t: float) -> float:
        """Whole milliseconds: the dispatcher stores times in ms, and a delivery's response timeout
        must fall on the same side for the dispatcher as for the fleet model."""
        return round(t * 1000) / 1000

    def _now_ms(self) -> int:
        return round(self._clock() * 1000)

    def _write_ms(self) -> int:
        self._written_ms = max(self._written_ms + 1, self._now_ms())
        return self._written_ms

    def _recording(self, real: Callable[..., bool]) -> Callable[..., bool]:
        """The dispatcher's per-event RowSource `ack` (`shared._EventRows`), recorded: the worker's
        call, which the event's transaction then carries out."""
        signature = inspect.signature(real)

        def ack(*args: Any, **kwargs: Any) -> bool:
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            a = call.arguments
            done = real(*args, **kwargs)
            self._acks.append(
                AckCall(a["vin"], a["request_id"], a["sha1"], a["outcome"], a["attempts"], a["response"], done)
            )
            return done

        return ack

    async def batch(
        self,
        vins: list[str],
        request_id: str,
        payload: bytes,
        *,
        expires_ms: int,
        await_response: bool,
        high_priority: bool = False,
    ) -> Chunk:
        flags = (FLAG_AWAIT_RESPONSE if await_response else 0) | (FLAG_HIGH_PRIORITY if high_priority else 0)
        spec = RowSpec(expires_ms=expires_ms, flags=flags)
        now_ms = self._write_ms()
        written = await as_storage_error(batches.store_batch(self._conn, vins, request_id, payload, now_ms, spec=spec))
        assert isinstance(written, BatchWritten)
        self.view.taken.update((vin, request_id, written.sha1) for vin in written.vins)
        # As ops.put_rows: a replaced row a cancel in progress had taken ends cancelled (stamped
        # with this write's time, which no other write shares).
        taken = await self._conn.fetch(
            """SELECT vin, sha1 FROM outcomes
               WHERE request_id = $1 AND vin = ANY($2::text[]) AND code = $3 AND ended_ms = $4 ORDER BY vin""",
            request_id,
            list(written.vins),
            int(Outcome.CANCELLED),
            now_ms,
        )
        return [(r["vin"], bytes(r["sha1"])) for r in taken]

    async def cancel_vins(self, request_id: str, vins: list[str]) -> Chunk:
        return list((await batches.cancel_vins(self._conn, request_id, vins, self._write_ms())).cancelled)

    async def set_policy(self, request_id: str, doc: bytes) -> None:
        await policies.set_policy(self._conn, request_id, doc, self._write_ms(), 1000)

    async def outcome_counts(self, request_id: str) -> tuple[list[Generation], int]:
        return await pg_reads.outcome_counts(self._conn, request_id)

    async def abort(self, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> CancelChunk | None:
        return await batches.abort(self._conn, request_id, doc, self._write_ms(), max_rows)

    async def start_cancel_all(self, request_id: str, max_rows: int) -> Chunk:
        chunk = await batches.start_cancel_all(self._conn, request_id, self._write_ms(), max_rows)
        return list(chunk.cancelled)

    async def cancel_chunk(self, request_id: str, max_rows: int) -> Chunk:
        return list((await batches.cancel_chunk(self._conn, request_id, self._write_ms(), max_rows)).cancelled)

    async def cancels_in_progress(self) -> list[str]:
        return [r["request_id"] for r in await self._conn.fetch("SELECT request_id FROM cancels ORDER BY request_id")]

    async def expire_due(self) -> list[Pair]:
        return await expiry.expire_due(self._conn, self._now_ms(), EXPIRE_LIMIT)

    async def has_rows(self) -> bool:
        return bool(await self._conn.fetchval("SELECT EXISTS (SELECT 1 FROM rows)"))

    # An ack ends its row in the event's own transaction: there is never an acked row whose end
    # waits for a later commit, as LMDB's group committer makes (`MemoryRows.defer_acks`).
    def pending_acks(self) -> bool:
        return False

    def commit_acks(self) -> None:
        pass

    def acking(self, vin: str, request_id: str, digest: bytes) -> bool:
        return False

    def _idle(self) -> bool:
        d = self.dispatcher
        return d.backlog() == 0 and not d._background and self._counting.out == 0

    async def settle(self) -> None:
        """Poll until every event, filter and background task has finished (events run on their
        lanes as the database answers)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not self._idle():
            if time.monotonic() > deadline:
                raise AssertionError(f"dispatch did not settle within {SETTLE_TIMEOUT_S} s")
            await asyncio.sleep(POLL_S)

    async def refresh(self, vins: Iterable[str]) -> None:
        found = await self._conn.fetch(
            """SELECT r.vin, r.request_id, r.ts_ms, r.expires_ms, r.flags, b.data
               FROM rows r JOIN blobs b ON b.sha1 = r.sha1 WHERE r.vin = ANY($1::text[])""",
            list(vins),
        )
        self.view.rows = {
            (r["vin"], r["request_id"]): Pending(r["ts_ms"], bytes(r["data"]), r["expires_ms"], r["flags"])
            for r in found
        }
        self.view.cancels = {
            r["request_id"]: CancelJob(r["cut_ms"], r["after_vin"], r["done"])
            for r in await self._conn.fetch("SELECT request_id, cut_ms, after_vin, done FROM cancels")
        }

    async def finish(self) -> None:
        await self.dispatcher.stop()
        await self.refresh([v for (v,) in await self._conn.fetch("SELECT DISTINCT vin FROM rows")])
        self.view.amended = await self._conn.fetchval("SELECT count(*) FROM sim_amended")
        self.view.outcomes = {
            (r["vin"], r["request_id"], bytes(r["sha1"])): Ended(
                Outcome(r["code"]), r["attempts"], bytes(r["response"])
            )
            for r in await self._conn.fetch("SELECT vin, request_id, sha1, code, attempts, response FROM outcomes")
        }

    async def close(self) -> None:
        try:
            await self.dispatcher.stop()
        finally:
            await self.pool.close()
            await self._conn.close()


def open_postgresql(dsn: str, monkeypatch: pytest.MonkeyPatch) -> OpenStore:
    """Opens a `PgStore` on `dsn` (an empty database): migrates it, starts a SharedDispatcher."""

    async def open_store(w: Wiring) -> SimStore:
        conn = await asyncpg.connect(dsn)
        await migrate.migrate(conn)
        await conn.execute(_COUNT_AMENDED)
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=WORKERS + 2)
        counting = _CountingPool(pool)
        store = PgStore(conn, pool, counting, w.clock)
        # Each event's worker asks its RowSource to end rows; the event's transaction ends them.
        # The tables show only the ends that did something; the check wants every call.
        monkeypatch.setattr(shared._EventRows, "ack", store._recording(shared._EventRows.ack))
        store.dispatcher = SharedDispatcher(
            counting,
            w.publisher,
            lanes=WORKERS,
            inflight_timeout_s=INFLIGHT_TIMEOUT_S,
            sender=lambda: "sdv-fanout-sim",
            connected=w.connected,
            vin_from_clientid=w.vin_from_clientid,
            response_timeout_s=w.response_timeout_s,
            heartbeat_window_s=0.0,
            clock=w.clock,
            held=w.held,
            high=w.high,
            pacing=w.pacing,
        )
        store.dispatcher.start()
        return store

    return open_store
