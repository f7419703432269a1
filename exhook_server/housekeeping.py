"""Periodic background work of a running server: garbage collection and gauge refresh.

Everything here reads the store through its `Reads` port (storage/port.py), so it runs the same
over LMDB or PostgreSQL. A GC pass deletes in short chunks (LMDB: in a worker thread, through the
group committer), so hooks keep answering while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from exhook_server import metrics
from exhook_server.config import Config
from exhook_server.dispatch.port import Dispatch
from exhook_server.parked import report_expired
from exhook_server.status import StatusPublisher
from storage.errors import StorageError
from storage.model import GcReport, now_ms
from storage.port import GcSettings, Reads

log = structlog.get_logger("sdv_fanout.gc")

#: The in-broker plugin's rule: the first GC comes after min(30 min, interval).
FIRST_GC_MAX_DELAY_S = 1800.0


async def run_gc(cfg: Config, reads: Reads, *, dry_run: bool = False) -> GcReport:
    """One GC pass with the configured retention and grace."""
    settings = GcSettings(
        now_ms=now_ms(),
        retention_ms=int(cfg.retention_s * 1000),
        grace_ms=int(cfg.gc_grace_s * 1000),
        early_ttl_ms=int(cfg.early_ttl_s * 1000),
        early_limit=cfg.early_max_count,
        outcome_retention_ms=int(cfg.outcome_retention * 1000),
    )
    return await reads.gc(settings, dry_run=dry_run)


async def gc_loop(cfg: Config, reads: Reads, status: StatusPublisher | None = None) -> None:
    """Forever: GC every gc_interval_s; failures are logged and counted, never fatal."""
    if not cfg.gc_interval_s:
        return
    await asyncio.sleep(min(FIRST_GC_MAX_DELAY_S, cfg.gc_interval_s))
    while True:
        try:
            report = await run_gc(cfg, reads)
        except StorageError as exc:
            metrics.GC_RUNS.labels("failed").inc()
            log.error("gc_failed", reason=type(exc).__name__, detail=str(exc))
        else:
            metrics.GC_RUNS.labels("ok").inc()
            for kind, n in (
                ("rows", report.rows_expired),
                ("aliases", report.aliases_expired),
                ("blobs", report.blobs_deleted),
                ("early", report.early_expired),
            ):
                metrics.GC_DELETED.labels(kind).inc(n)
            report_expired(report.expired_early, status)
            log.info("gc_finished", **report.as_dict())
        await asyncio.sleep(cfg.gc_interval_s)


async def tick_loop(dispatcher: Dispatch, reads: Reads, interval_s: float = 5.0, gauges: bool = True) -> None:
    """Every few seconds: re-send timed-out deliveries and, with `gauges`, refresh the level
    gauges for scrapes (PostgreSQL mode leaves them to one instance, see `gauge_loop`)."""
    while True:
        dispatcher.sweep()
        if gauges:
            await refresh_gauges(dispatcher, reads)
        await asyncio.sleep(interval_s)


async def refresh_gauges(dispatcher: Dispatch, reads: Reads) -> None:
    """Online vehicles, deliveries in flight, pending rows, LMDB map usage."""
    dispatcher.refresh_gauges()
    with contextlib.suppress(StorageError):
        metrics.PENDING_ROWS.set(await reads.row_count())
        usage = await reads.map_usage()
        if usage is not None:  # a store without a map (PostgreSQL) leaves the gauge unset
            metrics.MAP_USAGE.set(usage)


#: How often the PostgreSQL leader refreshes the deployment-wide level gauges (counts over tables).
SHARED_GAUGE_INTERVAL_S = 30.0


async def gauge_loop(dispatcher: Dispatch, reads: Reads, interval_s: float = SHARED_GAUGE_INTERVAL_S) -> None:
    """PostgreSQL mode, in the leader only: the level gauges are counts over shared tables, the same
    from every instance, so one instance reports them (summed over pods they stay right) and not
    every few seconds."""
    while True:
        await refresh_gauges(dispatcher, reads)
        await asyncio.sleep(interval_s)


#: How often the vehicles-at-bound gauge is recounted (a pass over the vehicles with rows).
BACKLOG_GAUGE_INTERVAL_S = 60.0


async def backlog_gauge_loop(cfg: Config, reads: Reads, interval_s: float = BACKLOG_GAUGE_INTERVAL_S) -> None:
    """Every minute: count the vehicles at max_pending_per_vehicle (their new rows are refused).
    A pass over the per-vehicle counts (LMDB, in a thread: O(vehicles with pending rows)) or, on
    PostgreSQL, over the vehicles listed at half the bound (storage/postgres/sql/functions/bound.sql; a bound of 64
    or less: over the rows)."""
    if not cfg.max_pending_per_vehicle:
        return
    while True:
        with contextlib.suppress(StorageError):
            full = await reads.vehicles_at(cfg.max_pending_per_vehicle)
            metrics.VEHICLES_AT_BOUND.set(full)
        await asyncio.sleep(interval_s)
