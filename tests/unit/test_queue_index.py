"""The `queue` index: one entry per `ids` row in delivery order, kept in step by every writer,
built from `ids` when a schema-1 store is first opened read-write."""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import structlog
from structlog.testing import capture_logs

from storage import gc, keys, migrate, ops
from storage.plan import apply_plan
from storage.store import SCHEMA_VERSION, Store, Tables
from storage.writer import GroupCommitter
from tests.harness import put
from tests.plan_reference import write_plan

#: Schema 1's tables: everything but `queue`.
SCHEMA_1_TABLES = ("data", "touched", "ids", "expiry", "aliases", "early", "meta")
#: Includes VINs that are prefixes of others: a vehicle's range must end at its own NUL.
FLEET = ("V1", "V10", "V1A", "V2", "W", "WX", "X9")


def sha1(blob: bytes) -> bytes:
    return hashlib.sha1(blob).digest()


def index_and_rows(store: Store) -> tuple[set[bytes], set[bytes]]:
    """(queue keys present, queue keys the `ids` rows call for), from one snapshot."""
    t = store.tables
    with store.read() as txn:
        have = {bytes(k) for k in txn.cursor(t.queue).iternext(values=False)}
        want = {keys.queue_key_of(bytes(k), keys.row_ts(v)) for k, v in txn.cursor(t.ids)}
        assert int(txn.stat(t.queue)["entries"]) == len(have)
    return have, want


def rows_by_scan(store: Store, vin: str) -> list[keys.Row]:
    """The vehicle's rows straight from `ids`, in delivery order (the schema-1 way)."""
    with store.read() as txn:
        rows = [keys.decode_row(k, v) for k, v in txn.cursor(store.tables.ids) if keys.decode_row(k, v).vin == vin]
    return sorted(rows, key=lambda r: (r.ts_ms, r.request_id))


def all_rows(store: Store) -> list[keys.Row]:
    with store.read() as txn:
        return [keys.decode_row(k, v) for k, v in txn.cursor(store.tables.ids)]


def write_schema_1(path: Path, rows: list[tuple[str, str, int, bytes]]) -> None:
    """A store as a schema-1 build left it: seven tables, no `queue`, schema version 1."""
    env = lmdb.open(str(path), max_dbs=len(SCHEMA_1_TABLES), map_size=1 << 26)
    dbs = {name: env.open_db(name.encode()) for name in SCHEMA_1_TABLES}
    with env.begin(write=True) as txn:
        txn.put(b"schema_version", b"1", db=dbs["meta"])
        txn.put(b"created_at_ms", b"1", db=dbs["meta"])
        for vin, rid, ts, blob in rows:
            txn.put(sha1(blob), keys.blob_value(ts, blob), db=dbs["data"])
            rkey = keys.row_key(vin, rid)
            txn.put(rkey, keys.row_value(ts, sha1(blob), len(blob)), db=dbs["ids"])
            txn.put(keys.expiry_key(ts, rkey), b"", db=dbs["expiry"])
    env.close()


def schema_1_rows(n: int, seed: int = 7) -> list[tuple[str, str, int, bytes]]:
    """n distinct (vin, request_id) rows over FLEET, timestamps colliding often."""
    rng = random.Random(seed)
    return [(FLEET[i % len(FLEET)], f"task_m_{i}", rng.randrange(1000, 1020), b"blob%d" % (i % 5)) for i in range(n)]


