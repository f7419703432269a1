"""`Reads` over PostgreSQL: the Admin API's, progress reporting's and housekeeping's reads, and the
GC pass (storage/postgres/gc.py), on a bounded asyncpg pool.

Each read is one REPEATABLE READ, READ ONLY transaction (one snapshot, as an LMDB read) bounded by
`timeout_s`; asyncpg and connection failures come out as StorageError, so the background loops
that suppress StorageError on LMDB do the same here. The answers are the LMDB reads' dataclasses,
orders and page places (tested side by side in tests/unit/test_store_parity_reads.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

from storage import model
from storage.errors import StorageError
from storage.latency import Counts
from storage.model import GcReport, Generation, OutcomeRecord, PageKey, Stats, StoredPolicy
from storage.port import GcSettings, Reads
from storage.postgres import gc as pg_gc
from storage.postgres import latency, outcomes, policies, queue
from storage.postgres.errors import as_storage_error
from storage.postgres.types import Connection, Pool, fetch_one

T = TypeVar("T")
P = ParamSpec("P")

# One statement: one snapshot even outside a transaction. length(bytea) reads the stored size
# without detoasting the payload.
_STATS = """
SELECT r.n AS rows, r.logical AS logical_bytes, b.n AS blobs, b.bytes AS blob_bytes,
       (SELECT count(*) FROM aliases) AS aliases,
       (SELECT count(*) FROM early_triggers) AS early_triggers,
       (SELECT coalesce(max(version), 0) FROM schema_version) AS schema_version
FROM (SELECT count(*) AS n, coalesce(sum(size), 0)::bigint AS logical FROM rows) r,
     (SELECT count(*) AS n, coalesce(sum(length(data)), 0)::bigint AS bytes FROM blobs) b
"""
# ListRequests' order is LMDB's `gens` key order, descending: (last_ms, request id, NUL, sha1).
# With request ids COLLATE "C" (bytes, and text never holds a NUL) that is (last_ms, request_id,
# sha1). A page token's place is compared as those key bytes, so any place LMDB accepts means
# the same here; `last_ms <= $1` first lets the scan start at the place.
_PAGE_FIRST = "SELECT * FROM generation_counts ORDER BY last_ms DESC, request_id DESC, sha1 DESC LIMIT $1"
_PAGE_AFTER = """
SELECT * FROM generation_counts
WHERE last_ms <= $1 AND (last_ms < $1 OR convert_to(request_id, 'UTF8') || '\\x00'::bytea || sha1 < $2)
ORDER BY last_ms DESC, request_id DESC, sha1 DESC LIMIT $3
"""
_VEHICLES_AT = "SELECT sdv_vehicles_at($1)"


async def stats(conn: Connection) -> Stats:
    """The store's counts and sizes (as `Store.stats`); the LMDB map fields are 0: there is no map."""
    r = await fetch_one(conn, _STATS)
    return Stats(
        rows=int(r["rows"]),
        blobs=int(r["blobs"]),
        blob_bytes=int(r["blob_bytes"]),
        logical_bytes=int(r["logical_bytes"]),
        aliases=int(r["aliases"]),
        early_triggers=int(r["early_triggers"]),
        map_size_bytes=0,
        map_used_bytes=0,
        schema_version=int(r["schema_version"]),
    )


async def generations_page(
    conn: Connection, limit: int, after: PageKey | None = None
) -> tuple[list[Generation], PageKey | None, int]:
    """Up to `limit` generations newest first by last change, starting past `after`; the place of
    the last one when more follow, and how many there are in all (as `outcomes.generations_page`).
    Run it in one snapshot: the page and the total then agree."""
    want = max(limit, 1) + 1  # one more than shown tells whether more follow
    if after is None:
        found = await conn.fetch(_PAGE_FIRST, want)
    else:
        found = await conn.fetch(_PAGE_AFTER, after[0], after[1], want)
    page = [outcomes.generation_of(r) for r in found[:limit]]
    total = int(await conn.fetchval("SELECT count(*) FROM generations"))
    more = bool(page) and len(found) > len(page)
    return page, (page[-1].last_ms, model.generation_key(page[-1].request_id, page[-1].sha1)) if more else None, total


async def vehicle(conn: Connection, vin: str, outcomes_limit: int) -> tuple[list[model.Row], list[OutcomeRecord]]:
    """The vehicle's pending rows in delivery order and its most recent outcomes."""
    return await queue.pending(conn, vin), await outcomes.vehicle_outcomes(conn, vin, outcomes_limit)


