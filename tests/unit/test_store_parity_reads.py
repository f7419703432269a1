"""The `Reads` port (storage/port.py) gives the same answers over LMDB and PostgreSQL: the same test
bodies on `LmdbReads` and `PgReads`, the store filled through its `Writes` port.

Each test body is a coroutine run on a fresh store: LMDB on tmp_path behind the group committer,
or PostgreSQL on the session's throwaway cluster (one migrated database for this module, emptied
before each test) behind an asyncpg pool. Acks are the one write neither port has; `Engine.ack`
runs the engine's own `delete_row_if`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from storage.errors import StorageError
from storage.lmdb import batches, keys
from storage.lmdb.batches import RowSpec
from storage.lmdb.batches import sha1_of as sha1
from storage.lmdb.keys import FLAG_AWAIT_RESPONSE, Row
from storage.lmdb.outcomes import Generation, Outcome
from storage.lmdb.reads import LmdbReads
from storage.lmdb.store import SCHEMA_VERSION, Store
from storage.lmdb.writer import GroupCommitter
from storage.lmdb.writes import LmdbWrites
from storage.port import GcSettings, Reads, Writes
from storage.postgres import batches as pg_batches
from storage.postgres import migrate
from storage.postgres.reads import PgReads
from storage.postgres.writes import PgWrites
from testkit.pg_cluster import PgCluster
from tests.unit import test_store_parity as parity

HOUR = 3_600_000
DAY = 24 * HOUR
#: Every deadline of the ports in these tests: far above any honest answer on 2 shared cores.
TIMEOUT_S = 10.0


@dataclass
class Engine:
    """One store behind both ports, and how to ack a delivery on it."""

    name: str
    writes: Writes
    reads: Reads
    #: ack(vin, request_id, sha1, now_ms, outcome, attempts): the store's `delete_row_if`.
    ack: Callable[[str, str, bytes, int, Outcome, int], Awaitable[bool]]
    schema_version: int
    has_map: bool


Opener = Callable[[], AbstractAsyncContextManager[Engine]]


@asynccontextmanager
async def lmdb_engine(path: Path) -> AsyncIterator[Engine]:
    store = Store(path)
    committer = GroupCommitter(store)

    async def ack(vin: str, rid: str, digest: bytes, now: int, outcome: Outcome, attempts: int) -> bool:
        op = functools.partial(
            batches.delete_row_if,
            t=store.tables,
            vin=vin,
            request_id=rid,
            sha1=digest,
            now_ms=now,
            outcome=outcome,
            attempts=attempts,
        )
        return bool(await asyncio.wrap_future(committer.submit(op)))

    try:
        yield Engine(
            "lmdb", LmdbWrites(store, committer, TIMEOUT_S), LmdbReads(store, committer), ack, SCHEMA_VERSION, True
        )
    finally:
        await asyncio.to_thread(committer.close)
        store.close()


@asynccontextmanager
async def pg_engine(dsn: str) -> AsyncIterator[Engine]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            await conn.execute(f"TRUNCATE {parity._TABLES}")

        async def ack(vin: str, rid: str, digest: bytes, now: int, outcome: Outcome, attempts: int) -> bool:
            async with pool.acquire() as conn:
                return await pg_batches.delete_row_if(conn, vin, rid, digest, now, outcome, attempts)

        yield Engine(
            "postgresql",
            PgWrites(pool, TIMEOUT_S),
            PgReads(pool, TIMEOUT_S),
            ack,
            migrate.SCHEMA_VERSION,
            False,
        )
    finally:
        await pool.close()


@pytest.fixture
def opener(request: pytest.FixtureRequest, each_store: str, tmp_path: Path) -> Opener:
    """Each store in turn, empty, behind its Writes and Reads ports."""
    if each_store == "lmdb":
        return lambda: lmdb_engine(tmp_path / "lmdb")
    dsn: str = request.getfixturevalue("pg_dsn")
    return lambda: pg_engine(dsn)


def run(opener: Opener, body: Callable[[Engine], Awaitable[None]]) -> None:
    """`body` on a fresh store, in an event loop of its own."""

    async def go() -> None:
        async with opener() as engine:
            await body(engine)

    asyncio.run(go())


async def eventually(predicate: Callable[[], Awaitable[Any]], timeout_s: float = 10.0) -> Any:
    """predicate()'s first truthy answer, polled until a deadline (never a bare sleep)."""
    deadline = time.monotonic() + timeout_s
    while not (value := await predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)
    return value


