"""More of the store's operations, the same test bodies on LMDB and PostgreSQL: the plugin format
(data, triggers, parked triggers), expiry and retention, and the reads (generations, a vehicle's
outcomes and queue).

The sides of test_store_parity.py gain one method, `op(name, **kw)`: the LMDB op, read or `Store`
method of that name, or its `storage.postgres` twin, with the same keyword arguments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from storage.errors import EarlyTriggersFull
from storage.lmdb import batches, gc, latency, outcomes, parked, queue
from storage.lmdb.batches import (
    BatchWritten,
    DataWritten,
    Duplicate,
    EarlyCompleted,
    EarlyExpired,
    RowSpec,
    TriggerWritten,
)
from storage.lmdb.batches import sha1_of as sha1
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import now_ms
from storage.postgres import expiry
from storage.postgres import latency as pg_latency
from storage.postgres import outcomes as pg_outcomes
from storage.postgres import parked as pg_parked
from storage.postgres import queue as pg_queue
from tests.unit import test_store_parity as parity

_LMDB_WRITES: dict[str, Callable[..., Any]] = {
    "store_data": parked.store_data,
    "store_trigger": parked.store_trigger,
    "complete_early": parked.complete_early,
    "expire_early": parked.expire_early,
    "expire_due": queue.expire_due,
    "expire_rows": gc.expire_rows,
    "add_latency": latency.add,
}
_LMDB_READS: dict[str, Callable[..., Any]] = {
    "waiting_data_ids": parked.waiting_data_ids,
    "first_deadline": queue.first_deadline,
    "generations": outcomes.generations,
    "generation": outcomes.generation,
    "all_generations": outcomes.all_generations,
    "vehicle_outcomes": outcomes.vehicle_outcomes,
    "latency": latency.of_request,
}
_PG: dict[str, Callable[..., Any]] = {
    "store_data": pg_parked.store_data,
    "store_trigger": pg_parked.store_trigger,
    "complete_early": pg_parked.complete_early,
    "expire_early": pg_parked.expire_early,
    "waiting_data_ids": pg_parked.waiting_data_ids,
    "expire_due": expiry.expire_due,
    "expire_rows": expiry.expire_rows,
    "first_deadline": expiry.first_deadline,
    "generations": pg_outcomes.generations,
    "generation": pg_outcomes.generation,
    "all_generations": pg_outcomes.all_generations,
    "vehicle_outcomes": pg_outcomes.vehicle_outcomes,
    "pending": pg_queue.pending,
    "oldest": pg_queue.oldest,
    "backlog": pg_queue.backlog,
    "add_latency": pg_latency.add,
    "latency": pg_latency.of_request,
}


class LmdbSide(parity.LmdbSide):
    def op(self, name: str, **kw: Any) -> Any:
        if name in _LMDB_WRITES:
            return self._write(_LMDB_WRITES[name], **kw)
        if name in _LMDB_READS:
            with self.store.read() as txn:
                return _LMDB_READS[name](txn, self.store.tables, **kw)
        return getattr(self.store, name)(**kw)  # pending, oldest, backlog


class PgSide(parity.PgSide):
    def op(self, name: str, **kw: Any) -> Any:
        return self._run(_PG[name](self.conn, **kw))


Side = LmdbSide | PgSide


@pytest.fixture
def store(request: pytest.FixtureRequest, each_store: str, tmp_path: Path) -> Iterator[Side]:
    """Each store in turn, empty."""
    side: Side
    if each_store == "lmdb":
        side = LmdbSide(tmp_path / "lmdb")
    else:
        side = PgSide(request.getfixturevalue("pg_dsn"))
        side._run(side.conn.execute(f"TRUNCATE {parity._TABLES}"))
    yield side
    side.close()


def trigger(store: Side, data_id: str, vins: list[str], rid: str, now: int, **kw: Any) -> Any:
    kw.setdefault("early_max", 100)
    spec = RowSpec(kw.pop("expires_ms", 0), kw.pop("flags", 0))
    return store.op("store_trigger", data_id=data_id, vins=vins, request_id=rid, now_ms=now, spec=spec, **kw)


# -- the plugin format ------------------------------------------------------------------------------


def test_a_trigger_for_known_data_writes_its_rows_at_once(store: Side) -> None:
    assert store.op("store_data", data_id="d1", blob=b"fw", now_ms=1_000) == DataWritten("d1", sha1(b"fw"), True)
    written = trigger(store, "d1", ["V2", "V1"], "task_a_1", 1_001, batch_id="b1", correlation_id="c1")
    assert written == TriggerWritten(
        "d1", "task_a_1", BatchWritten("task_a_1", sha1(b"fw"), ("V2", "V1"), 0, False), False
    )
    assert [(r.vin, r.ts_ms, r.size) for r in store.rows()] == [("V1", 1_001, 2), ("V2", 1_001, 2)]
    assert trigger(store, "d1", ["V3"], "task_a_1", 1_002, batch_id="b1") == Duplicate(
        "b1", "task_a_1", sha1(b"fw"), 2, 1_001
    )
    again = store.op("store_data", data_id="d1", blob=b"fw", now_ms=1_003)
    assert again == DataWritten("d1", sha1(b"fw"), False)


def test_parked_triggers_complete_in_arrival_order_in_chunks(store: Side) -> None:
    """Triggers before their data park (expires_at and flags kept); the data completes them
    oldest first up to max_rows (at least one), `complete_early` the rest."""
    assert trigger(store, "d1", ["V1", "V2"], "task_a_1", 1_000, batch_id="b1", correlation_id="c1") == (
        TriggerWritten("d1", "task_a_1", None, True)
    )
    trigger(store, "d1", ["V2"], "task_b_1", 1_001, expires_ms=2**40, flags=1)
    trigger(store, "d1", ["V3", "V4"], "task_a_1", 1_002)
    trigger(store, "d2", ["V1"], "task_c_1", 1_003)
    assert trigger(store, "d1", ["V9"], "task_a_1", 1_004, batch_id="b1") == Duplicate("b1", "task_a_1", None, 0, 1_000)
    assert store.op("waiting_data_ids") == []
    data = store.op("store_data", data_id="d1", blob=b"fw", now_ms=2_000, max_rows=2)
    fw = sha1(b"fw")
    assert data == DataWritten(
        "d1",
        fw,
        True,
        (BatchWritten("task_a_1", fw, ("V1", "V2"), 0, False, batch_id="b1", correlation_id="c1"),),
        True,
    )
    assert store.op("waiting_data_ids") == ["d1"]
    assert trigger(store, "d1", ["V9"], "task_a_1", 2_001, batch_id="b1") == Duplicate("b1", "task_a_1", fw, 2, 1_000)
    rest = store.op("complete_early", data_id="d1", now_ms=2_002, max_rows=1)
    assert rest == EarlyCompleted((BatchWritten("task_b_1", fw, ("V2",), 0, False),), True)
    rest = store.op("complete_early", data_id="d1", now_ms=2_003, max_rows=1)  # one trigger even past max_rows
    assert rest == EarlyCompleted((BatchWritten("task_a_1", fw, ("V3", "V4"), 0, False),), False)
    assert store.op("complete_early", data_id="d1", now_ms=2_004, max_rows=1) == EarlyCompleted((), False)
    assert store.op("complete_early", data_id="d2", now_ms=2_004, max_rows=1) == EarlyCompleted((), False)
    assert store.op("waiting_data_ids") == []
    assert [(r.vin, r.request_id, r.ts_ms, r.expires_ms, r.flags) for r in store.rows()] == [
        ("V1", "task_a_1", 2_000, 0, 0),
        ("V2", "task_a_1", 2_000, 0, 0),
        ("V2", "task_b_1", 2_002, 2**40, 1),
        ("V3", "task_a_1", 2_003, 0, 0),
        ("V4", "task_a_1", 2_003, 0, 0),
    ]
    parity.assert_recount(store)


def test_a_parked_trigger_whose_data_comes_after_its_expires_at_is_dropped(store: Side) -> None:
    """Dropped as `expired`, its batch_id forgotten (a retry is a new trigger); the others complete."""
    trigger(store, "d1", ["V1", "V2"], "task_a_1", 1_000, batch_id="b1", correlation_id="c1", expires_ms=1_500)
    trigger(store, "d1", ["V3"], "task_a_1", 1_001, expires_ms=2_001)
    data = store.op("store_data", data_id="d1", blob=b"fw", now_ms=2_000)
    assert data.expired == (EarlyExpired("d1", "task_a_1", 2, 1_000, "b1", "c1", "expired"),)
    assert [b.vins for b in data.completed] == [("V3",)]
    assert [r.vin for r in store.rows()] == ["V3"]
    retried = trigger(store, "d1", ["V1"], "task_a_1", 2_002, batch_id="b1")
    assert retried == TriggerWritten("d1", "task_a_1", BatchWritten("task_a_1", sha1(b"fw"), ("V1",), 0, False), False)


def test_the_parking_bounds_refuse_a_trigger_and_write_nothing(store: Side) -> None:
    """early_max triggers, or early_max_rows rows, waiting: the next trigger raises and its
    batch_id stays free; a trigger for known data is never refused."""
    trigger(store, "d1", ["V1", "V2"], "task_a_1", 1_000, early_max=2, early_max_rows=3)
    with pytest.raises(EarlyTriggersFull):
        trigger(store, "d2", ["V1", "V2"], "task_b_1", 1_001, early_max=2, early_max_rows=3, batch_id="b1")
    trigger(store, "d2", ["V3"], "task_b_1", 1_002, early_max=2, early_max_rows=3)
    with pytest.raises(EarlyTriggersFull):
        trigger(store, "d3", ["V4"], "task_c_1", 1_003, early_max=2, batch_id="b1")
    assert trigger(store, "d3", ["V4"], "task_c_1", 1_004, batch_id="b1").early
    store.op("store_data", data_id="d4", blob=b"x", now_ms=1_005)
    assert not trigger(store, "d4", ["V5"], "task_d_1", 1_006, early_max=0, early_max_rows=0).early
    assert [r.vin for r in store.rows()] == ["V5"]


def test_the_sweep_drops_triggers_whose_data_never_came(store: Side) -> None:
    """Up to `limit` triggers at least ttl old, in (data_id, arrival) order; batch ids forgotten."""
    trigger(store, "d2", ["V1"], "task_a_1", 1_000, batch_id="b1", correlation_id="c1")
    trigger(store, "d1", ["V1", "V2"], "task_b_1", 1_001)
    trigger(store, "d1", ["V3"], "task_b_1", 1_500)
    trigger(store, "d10", ["V3"], "task_b_1", 1_002)
    gone = store.op("expire_early", now_ms=2_002, ttl_ms=1_000, limit=2)
    assert gone == [EarlyExpired("d1", "task_b_1", 2, 1_001), EarlyExpired("d10", "task_b_1", 1, 1_000)]
    gone = store.op("expire_early", now_ms=2_002, ttl_ms=1_000, limit=10)
    assert gone == [EarlyExpired("d2", "task_a_1", 1, 1_002, "b1", "c1")]
    assert trigger(store, "d2", ["V1"], "task_a_1", 2_001, batch_id="b1").early  # not a duplicate
    store.op("store_data", data_id="d1", blob=b"fw", now_ms=2_002)
    assert [(r.vin, r.request_id) for r in store.rows()] == [("V3", "task_b_1")]


# -- expiry and retention ---------------------------------------------------------------------------


def test_the_expiry_sweep_ends_rows_past_expires_at_soonest_first(store: Side) -> None:
    assert store.op("first_deadline") is None
    store.batch(["V2", "V1"], "task_a_1", b"a", 1_000, expires_ms=3_000)
    store.batch(["V1"], "task_b_1", b"b", 1_001, expires_ms=2_000)
    store.batch(["V3"], "task_c_1", b"c", 1_002, expires_ms=9_000)
    store.batch(["V4"], "task_d_1", b"d", 1_003)
    assert store.op("first_deadline") == 2_000
    assert store.op("expire_due", now_ms=1_999, limit=10) == []
    assert store.op("expire_due", now_ms=5_000, limit=2) == [
        ("V1", "task_b_1", sha1(b"b")),
        ("V1", "task_a_1", sha1(b"a")),
    ]
    assert store.op("first_deadline") == 3_000
    assert store.op("expire_due", now_ms=5_000, limit=10) == [("V2", "task_a_1", sha1(b"a"))]
    assert store.op("first_deadline") == 9_000
    assert parity.counts_of(store, "task_a_1", b"a") == {"total": 2, "expired": 2}
    assert ("V1", "task_b_1", sha1(b"b"), 5_000, 1_001, 0, Outcome.EXPIRED, b"") in store.records()
    assert [r.vin for r in store.rows()] == ["V3", "V4"]
    parity.assert_recount(store)


def test_retention_ends_rows_stored_before_the_cutoff(store: Side) -> None:
    store.batch(["V1", "V2"], "task_a_1", b"a", 1_000)
    store.batch(["V1"], "task_b_1", b"b", 2_000)
    store.batch(["V3"], "task_c_1", b"c", 3_000)
    store.batch(["V2"], "task_a_1", b"a", 2_500)  # restamped: kept past the 2 500 cutoff
    assert store.op("expire_rows", cutoff_ms=2_500, limit=1) == 1
    assert store.op("expire_rows", cutoff_ms=2_500, limit=10) == 1
    assert store.op("expire_rows", cutoff_ms=2_500, limit=10) == 0
    assert [(r.vin, r.request_id) for r in store.rows()] == [("V2", "task_a_1"), ("V3", "task_c_1")]
    assert parity.counts_of(store, "task_a_1", b"a") == {"total": 2, "pending": 1, "expired": 1}
    assert parity.counts_of(store, "task_b_1", b"b") == {"total": 1, "expired": 1}
    parity.assert_recount(store)


# -- reads --------------------------------------------------------------------------------------------


def test_generations_newest_first(store: Side) -> None:
    """A request's generations by first change; every generation by last change, ties (a
    supersede changes two at once) in (request id, sha1) order."""
    store.batch(["V1", "V2"], "task_a_1", b"x", 1_000)
    store.batch(["V1"], "task_b_1", b"x", 1_500)
    store.batch(["V1"], "task_a_1", b"y", 2_000)
    gens = store.op("generations", request_id="task_a_1")
    assert [(g.sha1, g.first_ms, g.last_ms, g.pending) for g in gens] == [
        (sha1(b"y"), 2_000, 2_000, 1),
        (sha1(b"x"), 1_000, 2_000, 1),
    ]
    assert store.op("generation", request_id="task_a_1", sha1=sha1(b"x")) == gens[1]
    assert store.op("generation", request_id="task_a_1", sha1=sha1(b"z")) is None
    assert store.op("generations", request_id="task_a") == []
    every = [(g.request_id, g.sha1) for g in store.op("all_generations")]
    assert every == [*(("task_a_1", s) for s in sorted([sha1(b"x"), sha1(b"y")])), ("task_b_1", sha1(b"x"))]


def test_a_vehicles_outcomes_newest_first_with_answers(store: Side) -> None:
    store.batch(["V1", "V2"], "task_a_1", b"a", 1_000)
    store.batch(["V1"], "task_b_1", b"b", 1_000)
    store.batch(["V1"], "task_c_1", b"c", 1_000)
    store.end("V1", "task_b_1", b"b", 2_000, Outcome.RESPONDED, attempts=2, response=b'{"ok":1}')
    store.end("V1", "task_a_1", b"a", 2_000, Outcome.DELIVERED, attempts=1)
    store.end("V1", "task_c_1", b"c", 1_500, Outcome.FAILED, attempts=9)
    store.end("V2", "task_a_1", b"a", 3_000)
    found = store.op("vehicle_outcomes", vin="V1", limit=2)
    assert found == [
        outcomes.OutcomeRecord("V1", "task_a_1", sha1(b"a"), Outcome.DELIVERED, 2_000, 1_000, 1),
        outcomes.OutcomeRecord("V1", "task_b_1", sha1(b"b"), Outcome.RESPONDED, 2_000, 1_000, 2, b'{"ok":1}'),
    ]
    assert [o.outcome for o in store.op("vehicle_outcomes", vin="V1")] == [*(o.outcome for o in found), Outcome.FAILED]
    assert store.op("vehicle_outcomes", vin="V3") == []


def test_a_vehicles_queue_and_its_next_deliverable_row(store: Side) -> None:
    """Delivery order is store time, then request id. The next row skips rows past their
    expires_at, rows a cancel of every vehicle in progress took by its cut, and hidden ones; the
    backlog and the queue count them all."""
    assert store.op("oldest", vin="V1") == (None, 0)
    past = now_ms() - 60_000
    store.batch(["V1"], "task_b_1", b"b", 1_000)
    store.batch(["V1"], "task_a_1", b"a", 1_000, expires_ms=past)
    store.batch(["V0", "V1"], "task_c_1", b"c", 900)
    store.batch(["V1"], "task_d_1", b"d", 1_100, expires_ms=2**50, flags=1)
    store.batch(["V1"], "task_e_1", b"e", 1_200)
    assert store.cancel_all("task_c_1", 1_050, max_rows=1).more  # V0's row taken, V1's hidden by the cut
    assert [r.request_id for r in store.op("pending", vin="V1")] == [
        "task_c_1",
        "task_a_1",
        "task_b_1",
        "task_d_1",
        "task_e_1",
    ]
    assert store.op("backlog", vin="V1") == 5
    assert store.op("backlog", vin="V0") == 0
    row, payload = store.op("oldest", vin="V1")[0]
    assert (row.request_id, row.ts_ms, row.sha1, row.size, payload) == ("task_b_1", 1_000, sha1(b"b"), 1, b"b")
    assert store.op("oldest", vin="V1")[1] == 3
    (row, payload), count = store.op("oldest", vin="V1", hidden={"task_b_1": sha1(b"b")})
    assert (row, payload, count) == (store.op("pending", vin="V1")[3], b"d", 2)
    assert row.await_response
    (row, _), count = store.op("oldest", vin="V1", hidden={"task_b_1": sha1(b"other")})
    assert (row.request_id, count) == ("task_b_1", 3)


# -- PostgreSQL alone: triggers racing their data ---------------------------------------------------


def test_no_trigger_stays_parked_when_its_data_races_it_on_postgresql(pg_dsn: str) -> None:
    """Four connections send triggers of one data_id while a fifth stores the data: each trigger
    either wrote its rows or was parked and completed by the data; none is left waiting."""
    side = PgSide(pg_dsn)
    side._run(side.conn.execute(f"TRUNCATE {parity._TABLES}"))

    # The data goes once a trigger has parked, and each connection's last trigger waits for the
    # data: some triggers come before it and some after, however the machine schedules them; the
    # others race it.
    one_parked, data_stored = asyncio.Event(), asyncio.Event()

    async def triggers(conn: asyncpg.Connection, n: int) -> list[bool]:
        parked = []
        for i in range(15):
            if i == 14:
                await data_stored.wait()
            done = await pg_parked.store_trigger(conn, "d1", [f"V{n}_{i}"], f"task_{n}_{i}", 1_000 + i, early_max=1_000)
            assert isinstance(done, TriggerWritten)
            parked.append(done.early)
            if done.early:
                one_parked.set()
        return parked

    async def data(conn: asyncpg.Connection) -> batches.DataWritten:
        await one_parked.wait()
        try:
            return await pg_parked.store_data(conn, "d1", b"fw", 1_005)
        finally:
            data_stored.set()

    async def go() -> list[Any]:
        conns = [await asyncpg.connect(pg_dsn, timeout=10) for _ in range(5)]
        try:
            return list(await asyncio.gather(data(conns[4]), *(triggers(c, n) for n, c in enumerate(conns[:4]))))
        finally:
            for c in conns:
                await c.close()

    try:
        stored, *parked = side._run(go())
        assert {p for each in parked for p in each} == {True, False}  # some before the data, some after
        assert sum(map(len, (b.vins for b in stored.completed))) == sum(map(sum, parked))
        assert side.op("waiting_data_ids") == []
        assert side._run(side.conn.fetchval("SELECT count(*) FROM early_triggers")) == 0
        assert len(side.rows()) == 60
        parity.assert_recount(side)
    finally:
        side.close()
