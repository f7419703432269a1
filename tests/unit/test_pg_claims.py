"""Claims on a real PostgreSQL: one delivery in flight per vehicle, whoever asks (issue 14)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import pytest

from storage.ops import RowSpec, sha1_of
from storage.outcomes import Outcome
from storage.pg import claims, counts, ingest, migrate
from tests.pg_cluster import PgCluster

T = TypeVar("T")
_names = itertools.count()
TIMEOUT_MS = 60_000


@pytest.fixture
def dsn(pg_cluster: PgCluster) -> str:
    """A fresh migrated database per test (claims leave vehicle state behind)."""
    dsn = pg_cluster.new_database(f"claims_{next(_names)}")

    async def setup() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate.migrate(conn)
        finally:
            await conn.close()

    asyncio.run(setup())
    return dsn


def run(dsn: str, body: Callable[[Any], Awaitable[T]]) -> T:
    async def go() -> T:
        conn = await asyncpg.connect(dsn)
        try:
            return await body(conn)
        finally:
            await conn.close()

    return asyncio.run(go())


def test_the_oldest_row_goes_and_nothing_more_until_its_puback(dsn: str) -> None:
    """A claim takes the oldest deliverable row with its payload; a second finds the vehicle
    busy; the PUBACK ends the row delivered and frees the vehicle for the next one."""

    async def body(conn: Any) -> None:
        await ingest.store_batch(conn, ["V1"], "task_b_1", b"first", 1_000)
        await ingest.store_batch(conn, ["V1"], "task_a_1", b"second", 2_000)
        got = await claims.claim(conn, "V1", "s1", 3_000, TIMEOUT_MS)
        assert got == claims.Claimed("task_b_1", sha1_of(b"first"), 1, b"first")
        assert await claims.claim(conn, "V1", "s1", 3_001, TIMEOUT_MS) is None
        assert await claims.acknowledge(conn, "V1", "task_b_1", sha1_of(b"first"), 3_002)
        nxt = await claims.claim(conn, "V1", "s1", 3_003, TIMEOUT_MS)
        assert nxt is not None and nxt.request_id == "task_a_1"
        assert await counts.outcome_of(conn, "V1", "task_b_1", sha1_of(b"first")) is Outcome.DELIVERED

    run(dsn, body)


def test_of_many_instances_claiming_at_once_exactly_one_gets_the_row(dsn: str) -> None:
    """Eight connections (instances) claim the same vehicles at the same moment, over and over:
    every vehicle is claimed by exactly one of them each time."""

    async def go() -> None:
        conns = [await asyncpg.connect(dsn) for _ in range(8)]
        try:
            vins = [f"V{n}" for n in range(20)]
            await ingest.store_batch(conns[0], vins, "task_ota_1", b"fw", 1_000)
            await ingest.store_batch(conns[0], vins, "task_cfg_1", b"cfg", 1_001)
            for rid, data in (("task_ota_1", b"fw"), ("task_cfg_1", b"cfg")):

                async def instance(i: int, conn: Any) -> list[claims.Claimed]:
                    order = vins[i % len(vins) :] + vins[: i % len(vins)]  # each starts elsewhere
                    return [c for vin in order if (c := await claims.claim(conn, vin, f"inst{i}", 2_000, TIMEOUT_MS))]

                won = [c for part in await asyncio.gather(*(instance(i, c) for i, c in enumerate(conns))) for c in part]
                assert len(won) == len(vins) and {w.request_id for w in won} == {rid}
                for vin in vins:
                    await claims.acknowledge(conns[0], vin, rid, sha1_of(data), 2_001)
            assert await claims.claim(conns[0], "V0", "s", 3_000, TIMEOUT_MS) is None  # nothing left
        finally:
            for c in conns:
                await c.close()

    asyncio.run(go())


def test_expired_rows_and_rows_a_cancel_has_taken_are_never_claimed(dsn: str) -> None:
    """The queue passes over a row past its expires_at and over rows stored up to the cut of a
    cancel of every vehicle in progress, as LMDB's does."""

    async def body(conn: Any) -> None:
        await ingest.store_batch(conn, ["V1"], "task_unlock_1", b"u", 1_000, spec=RowSpec(expires_ms=1_500))
        await ingest.store_batch(conn, ["V1", "V2", "V3"], "task_ota_1", b"fw", 1_001)
        await ingest.store_batch(conn, ["V1"], "task_cfg_1", b"cfg", 1_002)
        first = await ingest.start_cancel_all(conn, "task_ota_1", 1_003, max_rows=1)
        assert first.more  # the walk has not reached every vehicle: the cut hides them anyway
        got = await claims.claim(conn, "V1", "s1", 2_000, TIMEOUT_MS)
        assert got is not None and got.request_id == "task_cfg_1"
        assert await claims.claim(conn, "V3", "s3", 2_000, TIMEOUT_MS) is None

    run(dsn, body)


def test_a_delivery_out_longer_than_the_timeout_is_claimed_again_counting_attempts(dsn: str) -> None:
    async def body(conn: Any) -> None:
        await ingest.store_batch(conn, ["V1"], "task_a_1", b"a", 1_000)
        assert (await claims.claim(conn, "V1", "s1", 2_000, 1_000)) is not None
        assert await claims.claim(conn, "V1", "s1", 2_999, 1_000) is None  # still fresh
        again = await claims.claim(conn, "V1", "s2", 3_000, 1_000)
        assert again is not None and (again.request_id, again.attempts) == ("task_a_1", 2)

    run(dsn, body)


def test_one_statement_tells_which_heartbeating_vehicles_want_a_claim(dsn: str) -> None:
    """Of a batch of heartbeats: only vehicles with something deliverable and nothing fresh out."""

    async def body(conn: Any) -> None:
        await ingest.store_batch(conn, ["V1", "V2", "V3"], "task_a_1", b"a", 1_000)
        await ingest.store_batch(conn, ["V4"], "task_b_1", b"b", 1_000, spec=RowSpec(expires_ms=1_500))
        assert await claims.claim(conn, "V2", "s2", 2_000, TIMEOUT_MS) is not None
        beats = ["V5", "V4", "V3", "V2", "V1", "V1"]
        assert await claims.wanting(conn, beats, 2_000, TIMEOUT_MS) == ["V1", "V3"]
        assert await claims.wanting(conn, beats, 2_000 + TIMEOUT_MS, TIMEOUT_MS) == ["V1", "V2", "V3"]

    run(dsn, body)
