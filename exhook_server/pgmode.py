"""What a server instance needs around the PostgreSQL store: its connection pool, the schema at
start, a watch on the database's reachability, and the one-instance jobs.

Connections are asyncpg's pool: a connection the database dropped (restart, failover) is
replaced on the next acquire, so an instance reconnects by itself; a multi-host `store_url` with
`target_session_attrs=read-write` lands on whichever host is the primary now. Every connection
runs with `synchronous_commit = on`: a commit returns once the synchronous standby has the WAL,
so a batch whose hook answered survives the loss of the primary.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import asyncpg
import structlog

from exhook_server import metrics
from exhook_server.aio import cancel_all
from exhook_server.config import Config
from storage.errors import StorageError
from storage.pg import counts, migrate
from storage.pg.errors import FAILURES, raise_if_cancelling

log = structlog.get_logger("sdv_fanout.store")

#: Session-level advisory lock of the instance that runs the jobs one instance should run
#: (progress reports, GC): whoever holds it leads; its connection's end frees it.
LEADER_KEY = 0x5344_5646_4C45_4144
#: How long a connect or a probe may take before it counts as a failure.
_PROBE_TIMEOUT_S = 2.0


def create_pool(cfg: Config) -> Any:
    """The instance's pool (not connected yet: `await` it, see `prepare`)."""
    return asyncpg.create_pool(
        cfg.store_url,
        min_size=1,
        max_size=cfg.store_pool_size,
        timeout=_PROBE_TIMEOUT_S * 5,
        command_timeout=max(cfg.ingest_timeout_s * 2, 10.0),
        server_settings={
            "synchronous_commit": "on",
            "application_name": "sdv-fanout",
            # An instance stopped (SIGSTOP, a hung VM) inside a transaction would keep its locks,
            # a vehicle's included, for as long as it is stopped: every instance's events for that
            # vehicle, and the lane behind them, would wait. Our transactions are a few statements
            # back to back, so PostgreSQL ends one left idle this long and frees its locks.
            "idle_in_transaction_session_timeout": str(round(max(cfg.ingest_timeout_s, 5.0) * 1000)),
        },
        reset=_keep_session,
    )


async def _keep_session(conn: Any) -> None:
    """The pool's reset on release, left empty: asyncpg's default (unlock advisory locks, close
    cursors, UNLISTEN, RESET ALL) is a round trip per release, and the store leaves nothing to
    reset: locks are transaction-level, cursors live inside transactions, nothing LISTENs or
    SETs outside one (the leader's session lock has a connection of its own)."""


async def prepare(pool: Any, timeout_s: float = 60.0) -> None:
    """Connect the pool and bring the schema to this release (under the migration's advisory
    lock: instances starting together migrate once). Retries while the database is not reachable
    (it may be starting beside us), up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        try:
            await pool
            async with pool.acquire() as conn:
                applied = await migrate.migrate(conn)
            if applied:
                log.info("schema_migrated", versions=applied)
            return
        except (*FAILURES, TimeoutError) as exc:
            raise_if_cancelling()
            if time.monotonic() + delay > deadline:
                raise StorageError(f"cannot reach the PostgreSQL store: {exc}") from None
            log.warning("store_unreachable", error=repr(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def probe(pool: Any) -> bool:
    """One `SELECT 1` through the pool within a short deadline."""
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            async with pool.acquire() as conn:
                await conn.fetchval("SELECT 1")
        return True
    except (*FAILURES, TimeoutError):
        raise_if_cancelling()
        return False


async def watch(
    pool: Any, grace_s: float, on_change: Callable[[bool], Awaitable[None]], interval_s: float = 1.0
) -> None:
    """Forever: probe the database every `interval_s`; once it has been unreachable for
    `grace_s`, report it down (health NOT_SERVING), and up again at the first good probe."""
    down_since: float | None = None
    reported_up = True
    while True:
        ok = await probe(pool)
        now = time.monotonic()
        metrics.DB_UP.set(1 if ok else 0)
        if ok:
            down_since = None
            if not reported_up:
                reported_up = True
                log.info("store_reachable_again")
                await on_change(True)
        else:
            if down_since is None:
                down_since = now
                log.warning("store_unreachable")
            if reported_up and now - down_since >= grace_s:
                reported_up = False
                log.error("store_down", for_s=round(now - down_since, 1))
                await on_change(False)
        await asyncio.sleep(interval_s)


async def lead(cfg: Config, jobs: Callable[[], list[Coroutine[Any, Any, None]]], retry_s: float = 2.0) -> None:
    """Forever: try to become the leader (a session advisory lock on a connection of its own,
    asked again every `retry_s`); while leading, run `jobs()`; if that connection is lost, stop
    them and start over. A leader killed outright loses its connection, and with it the lock, at
    once: another instance takes over within `retry_s`."""
    while True:
        conn: Any = None
        tasks: list[asyncio.Task[None]] = []
        try:
            conn = await _connect(cfg.store_url)
            while not tasks:
                if await conn.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_KEY, timeout=_PROBE_TIMEOUT_S):
                    log.info("leading", jobs="gc, progress, gauges, fold, wake-idle")
                    tasks = [asyncio.create_task(job, name=getattr(job, "__qualname__", None)) for job in jobs()]
                else:
                    await asyncio.sleep(retry_s)
            while True:  # leading: the lock lives as long as this connection
                await conn.fetchval("SELECT 1", timeout=_PROBE_TIMEOUT_S)
                await asyncio.sleep(retry_s)
        except (*FAILURES, TimeoutError) as exc:
            raise_if_cancelling()
            log.warning("leader_connection_lost", error=repr(exc))
        finally:
            await cancel_all(tasks)
            if conn is not None:
                conn.terminate()  # at once, and it cannot be interrupted: the lock goes with it
        await asyncio.sleep(retry_s)


async def _connect(url: str) -> Any:
    """A connection of its own, opened so that a cancel neither gets lost nor leaks it: asyncpg's
    connect, cancelled as it completes, may hand back the connection or drop it unclosed. The
    connect runs shielded; if we are cancelled meanwhile, whatever it opens is closed at once."""
    opening = asyncio.ensure_future(asyncpg.connect(url, timeout=_PROBE_TIMEOUT_S * 5))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_terminate_opened)
        raise


def _terminate_opened(opening: asyncio.Future[Any]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().terminate()


async def fold_loop(pool: Any, interval_s: float = 1.0, limit: int = 10_000) -> None:
    """Forever (in the leader): move the count changes acks appended into their generations
    (storage/pg/deltas.sql), a chunk per transaction, so readers' sums stay short."""
    while True:
        try:
            async with pool.acquire() as conn:
                for _ in range(100):  # bounded; the next round goes on
                    if await counts.fold(conn, limit) < limit:
                        break
        except (*FAILURES, TimeoutError) as exc:
            raise_if_cancelling()
            log.warning("fold_failed", error=repr(exc))
        await asyncio.sleep(interval_s)


async def wake_idle_loop(dispatcher: Any, interval_s: float) -> None:
    """Forever (in the leader), every `interval_s`: a pass over the online vehicles that have work
    and a free slot, an event each. An instance killed between storing a batch and dispatching it
    leaves its online vehicles idle until their next heartbeat or reconnect; this bounds that
    wait without heartbeats too (bounded pages; a quiet fleet costs one probe per online VIN)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await dispatcher.wake_idle()
        except (*FAILURES, TimeoutError) as exc:
            raise_if_cancelling()
            log.warning("wake_idle_failed", error=repr(exc))
