"""`Reads` over the embedded LMDB store: the Admin API's, progress reporting's and housekeeping's
reads, and the GC pass whose deletes go through the group committer.

Scans (stats, tables of generations, GC's mark) run in a worker thread, off the event loop that
answers hooks; O(1) reads (a table's entry count, the map's fill) run inline.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from storage.errors import StorageError
from storage.latency import Counts
from storage.lmdb import gc, latency, outcomes, policies
from storage.lmdb.keys import Row
from storage.lmdb.outcomes import Generation, OutcomeRecord, PageKey
from storage.lmdb.store import Stats, Store
from storage.lmdb.writer import GroupCommitter
from storage.model import StoredPolicy
from storage.port import GcSettings, Reads

T = TypeVar("T")


class LmdbReads:
    """The LMDB store's `Reads`. `committer` takes GC's deletes; without one (a read-only view,
    as the CLI opens a running server's data dir) `gc` refuses with StorageError."""

    def __init__(self, store: Store, committer: GroupCommitter | None = None) -> None:
        self._store = store
        self._committer = committer

    async def _in_a_snapshot(self, read: Callable[..., T], *args: Any) -> T:
        """`read(txn, tables, *args)` in one read transaction, in a worker thread."""

        def run() -> T:
            with self._store.read() as txn:
                return read(txn, self._store.tables, *args)

        return await asyncio.to_thread(run)

    async def stats(self) -> Stats:
        return await asyncio.to_thread(self._store.stats)

    async def vehicle(self, vin: str, outcomes_limit: int) -> tuple[list[Row], list[OutcomeRecord]]:
        # Two snapshots, rows first: a pair ending in between shows as pending and as ended.
        rows = await asyncio.to_thread(self._store.pending, vin)
        return rows, await self._in_a_snapshot(outcomes.vehicle_outcomes, vin, outcomes_limit)

    async def generations(self, request_id: str) -> list[Generation]:
        return await self._in_a_snapshot(outcomes.generations, request_id)

    async def generations_page(
        self, size: int, after: PageKey | None = None
    ) -> tuple[list[Generation], PageKey | None, int]:
        return await self._in_a_snapshot(outcomes.generations_page, size, after)

    async def all_generations(self) -> list[Generation]:
        return await self._in_a_snapshot(outcomes.all_generations)

    async def gc(self, settings: GcSettings, *, dry_run: bool = False) -> gc.GcReport:
        if self._committer is None:
            raise StorageError("this view of the store is read-only: GC needs its group committer")
        return await asyncio.to_thread(
            gc.collect,
            self._store,
            self._committer.submit,
            **dataclasses.asdict(settings),
            dry_run=dry_run,
        )

    async def row_count(self) -> int:
        return self._store.row_count()

    async def map_usage(self) -> float | None:
        return self._store.map_usage()

    async def vehicles_at(self, bound: int) -> int:
        return await asyncio.to_thread(self._store.vehicles_at, bound)

    async def policy(self, request_id: str) -> StoredPolicy | None:
        with self._store.read() as txn:  # one lookup: inline
            return policies.policy(txn, self._store.tables, request_id)

    async def latency(self, request_id: str) -> dict[bytes, Counts]:
        with self._store.read() as txn:  # one prefix range: inline
            return latency.of_request(txn, self._store.tables, request_id)

    async def online_pending(self, request_id: str) -> int | None:
        return None  # presence lives in the dispatch workers' memory

    async def outcome_counts(self, request_id: str) -> tuple[list[Generation], int]:
        with self._store.read() as txn:  # a few lookups of one request: inline
            t = self._store.tables
            return outcomes.generations(txn, t, request_id), outcomes.answers_failed(txn, t, request_id)


if TYPE_CHECKING:  # mypy checks that LmdbReads is a storage.port.Reads
    _is_reads: Reads = LmdbReads(Store.__new__(Store))
