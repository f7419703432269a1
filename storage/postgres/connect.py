"""Connections to the PostgreSQL store: a server instance's pool, a tool's pool of one, and a
connection of its own (the leader's) that a cancel neither loses nor leaks.

Every pool connection runs with `synchronous_commit = on`: a commit returns once the synchronous
standby has the WAL, so a batch whose hook answered survives the loss of the primary. A failed
connect of a tool is a StorageError naming store_url.
"""

from __future__ import annotations

import asyncio

import asyncpg

from storage.errors import StorageError
from storage.postgres.types import Pool

#: How long a tool's connect may take.
_TOOL_CONNECT_S = 10.0


def instance_pool(
    url: str, *, size: int, connect_timeout_s: float, command_timeout_s: float, stall_ms: int, lock_timeout_ms: int
) -> Pool:
    """A server instance's pool (not connected yet: `await` it). `stall_ms` bounds a transaction
    left idle, `lock_timeout_ms` a wait for another session's lock."""
    return asyncpg.create_pool(
        url,
        min_size=1,
        max_size=size,
        timeout=connect_timeout_s,
        command_timeout=command_timeout_s,
        server_settings={
            "synchronous_commit": "on",
            "application_name": "sdv-fanout",
            # Every statement of ours is short. Planner estimates over tables without statistics
            # yet (a new database, a fast-growing table) can pass jit_above_cost, and compiling
            # then takes milliseconds per execution: 7 ms per batch for the backlog probe, more
            # than the batch's whole write (auto_explain, bench/pg_serve.py).
            "jit": "off",
            # An instance stopped (SIGSTOP, a hung VM) inside a transaction would keep its locks,
            # a vehicle's included, for as long as it is stopped: every instance's events for that
            # vehicle, and the lane behind them, would wait. Our transactions are a few statements
            # back to back, so PostgreSQL ends one left idle this long and frees its locks.
            # A stall inside a statement is not covered: see `pgmode.end_stalled`.
            "idle_in_transaction_session_timeout": str(stall_ms),
            # Our transactions hold a lock for milliseconds; a statement that waits longer waits
            # for someone else's (another session holding a vehicle's rows, a stalled instance).
            # It gives up after this (well under ingest_timeout_s): the batch answers UNAVAILABLE
            # (LockTimeout), a vehicle event is dropped for its next trigger, and the connection
            # is free again at once, so one locked vehicle cannot hold the pool.
            "lock_timeout": str(lock_timeout_ms),
        },
        reset=_keep_session,
    )


async def _keep_session(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    """The pool's reset on release, left empty: asyncpg's default (unlock advisory locks, close
    cursors, UNLISTEN, RESET ALL) is a round trip per release, and the store leaves nothing to
    reset: locks are transaction-level, cursors live inside transactions, nothing LISTENs or
    SETs outside one (the leader's session lock has a connection of its own)."""


async def tool_pool(url: str) -> Pool:
    """A connected pool of one connection, for a command of the CLI."""
    try:
        return await asyncpg.create_pool(url, min_size=1, max_size=1, timeout=_TOOL_CONNECT_S)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        raise StorageError(f"cannot connect to store_url: {exc}") from None


async def own_connection(
    url: str, *, timeout_s: float, cancel_wait_s: float, application_name: str
) -> asyncpg.Connection[asyncpg.Record]:
    """A connection of its own, opened so that a cancel neither gets lost nor leaks it: asyncpg's
    connect, cancelled as it completes, may hand back the connection or drop it unclosed. The
    connect runs shielded; if we are cancelled meanwhile, whatever it opens is closed at once,
    and the cancel waits (up to `cancel_wait_s`) for the connect to end: a stopping server's
    loop must not close over it, pending with its socket open."""
    opening = asyncio.ensure_future(
        asyncpg.connect(url, timeout=timeout_s, server_settings={"application_name": application_name})
    )
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_terminate_opened)
        await asyncio.wait([opening], timeout=cancel_wait_s)
        raise


def _terminate_opened(opening: asyncio.Future[asyncpg.Connection[asyncpg.Record]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().terminate()
