"""What the server asks of a store: `Writes` and `Reads`, whichever engine is behind them.

Ingest, cancel, the expiry sweep and parked triggers go through `Writes` only; the Admin API, progress reporting and
housekeeping (GC, level gauges) through `Reads`. LMDB (`storage/lmdb/writes.py`, `reads.py`) and
PostgreSQL (`storage/postgres/writes.py`, `reads.py`) implement both. Every write returns once its
change is durable, or raises StorageError (CommitTimeout: it may still land later); results are the
values of storage/model.py, so a caller never knows which engine answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from storage.errors import CommitTimeout
from storage.latency import Counts, Increment
from storage.model import (
    PLAIN,
    BatchWritten,
    CancelChunk,
    DataWritten,
    Duplicate,
    EarlyCompleted,
    EarlyExpired,
    GcReport,
    Generation,
    OutcomeRecord,
    PageKey,
    Row,
    RowSpec,
    Stats,
    StoredPolicy,
    TriggerWritten,
)

T = TypeVar("T")


async def durable_within(write: asyncio.Future[T], timeout_s: float) -> T:
    """The result of a write in progress, waited for at most `timeout_s`; CommitTimeout then.
    The wait is shielded: a timeout ends our wait, not the write, which may still land (the
    platform's retry with its batch_id tells)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(write)
    except TimeoutError:
        raise CommitTimeout(f"commit took longer than {timeout_s} s") from None


class Writes(Protocol):
    """Durable writes of ingest, cancel and expiry, and the few reads their housekeeping needs."""

    async def store_batch(
        self,
        vins: Sequence[str],
        request_id: str,
        blob: bytes,
        now_ms: int,
        batch_id: str | None = None,
        spec: RowSpec = PLAIN,
        *,
        dry_run: bool = False,
    ) -> BatchWritten | Duplicate:
        """A seed-format batch: the blob once, a row per VIN (see ops.store_batch). With `dry_run`
        what it would return now, writing nothing (the same operation, undone before its
        transaction ends)."""
        ...

    async def store_data(self, data_id: str, blob: bytes, now_ms: int, max_rows: int, max_pending: int) -> DataWritten:
        """A plugin-format data message, completing up to `max_rows` rows of parked triggers."""
        ...

    async def store_trigger(
        self,
        data_id: str,
        vins: Sequence[str],
        request_id: str,
        now_ms: int,
        early_max: int,
        early_max_rows: int,
        batch_id: str | None = None,
        correlation_id: str | None = None,
        spec: RowSpec = PLAIN,
        *,
        dry_run: bool = False,
    ) -> TriggerWritten | Duplicate:
        """A plugin-format trigger: rows now, or parked until its data (EarlyTriggersFull). With
        `dry_run`, what it would return now, writing nothing (as `store_batch`'s)."""
        ...

    async def complete_early(self, data_id: str, now_ms: int, max_rows: int, max_pending: int) -> EarlyCompleted:
        """The next chunk of triggers waiting for `data_id`, whose data has arrived."""
        ...

    async def expire_early(self, now_ms: int, ttl_ms: int, limit: int) -> list[EarlyExpired]:
        """Drop parked triggers older than `ttl_ms`."""
        ...

    async def waiting_data_ids(self) -> list[str]:
        """data_ids whose triggers still wait although their data is stored (after a crash)."""
        ...

    async def cancel_vins(self, request_id: str, vins: Sequence[str], now_ms: int) -> CancelChunk:
        """Cancel the request for these VINs, at once."""
        ...

    async def start_cancel_all(
        self, request_id: str, now_ms: int, max_rows: int, correlation_id: str | None = None
    ) -> CancelChunk:
        """Record a cancel of every vehicle (its cut) and run its first chunk."""
        ...

    async def cancel_chunk(self, request_id: str, now_ms: int, max_rows: int) -> CancelChunk:
        """The next chunk of a cancel of every vehicle."""
        ...

    async def cancels_in_progress(self) -> list[str]:
        """Request ids whose cancel of every vehicle has chunks to go (after a crash)."""
        ...

    async def first_deadline(self) -> int | None:
        """The soonest expires_at of any row (ms), None when no row has one."""
        ...

    async def expire_due(self, now_ms: int, limit: int) -> list[tuple[str, str, bytes]]:
        """End `expired` up to `limit` rows past their expires_at: (VIN, request id, sha1) each."""
        ...

    async def set_policy(self, request_id: str, doc: bytes | None, now_ms: int, max_count: int) -> bool:
        """Set the campaign policy of `request_id` to `doc` (its JSON; None clears it); True when
        one was in force before. PoliciesFull when `max_count` others are in force."""
        ...

    async def policies(self) -> list[StoredPolicy]:
        """Every campaign policy in force, by request id (dispatch loads them at start-up)."""
        ...

    async def abort(self, request_id: str, doc: bytes, now_ms: int, max_rows: int) -> CancelChunk | None:
        """Record `doc` as the abort of `request_id` under its policy in force and start its cancel
        of every vehicle (reason "aborted"), in one transaction; from then on its batches raise
        RequestAborted. None, writing nothing, when it has no policy or that policy was aborted
        already (by another process or instance: exactly one abort wins)."""
        ...

    async def amend_abort(self, request_id: str, before: bytes, after: bytes) -> bool:
        """Replace the abort record `before` of `request_id` with `after` (the same abort, amended:
        its status event went out); False, writing nothing, when its record is not `before` any
        more (a new policy re-opened the request)."""
        ...

    async def add_latency(self, increments: Sequence[Increment]) -> None:
        """Add to the latency counts of generations: (request id, sha1, stage, bucket, count)
        each (storage/latency.py). LMDB: with the next commit (a crash may lose that window's)."""
        ...

    async def pending_vins(self, request_id: str, after: str, limit: int) -> list[str]:
        """Up to `limit` VINs with a pending row of `request_id`, in VIN order past `after`."""
        ...


@dataclass(frozen=True, slots=True)
class GcSettings:
    """One GC pass's clock and limits (times in ms); the fields are `storage.lmdb.gc.collect`'s and
    `storage.postgres.gc.collect`'s keyword arguments of the same names."""

    now_ms: int
    #: Rows, aliases and batch ids stored before now_ms - retention_ms go.
    retention_ms: int
    #: A blob nothing refers to stays while created or touched within this.
    grace_ms: int
    #: Parked triggers older than this go (their data never came).
    early_ttl_ms: int
    #: Parked triggers dropped per pass at most.
    early_limit: int
    #: Outcome records and finished generations older than this go; None: retention_ms.
    outcome_retention_ms: int | None = None


class Reads(Protocol):
    """What the Admin API, progress reporting and housekeeping read of a store, and the GC pass.

    Each answer comes from one consistent snapshot unless the method says otherwise. Failures are
    StorageError (on PostgreSQL also a read that outlives its deadline, or a lost connection), so
    the background loops can log them and carry on.
    """

    async def stats(self) -> Stats:
        """Counts and sizes of the whole store (`sdv-fanout stats`, GetStats): O(rows + blobs).
        The map fields are LMDB's alone: PostgreSQL has no memory map and answers 0 for both."""
        ...

    async def vehicle(self, vin: str, outcomes_limit: int) -> tuple[list[Row], list[OutcomeRecord]]:
        """The vehicle's pending rows in delivery order (deliverable or not), then its
        `outcomes_limit` most recent outcome records, newest first. A pair that ends while this
        reads may show in both lists, never in neither."""
        ...

    async def generations(self, request_id: str) -> list[Generation]:
        """The generations of `request_id`, newest first by first change; empty when none is stored."""
        ...

    async def generations_page(
        self, size: int, after: PageKey | None = None
    ) -> tuple[list[Generation], PageKey | None, int]:
        """Up to `size` generations newest first by last change (then by key, descending),
        starting past `after`; the place of the last one when more follow (the next page's
        `after`), and how many generations there are in all (`outcomes.generations_page`).
        A place names the same generation on either store, so a page token outlives a restart."""
        ...

    async def all_generations(self) -> list[Generation]:
        """Every generation, newest first by last change (what progress reporting compares)."""
        ...

    async def gc(self, settings: GcSettings, *, dry_run: bool = False) -> GcReport:
        """One GC pass (`storage.lmdb.gc.collect`'s steps, order and report) in short transactions,
        so ingest and dispatch keep going while it runs; `dry_run` counts and changes nothing.
        Not bounded by a read deadline: a pass takes as long as the store is large."""
        ...

    async def row_count(self) -> int:
        """Pending rows in the whole store (O(1) on LMDB; on PostgreSQL the generations' pending
        counts summed, O(generations))."""
        ...

    async def map_usage(self) -> float | None:
        """Used pages over the LMDB map size (how close StorageFull is); None where there is no
        map to fill (PostgreSQL grows its files as needed)."""
        ...

    async def vehicles_at(self, bound: int) -> int:
        """Vehicles with at least `bound` pending rows (their new rows are refused)."""
        ...

    async def policy(self, request_id: str) -> StoredPolicy | None:
        """The campaign policy of `request_id` in force, or None."""
        ...

    async def latency(self, request_id: str) -> dict[bytes, Counts]:
        """The delivery latency counts of each generation of `request_id` that has any, by sha1
        (storage/latency.py: stage -> bucket -> count)."""
        ...

    async def online_pending(self, request_id: str) -> int | None:
        """Pending rows of `request_id` whose vehicle is online now, where the store keeps
        presence (PostgreSQL); None where only the server's memory does (LMDB)."""

    async def outcome_counts(self, request_id: str) -> tuple[list[Generation], int]:
        """The generations of `request_id` (as `generations`) and how many of its answers had
        "status" failed or rejected (`model.answer_failed`), read together."""
        ...
