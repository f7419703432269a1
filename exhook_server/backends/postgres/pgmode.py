"""PostgreSQL: what a server instance needs around the store: its connection pool, the schema at
start, a watch on the database's reachability, and the one-instance jobs.

Connections are asyncpg's pool (storage/postgres/connect.py): a connection the database dropped
(restart, failover) is replaced on the next acquire, so an instance reconnects by itself; a
multi-host `store_url` with `target_session_attrs=read-write` lands on whichever host is the
primary.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from exhook_server import metrics
from exhook_server.aio import cancel_all
from exhook_server.backends.postgres.dispatch import SharedDispatcher
from exhook_server.config import Config
from storage.errors import StorageError
from storage.postgres import connect, migrate, outcomes
from storage.postgres.constants import LEADER_LOCK, LockClass
from storage.postgres.errors import FAILURES, raise_if_cancelling
from storage.postgres.types import Connection, Pool

log = structlog.get_logger("sdv_fanout.store")

#: The application_name of the leader's own connection (the pool's is "sdv-fanout"): how
#: `end_stalled` finds it without reading pg_locks.
LEADER_APPLICATION = "sdv-fanout-leader"
#: How long a connect or a probe may take before it counts as a failure.
_PROBE_TIMEOUT_S = 2.0


def stall_bound_s(cfg: Config) -> float:
    """How long a transaction of ours may stall before the database or `end_stalled` ends it:
    longer than any event or ingest lets its own statements run (ingest_timeout_s), at least 5 s."""
    return max(cfg.ingest_timeout_s, 5.0)


def create_pool(cfg: Config) -> Pool:
    """The instance's pool (not connected yet: `await` it, see `prepare`)."""
    return connect.instance_pool(
        cfg.store_url,
        size=cfg.store_pool_size,
        connect_timeout_s=_PROBE_TIMEOUT_S * 5,
        command_timeout_s=max(cfg.ingest_timeout_s * 2, 10.0),
        stall_ms=round(stall_bound_s(cfg) * 1000),
        lock_timeout_ms=round(cfg.lock_timeout_s * 1000),
    )


async def prepare(pool: Pool, timeout_s: float = 60.0) -> None:
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


async def probe(pool: Pool) -> bool:
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
    pool: Pool, grace_s: float, on_change: Callable[[bool], Awaitable[None]], interval_s: float = 1.0
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
    once: another instance takes over within `retry_s`; a stopped one's connection is ended by
    the others (`end_stalled`) once it has been silent for `stall_bound_s`."""
    while True:
        conn: Connection | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            conn = await _connect(cfg.store_url)
            while not tasks:
                if await conn.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK, timeout=_PROBE_TIMEOUT_S):
                    log.info("leading", jobs="gc, progress, gauges, fold, wake-idle, catchup")
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


async def _connect(url: str) -> Connection:
    """The leader's connection of its own (`connect.own_connection`: a cancel neither loses nor leaks it)."""
    return await connect.own_connection(
        url, timeout_s=_PROBE_TIMEOUT_S * 5, cancel_wait_s=_PROBE_TIMEOUT_S, application_name=LEADER_APPLICATION
    )


async def fold_loop(pool: Pool, interval_s: float = 1.0, limit: int = 10_000) -> None:
    """Forever (in the leader): move the count changes acks appended into their generations
    (`gen_deltas`, storage/postgres/sql/schema.sql), a chunk per transaction, so readers' sums stay short."""
    while True:
        try:
            async with pool.acquire() as conn:
                for _ in range(100):  # bounded; the next round goes on
                    if await outcomes.fold(conn, limit) < limit:
                        break
        except (*FAILURES, TimeoutError) as exc:
            raise_if_cancelling()
            log.warning("fold_failed", error=repr(exc))
        await asyncio.sleep(interval_s)


async def wake_idle_loop(dispatcher: SharedDispatcher, interval_s: float) -> None:
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


@dataclass(frozen=True, slots=True)
class Stalled:
    """A session `end_stalled` ended: its backend pid, state, wait, how long it had stalled (its
    transaction's age, or a leader's silence) and its last statement."""

    pid: int
    state: str
    wait: str
    age_s: float
    query: str


