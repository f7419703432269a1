"""Acks append their count changes (`gen_deltas`, storage/postgres/sql/schema.sql): counts are exact before, during and
after folding, and folds running at once apply each change once (issue 14, hot generation rows)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import asyncpg
import pytest

from storage.lmdb.batches import sha1_of
from storage.lmdb.outcomes import Outcome
from storage.postgres import batches, migrate, outcomes
from testkit.pg_cluster import PgCluster

_names = itertools.count()


@pytest.fixture
def dsn(pg_cluster: PgCluster) -> str:
    return pg_cluster.new_database(f"deltas_{next(_names)}")


def test_acks_append_changes_and_concurrent_folds_apply_each_once(dsn: str) -> None:
    async def go() -> None:
        conns: list[Any] = [await asyncpg.connect(dsn) for _ in range(4)]
        try:
            await migrate.migrate(conns[0])
            vins = [f"V{n:03d}" for n in range(300)]
            await batches.store_batch(conns[0], vins, "task_ota_1", b"fw", 1_000)

            async def ack(conn: Any, part: list[str]) -> None:
                for vin in part:
                    outcome = Outcome.FAILED if vin.endswith("7") else Outcome.DELIVERED
                    assert await batches.delete_row_if(conn, vin, "task_ota_1", sha1_of(b"fw"), 2_000, outcome, 1)

            await asyncio.gather(*(ack(c, vins[i::4]) for i, c in enumerate(conns)))
            # Nothing applied in place: the generation row still says what ingest wrote ...
            base = await conns[0].fetchrow("SELECT pending, delivered FROM generations")
            assert (base["pending"], base["delivered"]) == (300, 0)
            assert await conns[0].fetchval("SELECT count(*) FROM gen_deltas") == 300
            # ... and readers see the exact counts all the same.
            expected = await outcomes.recount(conns[0])
            assert {(g.request_id, g.sha1): g.counts for g in await outcomes.all_generations(conns[0])} == expected

            async def folds(conn: Any) -> int:
                return sum([await outcomes.fold(conn, 50) for _ in range(3)])

            folded = await asyncio.gather(*(folds(c) for c in conns))
            assert sum(folded) == 300  # four folders at once, twelve chunks: every change exactly once
            assert await conns[0].fetchval("SELECT count(*) FROM gen_deltas") == 0
            gen = await outcomes.generation(conns[0], "task_ota_1", sha1_of(b"fw"))
            assert gen is not None and gen.counts == expected[("task_ota_1", sha1_of(b"fw"))]
            assert (gen.counts["delivered"], gen.counts["failed"], gen.counts["pending"]) == (270, 30, 0)
            assert gen.last_ms == 2_000
        finally:
            for c in conns:
                await c.close()

    asyncio.run(go())
