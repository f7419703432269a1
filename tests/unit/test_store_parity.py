"""The PostgreSQL write operations give the LMDB ones' results: the same test bodies on both stores.

LMDB runs `storage.lmdb.batches` / `storage.lmdb.cancel` in a write transaction; PostgreSQL runs
`storage.postgres.batches` on the session's throwaway cluster (one migrated database for this
module, emptied before each test). Both expose the same small facade, so every test below runs
unchanged against each, and one test runs random work on both side by side and compares every
answer and the final contents.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import asyncpg
import pytest

from storage.lmdb import batches, cancel, keys, outcomes
from storage.lmdb.batches import BatchWritten, Duplicate, RowSpec, sha1_of
from storage.lmdb.cancel import CancelChunk
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import Store
from storage.postgres import batches as pg_batches
from storage.postgres import outcomes as pg_outcomes

T = TypeVar("T")
#: A stored pair's outcome record: (vin, request_id, sha1, ended ms, stored ms, attempts, code, response).
Record = tuple[str, str, bytes, int, int, int, int, bytes]
_TABLES = (
    "blobs, rows, aliases, early_triggers, generations, gen_deltas, outcomes, batches, cancels, vin_state, presence,"
    " gen_latency"
)


class Side(Protocol):
    """What the tests ask of a store: the write operations, and its whole contents."""

    def batch(
        self, vins: list[str], rid: str, blob: bytes, now: int, batch_id: str | None = None, **spec: Any
    ) -> Any: ...
    def end(
        self, vin: str, rid: str, blob: bytes, now: int, outcome: Outcome = ..., attempts: int = 0,
        response: bytes = b"",
    ) -> bool: ...  # fmt: skip
    def cancel_vins(self, rid: str, vins: list[str], now: int) -> CancelChunk: ...
    def cancel_all(self, rid: str, now: int, max_rows: int) -> CancelChunk: ...
    def cancel_chunk(self, rid: str, now: int, max_rows: int) -> CancelChunk: ...
    def rows(self) -> list[keys.Row]: ...
    def records(self) -> set[Record]: ...
    def generations(self) -> dict[tuple[str, bytes], tuple[int, int, dict[str, int]]]: ...
    def recount(self) -> dict[tuple[str, bytes], dict[str, int]]: ...


class LmdbSide:
    def __init__(self, path: Path) -> None:
        self.store = Store(path)

    def _write(self, op: Any, **kw: Any) -> Any:
        with self.store.write() as txn:
            return op(txn, self.store.tables, **kw)

    def batch(self, vins: list[str], rid: str, blob: bytes, now: int, batch_id: str | None = None, **spec: Any) -> Any:
        return self._write(
            batches.store_batch,
            vins=vins,
            request_id=rid,
            blob=blob,
            now_ms=now,
            batch_id=batch_id,
            spec=RowSpec(**spec),
        )

    def end(
        self, vin: str, rid: str, blob: bytes, now: int, outcome: Outcome = Outcome.DELIVERED, attempts: int = 0,
        response: bytes = b"",
    ) -> bool:  # fmt: skip
        return bool(
            self._write(
                batches.delete_row_if,
                vin=vin,
                request_id=rid,
                sha1=sha1_of(blob),
                now_ms=now,
                outcome=outcome,
                attempts=attempts,
                response=response,
            )
        )

    def cancel_vins(self, rid: str, vins: list[str], now: int) -> CancelChunk:
        return self._write(cancel.cancel_vins, request_id=rid, vins=vins, now_ms=now)  # type: ignore[no-any-return]

    def cancel_all(self, rid: str, now: int, max_rows: int) -> CancelChunk:
        return self._write(cancel.start_cancel_all, request_id=rid, now_ms=now, max_rows=max_rows)  # type: ignore[no-any-return]

    def cancel_chunk(self, rid: str, now: int, max_rows: int) -> CancelChunk:
        return self._write(cancel.cancel_chunk, request_id=rid, now_ms=now, max_rows=max_rows)  # type: ignore[no-any-return]

    def rows(self) -> list[keys.Row]:
        with self.store.read() as txn:
            return sorted(keys.decode_row(k, v) for k, v in txn.cursor(self.store.tables.ids))

    def records(self) -> set[Record]:
        with self.store.read() as txn:
            return {
                (*keys.split_outcome_key(k), *keys.decode_outcome(v), keys.outcome_response(v))
                for k, v in txn.cursor(self.store.tables.outcomes)
            }

    def generations(self) -> dict[tuple[str, bytes], tuple[int, int, dict[str, int]]]:
        with self.store.read() as txn:
            gens = outcomes.all_generations(txn, self.store.tables)
        return {(g.request_id, g.sha1): (g.first_ms, g.last_ms, g.counts) for g in gens}

    def recount(self) -> dict[tuple[str, bytes], dict[str, int]]:
        with self.store.read() as txn:
            return outcomes.recount(txn, self.store.tables)

    def close(self) -> None:
        self.store.close()


class PgSide:
    def __init__(self, dsn: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.conn = self._run(asyncpg.connect(dsn, timeout=10))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def batch(self, vins: list[str], rid: str, blob: bytes, now: int, batch_id: str | None = None, **spec: Any) -> Any:
        return self._run(pg_batches.store_batch(self.conn, vins, rid, blob, now, batch_id, RowSpec(**spec)))

    def end(
        self, vin: str, rid: str, blob: bytes, now: int, outcome: Outcome = Outcome.DELIVERED, attempts: int = 0,
        response: bytes = b"",
    ) -> bool:  # fmt: skip
        return self._run(pg_batches.delete_row_if(self.conn, vin, rid, sha1_of(blob), now, outcome, attempts, response))

    def cancel_vins(self, rid: str, vins: list[str], now: int) -> CancelChunk:
        return self._run(pg_batches.cancel_vins(self.conn, rid, vins, now))

    def cancel_all(self, rid: str, now: int, max_rows: int) -> CancelChunk:
        return self._run(pg_batches.start_cancel_all(self.conn, rid, now, max_rows))

    def cancel_chunk(self, rid: str, now: int, max_rows: int) -> CancelChunk:
        return self._run(pg_batches.cancel_chunk(self.conn, rid, now, max_rows))

    def rows(self) -> list[keys.Row]:
        found = self._run(self.conn.fetch("SELECT vin, request_id, ts_ms, sha1, size, expires_ms, flags FROM rows"))
        return sorted(keys.Row(r[0], r[1], r[2], bytes(r[3]), r[4], r[5], r[6]) for r in found)

    def records(self) -> set[Record]:
        found = self._run(self.conn.fetch("SELECT * FROM outcomes"))
        return {(r[0], r[1], bytes(r[2]), r[3], r[4], r[5], r[6], bytes(r[7])) for r in found}

    def generations(self) -> dict[tuple[str, bytes], tuple[int, int, dict[str, int]]]:
        gens = self._run(pg_outcomes.all_generations(self.conn))
        return {(g.request_id, g.sha1): (g.first_ms, g.last_ms, g.counts) for g in gens}

    def recount(self) -> dict[tuple[str, bytes], dict[str, int]]:
        return self._run(pg_outcomes.recount(self.conn))

    def close(self) -> None:
        self._run(self.conn.close())
        self.loop.close()


def _pg_side(dsn: str) -> PgSide:
    side = PgSide(dsn)
    side._run(side.conn.execute(f"TRUNCATE {_TABLES}"))
    return side


@pytest.fixture
def store(request: pytest.FixtureRequest, each_store: str, tmp_path: Path) -> Iterator[Side]:
    """Each store in turn, empty."""
    side: LmdbSide | PgSide
    side = LmdbSide(tmp_path / "lmdb") if each_store == "lmdb" else _pg_side(request.getfixturevalue("pg_dsn"))
    yield side
    side.close()


def counts_of(store: Side, rid: str, blob: bytes) -> dict[str, int]:
    """The non-zero counts of one generation."""
    _, _, found = store.generations()[(rid, sha1_of(blob))]
    return {k: v for k, v in found.items() if v}


def assert_recount(store: Side) -> None:
    """Stored counts equal a recount from rows and outcome records, and the generations' pending
    counts add up to the rows stored (PostgreSQL's pending-rows gauge reads that sum)."""
    generations = store.generations()
    stored = {k: c for k, (_, _, c) in generations.items() if c["total"]}
    assert stored == store.recount()
    assert sum(c["pending"] for _, _, c in generations.values()) == len(store.rows())


def outcome_of(store: Side, vin: str, rid: str, blob: bytes) -> Outcome | None:
    found = [r[6] for r in store.records() if r[:3] == (vin, rid, sha1_of(blob))]
    return Outcome(found[0]) if found else None


# -- the same bodies on both stores ---------------------------------------------------------------


def test_a_batch_makes_one_pending_pair_per_vin(store: Side) -> None:
    """Three VINs, one generation: three rows, total 3, pending 3, the blob new."""
    written = store.batch(["V2", "V1", "V3"], "task_ota_1", b"fw1", 1_000)
    assert written == BatchWritten("task_ota_1", sha1_of(b"fw1"), ("V2", "V1", "V3"), 0, True)
    assert [(r.vin, r.ts_ms, r.size) for r in store.rows()] == [("V1", 1_000, 3), ("V2", 1_000, 3), ("V3", 1_000, 3)]
    assert counts_of(store, "task_ota_1", b"fw1") == {"total": 3, "pending": 3}
    assert store.batch(["V4"], "task_ota_2", b"fw1", 1_001).new_blob is False


def test_a_newer_payload_supersedes_the_pending_row(store: Side) -> None:
    """The same request id with new data: the old pair ends superseded, the new generation counts it."""
    store.batch(["V1", "V2"], "task_ota_1", b"fw1", 1_000)
    written = store.batch(["V2"], "task_ota_1", b"fw2", 1_001)
    assert (written.replaced, written.superseded) == (1, frozenset({sha1_of(b"fw1")}))
    assert counts_of(store, "task_ota_1", b"fw1") == {"total": 2, "pending": 1, "superseded": 1}
    assert counts_of(store, "task_ota_1", b"fw2") == {"total": 1, "pending": 1}
    assert outcome_of(store, "V2", "task_ota_1", b"fw1") is Outcome.SUPERSEDED
    assert_recount(store)


def test_the_same_batch_again_replaces_and_changes_no_count(store: Side) -> None:
    """A pending pair sent again stays one pending pair, its row restamped."""
    store.batch(["V1"], "task_ota_1", b"fw1", 1_000)
    assert store.batch(["V1"], "task_ota_1", b"fw1", 1_001).replaced == 1
    assert counts_of(store, "task_ota_1", b"fw1") == {"total": 1, "pending": 1}
    assert [r.ts_ms for r in store.rows()] == [1_001]


def test_the_bound_refuses_new_rows_but_not_replacements(store: Side) -> None:
    """At max_pending a VIN gets no new row; a new version of a request it holds replaces in place."""
    store.batch(["V1"], "task_a_1", b"a", 1, max_pending=2)
    store.batch(["V1"], "task_b_1", b"b", 2, max_pending=2)
    written = store.batch(["V1", "V2"], "task_c_1", b"c", 3, max_pending=2)
    assert (written.refused, written.vins) == (("V1",), ("V2",))
    replaced = store.batch(["V1"], "task_b_1", b"b2", 4, max_pending=2)
    assert (replaced.refused, replaced.replaced) == ((), 1)
    assert sorted(r.request_id for r in store.rows() if r.vin == "V1") == ["task_a_1", "task_b_1"]
    assert_recount(store)


def test_a_retried_batch_id_stores_nothing_and_gets_the_first_receipt(store: Side) -> None:
    """The second batch under a batch_id writes nothing and answers Duplicate with the first receipt."""
    store.batch(["V1", "V2"], "task_a_1", b"a", 1_000, max_pending=1)
    first = store.batch(["V1", "V3"], "task_b_1", b"b", 1_001, batch_id="b-1", max_pending=1)
    assert first.refused == ("V1",)
    again = store.batch(["V1", "V3", "V4"], "task_b_1", b"other", 1_002, batch_id="b-1", max_pending=1)
    assert again == Duplicate("b-1", "task_b_1", sha1_of(b"b"), 1, 1_001, ("V1",))
    assert [(r.vin, r.request_id) for r in store.rows()] == [("V1", "task_a_1"), ("V2", "task_a_1"), ("V3", "task_b_1")]


def test_endings_are_recorded_with_time_attempts_and_answer(store: Side) -> None:
    """Delivered, failed and responded pairs leave their rows with one record each; an ack of a
    replaced payload ends nothing."""
    store.batch(["V1", "V2", "V3"], "task_a_1", b"a", 1_000)
    assert store.end("V1", "task_a_1", b"a", 2_000, Outcome.DELIVERED, attempts=2)
    assert store.end("V2", "task_a_1", b"a", 2_001, Outcome.FAILED, attempts=10)
    assert store.end("V3", "task_a_1", b"a", 2_002, Outcome.RESPONDED, attempts=1, response=b'{"ok":1}')
    assert not store.end("V3", "task_a_1", b"a", 2_003)  # gone already, and not cancelled
    assert not store.end("V9", "task_a_1", b"a", 2_003)
    sha1 = sha1_of(b"a")
    assert store.records() == {
        ("V1", "task_a_1", sha1, 2_000, 1_000, 2, Outcome.DELIVERED, b""),
        ("V2", "task_a_1", sha1, 2_001, 1_000, 10, Outcome.FAILED, b""),
        ("V3", "task_a_1", sha1, 2_002, 1_000, 1, Outcome.RESPONDED, b'{"ok":1}'),
    }
    assert store.rows() == []
    assert counts_of(store, "task_a_1", b"a") == {"total": 3, "delivered": 1, "failed": 1, "responded": 1}
    store.batch(["V1"], "task_a_1", b"b", 3_000)
    assert not store.end("V1", "task_a_1", b"a", 3_001)  # the row holds another payload now
    assert_recount(store)


def test_a_delivered_generation_sent_again_is_pending_again_not_twice_counted(store: Side) -> None:
    """Delivered, then the same generation again to the same VIN: pending once more, total unchanged."""
    store.batch(["V1"], "task_ota_1", b"fw1", 1_000)
    store.end("V1", "task_ota_1", b"fw1", 2_000)
    store.batch(["V1"], "task_ota_1", b"fw1", 3_000)
    assert counts_of(store, "task_ota_1", b"fw1") == {"total": 1, "pending": 1}
    assert store.records() == set()
    assert_recount(store)


def test_a_puback_of_a_cancelled_delivery_amends_its_outcome(store: Side) -> None:
    """Cancelled while out, then PUBACKed: the outcome becomes delivered, counted so; a second
    PUBACK, or a cancel of the cancelled pair, changes nothing."""
    store.batch(["V1", "V2"], "task_a_1", b"a", 1_000)
    chunk = store.cancel_vins("task_a_1", ["V2", "V1", "V7"], 1_001)
    assert chunk == CancelChunk("task_a_1", (("V2", sha1_of(b"a")), ("V1", sha1_of(b"a"))), 2, False)
    assert store.end("V1", "task_a_1", b"a", 1_002, attempts=3)
    assert outcome_of(store, "V1", "task_a_1", b"a") is Outcome.DELIVERED
    assert not store.end("V1", "task_a_1", b"a", 1_003)
    assert not store.end("V2", "task_a_1", b"a", 1_003, Outcome.CANCELLED)
    assert counts_of(store, "task_a_1", b"a") == {"total": 2, "delivered": 1, "cancelled": 1}
    assert ("V1", "task_a_1", sha1_of(b"a"), 1_002, 1_000, 3, Outcome.DELIVERED, b"") in store.records()
    assert_recount(store)


def test_a_cancel_of_all_takes_rows_stored_up_to_its_cut_and_not_later_ones(store: Side) -> None:
    """A cancel of every vehicle in chunks: a batch of the same request stored after it is
    stamped past the cut and stays; the old rows it replaced end cancelled and count in the total."""
    store.batch([f"V{n}" for n in range(6)], "task_a_1", b"old", 1_000)
    first = store.cancel_all("task_a_1", 1_000, max_rows=2)
    assert (first.more, len(first.cancelled)) == (True, 2)
    later = store.batch(["V4", "V5"], "task_a_1", b"new", 1_000)  # same ms as the cut
    assert later.superseded == frozenset()
    chunk = first
    while chunk.more:
        chunk = store.cancel_chunk("task_a_1", 1_001, max_rows=2)
    assert chunk.total == 6
    assert outcome_of(store, "V5", "task_a_1", b"old") is Outcome.CANCELLED
    assert [(r.vin, r.ts_ms) for r in store.rows()] == [("V4", 1_001), ("V5", 1_001)]
    assert counts_of(store, "task_a_1", b"old") == {"total": 6, "cancelled": 6}
    assert_recount(store)


def test_random_work_keeps_counts_equal_to_a_recount(store: Side) -> None:
    """Batches (some bounded, expiring, answering, with batch ids), acks, answers, failures,
    cancels of some and of all: stored counts always equal the recount."""
    rng = random.Random(13)
    for step, _ in enumerate(_random_work(store, rng, 300)):
        if step % 60 == 0:
            assert_recount(store)
    assert_recount(store)


# -- both stores side by side --------------------------------------------------------------------


def test_both_stores_answer_random_work_alike(tmp_path: Path, pg_dsn: str) -> None:
    """The same random work on both stores: every answer equal, and at the end the same rows,
    outcome records and generations (times included)."""
    lmdb_side, pg_side = LmdbSide(tmp_path / "lmdb"), _pg_side(pg_dsn)
    try:
        steps = zip(
            _random_work(lmdb_side, random.Random(7), 300), _random_work(pg_side, random.Random(7), 300), strict=True
        )
        for n, (on_lmdb, on_pg) in enumerate(steps):
            assert on_lmdb == on_pg, f"step {n}"
        assert lmdb_side.rows() == pg_side.rows()
        assert lmdb_side.records() == pg_side.records()
        assert lmdb_side.generations() == pg_side.generations()
    finally:
        lmdb_side.close()
        pg_side.close()


def _random_work(store: Side, rng: random.Random, steps: int) -> Iterator[Any]:
    """Random operations on `store`, yielding each answer (the same rng seed, the same work)."""
    now = 1_000_000
    for _ in range(steps):
        now += rng.randint(0, 30)
        # Distinct VINs: the hook layer folds duplicates before any store sees them.
        vins = list(dict.fromkeys(f"V{rng.randrange(12)}" for _ in range(rng.randint(1, 5))))
        rid = f"task_t_{rng.randrange(6)}"
        blob = bytes([rng.randrange(3)])
        roll = rng.random()
        if roll < 0.5:
            expires = now + rng.randint(1, 400) if rng.random() < 0.3 else 0
            batch_id = f"b{rng.randrange(40)}" if rng.random() < 0.2 else None
            yield store.batch(vins, rid, blob, now, batch_id, expires_ms=expires, flags=rng.randrange(2), max_pending=4)
        elif roll < 0.75:
            outcome = rng.choice([Outcome.DELIVERED, Outcome.RESPONDED, Outcome.FAILED, Outcome.CANCELLED])
            yield store.end(vins[0], rid, blob, now, outcome, rng.randrange(4), b"r" * rng.randrange(3))
        elif roll < 0.88:
            yield store.cancel_vins(rid, vins, now)
        else:
            chunks = [store.cancel_all(rid, now, 3)]
            while chunks[-1].more and rng.random() < 0.8:  # sometimes left half done, as by a crash
                chunks.append(store.cancel_chunk(rid, now, 3))
            yield chunks


# -- PostgreSQL alone: many instances at once ------------------------------------------------------


def test_concurrent_writers_keep_counts_exact_on_postgresql(pg_dsn: str) -> None:
    """Four connections (as four instances) write overlapping batches, acks and cancels at once:
    no deadlock, no lost update, counts equal a recount, every batch_id stored once."""

    async def worker(conn: asyncpg.Connection, seed: int) -> list[Any]:
        rng = random.Random(seed)
        answers: list[Any] = []
        for _ in range(40):
            vins = rng.sample([f"V{n}" for n in range(10)], rng.randint(1, 6))
            rid, blob, now = f"task_t_{rng.randrange(3)}", bytes([rng.randrange(2)]), 1_000 + rng.randrange(50)
            roll = rng.random()
            if roll < 0.6:
                batch_id = f"b{rng.randrange(10)}" if rng.random() < 0.3 else None
                answers.append(
                    await pg_batches.store_batch(conn, vins, rid, blob, now, batch_id, RowSpec(max_pending=3))
                )
            elif roll < 0.85:
                outcome = rng.choice([Outcome.DELIVERED, Outcome.FAILED, Outcome.RESPONDED])
                answers.append(await pg_batches.delete_row_if(conn, vins[0], rid, sha1_of(blob), now, outcome))
            elif roll < 0.95:
                answers.append(await pg_batches.cancel_vins(conn, rid, vins, now))
            else:
                chunk = await pg_batches.start_cancel_all(conn, rid, now, 2)
                while chunk.more:
                    chunk = await pg_batches.cancel_chunk(conn, rid, now, 2)
                answers.append(chunk)
        return answers

    side = _pg_side(pg_dsn)

    async def go() -> list[list[Any]]:
        conns = [await asyncpg.connect(pg_dsn, timeout=10) for _ in range(4)]
        try:
            return list(await asyncio.gather(*(worker(c, seed) for seed, c in enumerate(conns))))
        finally:
            for c in conns:
                await c.close()

    try:
        answers = side._run(go())
        stored_ids = [a.batch_id for a in itertools.chain(*answers) if isinstance(a, Duplicate)]
        assert len(stored_ids) > 0  # retries of stored batch ids happened, and were answered Duplicate
        assert_recount(side)
        receipts = side._run(side.conn.fetch("SELECT batch_id, rows FROM batches"))
        assert len({r[0] for r in receipts}) == len(receipts)
    finally:
        side.close()