def place(g: Generation) -> tuple[int, bytes]:
    """A generation's place in ListRequests order: its last change, then its LMDB key."""
    return g.last_ms, keys.gen_key(g.request_id, g.sha1)


def nonzero(g: Generation) -> dict[str, int]:
    return {k: v for k, v in g.counts.items() if v}


# -- stats ----------------------------------------------------------------------------------------


def test_stats_count_rows_blobs_bytes_aliases_and_parked_triggers(opener: Opener) -> None:
    """Rows, distinct blobs and their bytes, the bytes rows would take without dedup, aliases,
    parked triggers and the engine's schema version; the map fields are LMDB's alone."""

    async def body(e: Engine) -> None:
        empty = await e.reads.stats()
        assert (empty.rows, empty.blobs, empty.blob_bytes, empty.logical_bytes, empty.dedup_ratio) == (0, 0, 0, 0, 0.0)
        await e.writes.store_batch(["V1", "V2", "V3"], "task_ota_1", b"firmware", 1_000)
        await e.writes.store_batch(["V1"], "task_cfg_1", b"cfg", 1_001)
        await e.writes.store_data("d1", b"config-data", 1_002, 100, 0)
        await e.writes.store_trigger("d2", ["V4", "V5"], "task_cfg_2", 1_003, 10, 100)
        s = await e.reads.stats()
        assert (s.rows, s.blobs, s.aliases, s.early_triggers) == (4, 3, 1, 1)
        assert (s.blob_bytes, s.logical_bytes) == (8 + 3 + 11, 3 * 8 + 3)
        assert s.dedup_ratio == pytest.approx(27 / 22)
        assert s.schema_version == e.schema_version
        assert (s.map_size_bytes > 0, s.map_used_bytes > 0) == (e.has_map, e.has_map)

    run(opener, body)


# -- a vehicle ------------------------------------------------------------------------------------


def test_vehicle_shows_its_queue_in_delivery_order_and_its_outcomes_newest_first(opener: Opener) -> None:
    """Pending rows by store time then request id, with size, expires_at and flags; outcome records
    newest first, as many as asked; another vehicle's rows and records stay out."""

    async def body(e: Engine) -> None:
        w = e.writes
        await w.store_batch(["V1"], "task_x", b"x1", 500)
        await w.store_batch(["V1"], "task_x", b"x2", 600)  # supersedes x1
        assert await e.ack("V1", "task_x", sha1(b"x2"), 700, Outcome.DELIVERED, 2)
        await w.store_batch(["V1", "V2"], "task_y", b"y", 750)
        await w.cancel_vins("task_y", ["V1"], 800)
        await w.store_batch(["V1", "V2"], "task_c", b"c", 1_000)
        await w.store_batch(["V1"], "task_a", b"aa", 1_000)
        await w.store_batch(["V1"], "task_b", b"bbb", 900, spec=RowSpec(expires_ms=9_000, flags=FLAG_AWAIT_RESPONSE))

        rows, ended = await e.reads.vehicle("V1", 10)
        assert rows == [
            Row("V1", "task_b", 900, sha1(b"bbb"), 3, 9_000, FLAG_AWAIT_RESPONSE),
            Row("V1", "task_a", 1_000, sha1(b"aa"), 2),
            Row("V1", "task_c", 1_000, sha1(b"c"), 1),
        ]
        assert [(o.request_id, o.sha1, o.outcome, o.ts_ms, o.stored_ms, o.attempts) for o in ended] == [
            ("task_y", sha1(b"y"), Outcome.CANCELLED, 800, 750, 0),
            ("task_x", sha1(b"x2"), Outcome.DELIVERED, 700, 600, 2),
            ("task_x", sha1(b"x1"), Outcome.SUPERSEDED, 600, 500, 0),
        ]
        assert all(o.vin == "V1" for o in ended)
        assert (await e.reads.vehicle("V1", 2))[1] == ended[:2]
        assert await e.reads.vehicle("V2", 10) == (
            [Row("V2", "task_y", 750, sha1(b"y"), 1), Row("V2", "task_c", 1_000, sha1(b"c"), 1)],
            [],
        )
        assert await e.reads.vehicle("V9", 10) == ([], [])

    run(opener, body)


# -- generations ----------------------------------------------------------------------------------