@pytest.fixture
def info_logs() -> Iterator[list[Any]]:
    """Events logged at info and above while the test runs, whatever level the suite logs at."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)


# -- kept in step by every writer ----------------------------------------------------------------


class Mix:
    """Random writes of every kind a running server makes, against one store."""

    def __init__(self, store: Store, writer: GroupCommitter, rng: random.Random, tmp: Path) -> None:
        self.store, self.writer, self.rng, self.tmp = store, writer, rng, tmp
        self.clock = 10_000
        self.data_ids = 0

    def submit(self, fn: Any, **kw: Any) -> Any:
        return self.writer.submit(functools.partial(fn, t=self.store.tables, **kw)).result(10)

    def tick(self) -> int:
        # Mostly forward, sometimes the same ms, sometimes a step back (NTP): order must not matter.
        self.clock += self.rng.choice((0, 1, 1, 5, -3))
        return self.clock

    def vins(self) -> list[str]:
        vins = self.rng.sample(FLEET, self.rng.randint(1, len(FLEET)))
        if self.rng.random() < 0.2:
            vins.append(vins[0])  # a repeated VIN
        return vins

    def rid(self) -> str:
        return f"task_a_{self.rng.randint(1, 6)}"  # few ids: replacements are common

    def blob(self) -> bytes:
        return b"payload-%d" % self.rng.randint(1, 4)

    def ingest(self) -> None:
        self.submit(ops.store_batch, vins=self.vins(), request_id=self.rid(), blob=self.blob(), now_ms=self.tick())

    def two_messages(self) -> None:
        self.data_ids += 1
        data_id = f"d{self.data_ids}"
        trigger = functools.partial(
            ops.store_trigger, data_id=data_id, vins=self.vins(), request_id=self.rid(), early_max=100
        )
        data = functools.partial(ops.store_data, data_id=data_id, blob=self.blob())
        # Either order: the trigger parked until its data comes, or the data known already.
        first, second = (trigger, data) if self.rng.random() < 0.5 else (data, trigger)
        self.submit(first, now_ms=self.tick())
        self.submit(second, now_ms=self.tick())

    def ack(self) -> None:
        rows = all_rows(self.store)
        if rows:
            row = self.rng.choice(rows)
            acked = row.sha1 if self.rng.random() < 0.8 else sha1(b"replaced meanwhile")
            self.submit(ops.delete_row_if, vin=row.vin, request_id=row.request_id, sha1=acked)

    def expire(self) -> None:
        cutoff = self.clock - self.rng.randint(0, 20)
        self.submit(gc.expire_rows, cutoff_ms=cutoff, limit=self.rng.randint(1, 5))

    def gc_apply(self) -> None:
        rows = all_rows(self.store)
        planned = [(r.vin, r.request_id, r.ts_ms - self.rng.choice((0, 0, 1))) for r in rows if self.rng.random() < 0.3]
        plan = {"expired_rows": planned, "expired_aliases": [], "garbage_blobs": [], "snapshot_ms": self.clock}
        plan_dir = self.tmp / f"plan-{self.rng.random()}"
        write_plan(plan_dir, plan, 0, 0)
        apply_plan(self.store, self.writer.submit, plan_dir)

    def step(self) -> str:
        action = self.rng.choices(
            (self.ingest, self.two_messages, self.ack, self.expire, self.gc_apply), weights=(6, 2, 4, 2, 1)
        )[0]
        action()
        return action.__name__


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_index_matches_rows_after_any_mix_of_writes(
    env: tuple[Store, GroupCommitter], tmp_path: Path, seed: int
) -> None:
    """After every ingest, replacement, two-message batch, ack delete, expiry and gc apply, the
    queue keys are exactly the ones the `ids` rows call for, and `pending` lists them in order."""
    store, writer = env
    mix = Mix(store, writer, random.Random(seed), tmp_path)
    for i in range(80):
        name = mix.step()
        have, want = index_and_rows(store)
        assert have == want, f"step {i} ({name}): extra {have - want}, missing {want - have}"
        for vin in FLEET:
            assert store.pending(vin) == rows_by_scan(store, vin), f"step {i} ({name}), {vin}"


def test_replaced_row_moves_to_its_new_place_in_the_queue(env: tuple[Store, GroupCommitter]) -> None:
    """A newer batch with the same (VIN, request_id) drops the row's old queue entry: the vehicle
    gets the request once, in the order of its new timestamp."""
    store, writer = env
    put(writer, store, ["V1"], "task_a_1", b"old", 100)
    put(writer, store, ["V1"], "task_a_2", b"two", 200)
    put(writer, store, ["V1"], "task_a_1", b"new", 300)
    assert [(r.request_id, r.ts_ms) for r in store.pending("V1")] == [("task_a_2", 200), ("task_a_1", 300)]
    have, want = index_and_rows(store)
    assert have == want and len(have) == 2


# -- oldest ------------------------------------------------------------------------------------


def store_many(store: Store, vin: str, rows: list[tuple[str, bytes, int]]) -> None:
    """Many single-row batches for one vehicle, in one write transaction (fast to set up)."""
    with store.write() as txn:
        for rid, blob, at in rows:
            ops.store_batch(txn, store.tables, [vin], rid, blob, at)


def test_oldest_of_a_long_queue_honours_order_hidden_rows_and_missing_blobs(env: tuple[Store, GroupCommitter]) -> None:
    """With 5,000 rows for one vehicle, `oldest` gives the first in (ts, request_id) order that is
    neither hidden (same sha1) nor without its blob, and acking what it gives follows that order."""
    store, writer = env
    n = 5_000
    # Scrambled timestamps with many ties: the order must come from the index, not from arrival.
    store_many(store, "V1", [(f"task_a_{i:05d}", b"p%d" % (i % 3), 1_000 + (i * 7919) % 1_000) for i in range(n)])
    put(writer, store, ["V10", "V"], "task_a_00000", b"other vehicles", 1)
    expected = rows_by_scan(store, "V1")
    assert len(expected) == n and store.pending("V1") == expected

    hidden = {r.request_id: r.sha1 for r in expected[:100]}
    hidden[expected[100].request_id] = sha1(b"an older payload")  # replaced since the ack: not hidden
    assert store.oldest("V1", hidden) == (expected[100], store.blob(expected[100].sha1))

    # A row whose blob is gone is passed over (it can never be delivered).
    gone = expected[0].sha1
    with store.write() as txn:
        txn.delete(gone, db=store.tables.data)
    deliverable = [r for r in expected if r.sha1 != gone]
    assert store.oldest("V1") == (deliverable[0], store.blob(deliverable[0].sha1))

    drained = []
    for _ in range(200):  # acked and deleted one by one, as delivery does
        nxt = store.oldest("V1")
        assert nxt is not None
        drained.append(nxt[0])
        with store.write() as txn:
            assert ops.delete_row_if(txn, store.tables, "V1", nxt[0].request_id, nxt[0].sha1)
    assert drained == deliverable[:200]
    assert store.pending("V1") == [r for r in expected if r not in drained]
    assert store.oldest("V10") is not None and store.oldest("V") is not None


def test_oldest_costs_the_same_for_one_row_or_thousands(env: tuple[Store, GroupCommitter]) -> None:
    """`oldest` seeks the index instead of reading the vehicle's rows: 20,000 pending rows make it
    no slower than one (a scan and sort of them would be hundreds of times slower)."""
    store, writer = env
    store_many(store, "LONG", [(f"task_a_{i:05d}", b"x", 5) for i in range(20_000)])
    put(writer, store, ["SHORT"], "task_a_1", b"x", 5)
    assert store.row_count() == 20_001

    def best_of(vin: str) -> float:
        timings = []
        for _ in range(200):
            t0 = time.perf_counter()
            store.oldest(vin)
            timings.append(time.perf_counter() - t0)
        return min(timings)

    assert best_of("LONG") < 10 * best_of("SHORT")


# -- migration from schema 1 ---------------------------------------------------------------


def test_schema_1_store_is_migrated_on_read_write_open(tmp_path: Path, info_logs: list[Any]) -> None:
    """Opening a schema-1 store read-write builds the index in place, logs `schema_migrated`,
    and `oldest` and `pending` answer as the schema-1 scan did."""
    path = tmp_path / "db"
    write_schema_1(path, schema_1_rows(300))
    with Store(path, readonly=True) as old:
        # A read-only view still works on schema 1 (stats, inspect): it scans `ids`.
        assert old.schema_version == 1 and old.stats().rows == 300
        before = {vin: (old.pending(vin), old.oldest(vin)) for vin in FLEET}
        hidden = {r.request_id: r.sha1 for r in old.pending("V1")[:3]}
        before_hidden = old.oldest("V1", hidden)
    assert all(len(p) > 1 for p, _ in before.values())

    with Store(path) as store:
        assert store.schema_version == SCHEMA_VERSION == 2
        assert {vin: (store.pending(vin), store.oldest(vin)) for vin in FLEET} == before
        assert store.oldest("V1", hidden) == before_hidden
        have, want = index_and_rows(store)
        assert have == want and len(have) == 300
    with Store(path) as store:
        assert store.schema_version == 2  # and nothing left to migrate
    [event] = [e for e in info_logs if e["event"] == "schema_migrated"]
    assert (event["from_version"], event["to_version"], event["rows"]) == (1, 2, 300)


def raw_tables(path: Path) -> tuple[Any, Tables]:
    """The environment and every table of a store, opened without `Store` (which would migrate)."""
    env = lmdb.open(str(path), max_dbs=len(Tables.__slots__), map_size=1 << 26)
    return env, Tables(**{name: env.open_db(name.encode()) for name in Tables.__slots__})


def test_migration_cut_short_is_redone_from_scratch(tmp_path: Path) -> None:
    """A migration that crashed after some chunks leaves schema 1; if an old build then changed
    rows, the next read-write open still builds an index that matches `ids` exactly."""
    path = tmp_path / "db"
    write_schema_1(path, schema_1_rows(100))
    env, t = raw_tables(path)
    for restart in (True, False):  # two committed chunks of 30, then the "crash"
        with env.begin(write=True, buffers=True) as txn:
            assert migrate.queue_chunk(txn, t, restart=restart, chunk_rows=30) == migrate.Step(done=False)
    with env.begin(write=True) as txn:
        assert txn.get(b"schema_version", db=t.meta) == b"1"
        assert txn.stat(t.queue)["entries"] == 60
        # An old build runs meanwhile: it deletes an indexed row and replaces another, without `queue`.
        first, second = [bytes(k) for k in txn.cursor(t.ids).iternext(values=False)][:2]
        txn.delete(first, db=t.ids)
        txn.put(second, keys.row_value(5, sha1(b"blob0"), 5), db=t.ids)
    env.close()

    with Store(path) as store:
        assert store.schema_version == 2
        have, want = index_and_rows(store)
        assert have == want and len(have) == 99


def test_processes_migrating_at_once_finish_one_index_between_them(tmp_path: Path) -> None:
    """Chunks that go on from the committed mark (another process's) complete the same index."""
    path = tmp_path / "db"
    write_schema_1(path, schema_1_rows(100))
    env, t = raw_tables(path)
    steps = []
    for i in range(10):
        with env.begin(write=True, buffers=True) as txn:
            # Process A starts, process B starts over after A's first chunk, then they alternate.
            steps.append(migrate.queue_chunk(txn, t, restart=i in (0, 1), chunk_rows=25))
        if steps[-1].done:
            break
    env.close()
    assert [s.done for s in steps] == [False] * 4 + [True]
    assert steps[-1].rows == 100
    with Store(path) as store:
        have, want = index_and_rows(store)
        assert have == want and len(have) == 100