async def row_count(conn: Connection) -> int:
    """Pending rows: the sum of the generations' pending counts, which every write of a row keeps
    in its transaction (tests: the recounts of test_pg_batch_statement and the parity suites), so
    the leader's gauge reads O(generations) every 30 s, not a pass over a table of millions."""
    return int(await conn.fetchval("SELECT coalesce(sum(pending), 0) FROM generation_counts"))


async def vehicles_at(conn: Connection, bound: int) -> int:
    """Vehicles with at least `bound` pending rows (`sdv_vehicles_at`, sql/functions/bound.sql): above a bound
    of 64 only the vehicles listed in `crowded` are counted, as only they can be there."""
    return int(await conn.fetchval(_VEHICLES_AT, bound))


async def online_pending(conn: Connection, request_id: str) -> int:
    """Pending rows of `request_id` whose vehicle is in `presence` (the request's rows by their
    index, one presence probe each)."""
    return int(await conn.fetchval(_ONLINE_PENDING, request_id))


_ONLINE_PENDING = """
SELECT count(*) FROM rows r WHERE r.request_id = $1 AND EXISTS (SELECT 1 FROM presence p WHERE p.vin = r.vin)
"""


async def outcome_counts(conn: Connection, request_id: str) -> tuple[list[Generation], int]:
    """The generations of `request_id` and its failed answers (`answer_failures`), in the caller's snapshot."""
    failed = await conn.fetchval("SELECT count(*) FROM answer_failures WHERE request_id = $1", request_id)
    return await outcomes.generations(conn, request_id), int(failed)


#: What a failure of PostgreSQL or of the way to it looks like from asyncpg.


class PgReads:
    """The PostgreSQL store's `Reads` (storage/port.py)."""

    def __init__(self, pool: Pool, timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = timeout_s

    async def _read(self, fn: Callable[Concatenate[Connection, P], Awaitable[T]], *args: P.args, **kw: P.kwargs) -> T:
        """`fn(conn, *args)` in one read-only snapshot, within the deadline (the wait for a pooled
        connection included); a read cancelled at the deadline changes nothing."""

        async def in_a_snapshot() -> T:
            async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
                return await fn(conn, *args, **kw)

        try:
            async with asyncio.timeout(self._timeout_s):
                return await as_storage_error(in_a_snapshot())
        except TimeoutError:
            raise StorageError(f"read took longer than {self._timeout_s} s") from None

    async def stats(self) -> Stats:
        return await self._read(stats)

    async def vehicle(self, vin: str, outcomes_limit: int) -> tuple[list[model.Row], list[OutcomeRecord]]:
        return await self._read(vehicle, vin, outcomes_limit)

    async def generations(self, request_id: str) -> list[Generation]:
        return await self._read(outcomes.generations, request_id)

    async def generations_page(
        self, size: int, after: PageKey | None = None
    ) -> tuple[list[Generation], PageKey | None, int]:
        return await self._read(generations_page, size, after)

    async def all_generations(self) -> list[Generation]:
        return await self._read(outcomes.all_generations)

    async def gc(self, settings: GcSettings, *, dry_run: bool = False) -> GcReport:
        # One pooled connection for the whole pass, no deadline: its chunks are short
        # transactions of their own, the pass as long as the store is large.
        async def on_a_connection() -> GcReport:
            async with self._pool.acquire() as conn:
                return await pg_gc.collect(conn, **dataclasses.asdict(settings), dry_run=dry_run)

        return await as_storage_error(on_a_connection())

    async def row_count(self) -> int:
        return await self._read(row_count)

    async def map_usage(self) -> float | None:
        return None  # no memory map to fill: PostgreSQL grows its files as needed

    async def vehicles_at(self, bound: int) -> int:
        return await self._read(vehicles_at, bound)

    async def policy(self, request_id: str) -> StoredPolicy | None:
        return await self._read(policies.policy, request_id)

    async def online_pending(self, request_id: str) -> int | None:
        return await self._read(online_pending, request_id)

    async def outcome_counts(self, request_id: str) -> tuple[list[Generation], int]:
        return await self._read(outcome_counts, request_id)

    async def latency(self, request_id: str) -> dict[bytes, Counts]:
        return await self._read(latency.of_request, request_id)


if TYPE_CHECKING:  # mypy checks that PgReads is a storage.port.Reads

    def _is_reads(pool: Pool) -> Reads:
        return PgReads(pool, 0.0)