def test_generations_of_a_request_come_newest_first_with_their_counts(opener: Opener) -> None:
    """One generation per payload of a request id, newest first by first change; none for an unknown id."""

    async def body(e: Engine) -> None:
        await e.writes.store_batch(["V1", "V2"], "task_x", b"x1", 500)
        await e.writes.store_batch(["V1"], "task_x", b"x2", 600)
        await e.writes.store_batch(["V1"], "task_other", b"x1", 650)
        newer, older = await e.reads.generations("task_x")
        assert (newer.sha1, newer.first_ms, newer.last_ms, nonzero(newer)) == (
            sha1(b"x2"),
            600,
            600,
            {"total": 1, "pending": 1},
        )
        assert (older.sha1, older.first_ms, older.last_ms, nonzero(older)) == (
            sha1(b"x1"),
            500,
            600,
            {"total": 2, "pending": 1, "superseded": 1},
        )
        assert await e.reads.generations("task_nobody_sent") == []

    run(opener, body)


async def _generations_with_ties(w: Writes) -> None:
    """Seven generations: three change at 100 (request ids "t" and "t_1", "t" a prefix of the other,
    and two payloads of "t"), two at 300, one at 200, one at 50."""
    await w.store_batch(["V1"], "t", b"a", 100)
    await w.store_batch(["V2"], "t", b"b", 100)
    await w.store_batch(["V1"], "t_1", b"a", 100)
    await w.store_batch(["V3"], "s", b"d", 200)
    await w.store_batch(["V1"], "u", b"c", 300)
    await w.store_batch(["V1", "V2"], "r", b"e", 300)
    await w.store_batch(["V4"], "q", b"f", 50)


def test_every_generation_comes_newest_first_ties_by_request_id_then_sha1(opener: Opener) -> None:
    """all_generations: by last change, newest first; ties by request id descending, then sha1 ascending."""

    async def body(e: Engine) -> None:
        await _generations_with_ties(e.writes)
        found = await e.reads.all_generations()
        t_payloads = sorted([sha1(b"a"), sha1(b"b")])
        assert [(g.request_id, g.last_ms, g.sha1) for g in found] == [
            ("u", 300, sha1(b"c")),
            ("r", 300, sha1(b"e")),
            ("s", 200, sha1(b"d")),
            ("t_1", 100, sha1(b"a")),
            ("t", 100, t_payloads[0]),
            ("t", 100, t_payloads[1]),
            ("q", 50, sha1(b"f")),
        ]

    run(opener, body)


def test_pages_of_generations_show_each_once_newest_first_and_name_the_next_place(opener: Opener) -> None:
    """Paging by 2 walks every generation once in (last change, key) order, descending; each page's
    place is its last generation's, the last page names none, and the total is on every page."""

    async def body(e: Engine) -> None:
        await _generations_with_ties(e.writes)
        expected = sorted(await e.reads.all_generations(), key=place, reverse=True)
        walked: list[Generation] = []
        after = None
        while True:
            page, after, total = await e.reads.generations_page(2, after)
            assert total == 7
            walked += page
            if after is None:
                break
            assert after == place(page[-1])
        assert walked == expected
        everything, last, _ = await e.reads.generations_page(7)
        assert (everything, last) == (expected, None)
        assert (await e.reads.generations_page(6))[1] == place(expected[5])

    run(opener, body)


@pytest.mark.parametrize(
    "after",
    [
        (100, b"t\x00" + b"\xff" * 20),  # past every payload of "t", before "t_1"
        (100, b"t"),  # a prefix of every key at 100: they all sort after it
        (100, b"t_1\x00" + b"\x00" * 20),  # before "t_1"'s one payload
        (250, b""),  # between two times
        (10**15, b""),  # past everything: the first page
        (0, b"\xff"),  # before everything: nothing
    ],
)
def test_a_page_starts_right_after_any_place_compared_as_lmdb_key_bytes(
    opener: Opener, after: tuple[int, bytes]
) -> None:
    """A place need not be a generation's: the page holds the generations that sort before it in
    (last change, LMDB key bytes) order, so any token means the same on either store."""

    async def body(e: Engine) -> None:
        await _generations_with_ties(e.writes)
        expected = [g for g in sorted(await e.reads.all_generations(), key=place, reverse=True) if place(g) < after]
        page, last, total = await e.reads.generations_page(3, after)
        assert (page, total) == (expected[:3], 7)
        assert last == (place(expected[2]) if len(expected) > 3 else None)

    run(opener, body)


# -- gc -------------------------------------------------------------------------------------------

GC_SETTINGS = GcSettings(now_ms=20 * DAY, retention_ms=7 * DAY, grace_ms=HOUR, early_ttl_ms=HOUR, early_limit=100)