# Sessions of our instances (this role; never a psql's or a benchmark's) stalled for longer than
# $1 ms: a pool session in a transaction that old, or a leader's connection idle that long (a
# live leader runs a statement every `lead` retry_s). The cheap first look, so that pg_locks (it
# takes the lock manager's partition locks) is read only when some session is that old.
_OLD_SESSIONS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND usename = current_user AND pid <> pg_backend_pid()
    AND ((application_name = current_setting('application_name')
            AND xact_start < clock_timestamp() - $1::bigint * interval '1 millisecond')
        OR (application_name = $2 AND state = 'idle'
            AND state_change < clock_timestamp() - $1::bigint * interval '1 millisecond'))
"""

# Of those, the ones still stalled and holding a vehicle's or a request's lock, or the leader's: ended.
_END_STALLED = f"""
SELECT a.pid, coalesce(a.state, '') AS state,
    coalesce(a.wait_event_type || ':' || a.wait_event, '') AS wait,
    extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.state_change))::float8 AS age_s,
    left(a.query, 80) AS query, pg_terminate_backend(a.pid) AS ended
FROM pg_stat_activity a
WHERE a.pid = ANY($2::int[])
    AND ((a.xact_start < clock_timestamp() - $1::bigint * interval '1 millisecond'
            AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
                        AND l.classid IN ({int(LockClass.VEHICLE)}, {int(LockClass.REQUEST)}) AND l.objsubid = 2))
        OR (a.state = 'idle' AND a.state_change < clock_timestamp() - $1::bigint * interval '1 millisecond'
            AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
                        AND l.classid = {LEADER_LOCK >> 32} AND l.objid = {LEADER_LOCK & 0xFFFF_FFFF}
                        AND l.objsubid = 1)))
"""


async def end_stalled(pool: Pool, older_than_s: float) -> list[Stalled]:
    """End the sessions of stalled instances that hold a lock others wait for: one that has held
    a vehicle's lock, or a request's (a plugin-format batch's transaction: a cancel of every
    vehicle and that request's other batches wait on its locks), for longer than `older_than_s` in
    one transaction, and a leader's connection silent that long; so the lock, or the lead, is free
    again.

    idle_in_transaction_session_timeout ends a transaction whose client stalled between
    statements, not one whose client stalled inside a statement: asyncpg prepares a statement
    with Parse, Describe and Flush (no Sync) and only then sends Bind, Execute and Sync, so an
    instance stopped (SIGSTOP, a frozen VM) between the two leaves its backend "active", waiting
    for the client, with the vehicle's lock held for as long as the instance is stopped, and no
    PostgreSQL 15 timeout applies (statement_timeout is ignored while the backend reads from its
    client; transaction_timeout exists from 17 on). Every instance's events for that vehicle wait
    on the lock, and so does the lane behind each. A vehicle event is a few short statements, and
    its own instance gives it up after its event timeout (ingest_timeout_s, below `older_than_s`):
    a transaction that has held a vehicle's lock longer belongs to a stalled instance.

    The leader's session lock lives on an idle connection, which no timeout ends: a stopped
    leader kept the lead, and its jobs (the idle vehicles' wake-up among them) stopped for as
    long as it was. A live leader runs a statement every `lead` retry_s (2 s)."""
    ms = round(older_than_s * 1000)
    async with asyncio.timeout(_PROBE_TIMEOUT_S * 2), pool.acquire() as conn:
        old = [r["pid"] for r in await conn.fetch(_OLD_SESSIONS, ms, LEADER_APPLICATION)]
        if not old:
            return []
        found = await conn.fetch(_END_STALLED, ms, old)
    return [Stalled(r["pid"], r["state"], r["wait"], round(r["age_s"], 1), r["query"]) for r in found if r["ended"]]


async def end_stalled_loop(pool: Pool, older_than_s: float, interval_s: float = 1.0) -> None:
    """Forever (in every instance: the stalled one may be the leader), every `interval_s`:
    `end_stalled`, so a vehicle's lock held by a stopped instance is free again within
    `older_than_s` + `interval_s`, and the lead a stopped leader held passes to another
    instance within that and `lead`'s retry_s."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            for s in await end_stalled(pool, older_than_s):
                metrics.STALLED_SESSIONS_ENDED.inc()
                log.warning(
                    "stalled_session_ended", pid=s.pid, state=s.state, wait=s.wait, age_s=s.age_s, query=s.query
                )
        except (*FAILURES, TimeoutError) as exc:
            raise_if_cancelling()
            log.warning("end_stalled_failed", error=repr(exc))