def test_gc_through_the_port_predicts_then_expires_old_rows_frees_blobs_and_parked_triggers(opener: Opener) -> None:
    """The dry run counts rows and blobs and changes nothing; the pass expires rows past retention
    (their vehicle shows `expired`), frees their blob, drops parked triggers past their TTL and
    keeps the rest."""

    async def body(e: Engine) -> None:
        await e.writes.store_batch(["V1", "V2"], "task_old", b"old", 10 * DAY)
        await e.writes.store_batch(["V1"], "task_new", b"new", 19 * DAY)
        await e.writes.store_trigger("d1", ["V3"], "task_parked", 10 * DAY, 10, 100, batch_id="b1")
        dry = await e.reads.gc(GC_SETTINGS, dry_run=True)
        assert (dry.dry_run, dry.rows_expired, dry.blobs_deleted, dry.blob_bytes_freed, dry.early_expired) == (
            True,
            2,
            1,
            3,
            0,
        )
        assert await e.reads.row_count() == 3
        done = await e.reads.gc(GC_SETTINGS)
        assert (done.dry_run, done.rows_expired, done.blobs_deleted, done.blob_bytes_freed) == (False, 2, 1, 3)
        assert [(x.data_id, x.request_id, x.batch_id) for x in done.expired_early] == [("d1", "task_parked", "b1")]
        assert done.early_expired == 1
        assert await e.reads.row_count() == 1
        rows, ended = await e.reads.vehicle("V2", 10)
        assert rows == [] and [(o.request_id, o.outcome) for o in ended] == [("task_old", Outcome.EXPIRED)]
        again = await e.reads.gc(GC_SETTINGS)
        assert (again.rows_expired, again.blobs_deleted, again.early_expired) == (0, 0, 0)
        s = await e.reads.stats()
        assert (s.rows, s.blobs, s.early_triggers) == (1, 1, 0)

    run(opener, body)


def test_a_read_only_lmdb_view_refuses_gc(tmp_path: Path) -> None:
    """LmdbReads without a group committer (the CLI's read-only view) answers reads, refuses GC."""
    Store(tmp_path / "lmdb").close()  # created, as a running server would have
    with Store(tmp_path / "lmdb", readonly=True) as store:
        reads = LmdbReads(store)
        assert asyncio.run(reads.row_count()) == 0
        with pytest.raises(StorageError, match="read-only"):
            asyncio.run(reads.gc(GC_SETTINGS))


# -- gauges ---------------------------------------------------------------------------------------


def test_row_count_and_vehicles_at_a_bound(opener: Opener) -> None:
    """Pending rows in all; vehicles holding at least `bound` rows, below and above LMDB's
    per-vehicle counting threshold."""

    async def body(e: Engine) -> None:
        w = e.writes
        for n, vin in ((3, "V1"), (1, "V2"), (2, "V3"), (33, "V9")):
            for i in range(n):
                await w.store_batch([vin], f"task_{i}", b"p", 1_000 + i)
        assert await e.reads.row_count() == 39
        assert [await e.reads.vehicles_at(bound) for bound in (1, 2, 3, 4, 32, 33, 34)] == [4, 3, 2, 1, 1, 1, 0]

    run(opener, body)


def test_map_usage_is_lmdbs_fill_and_none_without_a_map(opener: Opener) -> None:
    """LMDB answers its map's fill (0 < usage <= 1); PostgreSQL has no map and answers None."""

    async def body(e: Engine) -> None:
        await e.writes.store_batch(["V1"], "task_1", b"p", 1_000)
        usage = await e.reads.map_usage()
        if e.has_map:
            assert usage is not None and 0 < usage <= 1
        else:
            assert usage is None

    run(opener, body)


# -- PostgreSQL failures --------------------------------------------------------------------------

_names = itertools.count()


def test_postgresql_read_failures_and_deadlines_come_out_as_storage_errors(pg_cluster: PgCluster) -> None:
    """A read of a database without the schema, and a read that cannot get a connection within
    its deadline, raise StorageError (what the background loops carry on after), as LMDB's do."""
    dsn = pg_cluster.new_database(f"reads_bare_{next(_names)}")

    async def go() -> None:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        assert pool is not None
        try:
            with pytest.raises(StorageError, match="UndefinedTableError"):
                await PgReads(pool, TIMEOUT_S).row_count()
            async with pool.acquire():  # the pool's one connection is taken
                with pytest.raises(StorageError, match=r"longer than 0\.2 s"):
                    await PgReads(pool, 0.2).stats()
        finally:
            await pool.close()

    asyncio.run(go())
