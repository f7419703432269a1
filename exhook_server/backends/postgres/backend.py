"""The PostgreSQL store as a backend: the pool at store_url, dispatch where any instance handles
any vehicle, and the jobs of an instance (every instance resumes and sweeps and listens for
policies set elsewhere; the leader collects).

A server's pool is connected in `start`, retried while the database is out of reach, and brings
the schema to this release; a tool's is one connection, connected on entry, that fails at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

from exhook_server import housekeeping, metrics
from exhook_server.aio import Job
from exhook_server.backends.postgres import pgmode
from exhook_server.backends.postgres.dispatch import SharedDispatcher
from exhook_server.backends.postgres.policy_sync import PolicySync
from exhook_server.config import Config
from exhook_server.dispatch.pacing import Budget, Lease
from exhook_server.dispatch.port import Dispatch, DispatchNeeds
from storage.errors import StorageError
from storage.model import ApplyReport, StoredPolicy
from storage.port import Reads, Writes
from storage.postgres import connect, migrate
from storage.postgres import pacing as pg_pacing
from storage.postgres.errors import PostgresError
from storage.postgres.plan import PgTarget
from storage.postgres.reads import PgReads
from storage.postgres.types import Pool
from storage.postgres.writes import PgWrites


class PgBackend:
    """One instance's view of the PostgreSQL store (see the module docstring)."""

    #: Level gauges are counts over shared tables: the leader reports them (`gauge_loop`).
    local_gauges = False
    #: Every instance resumes what a crash left and sweeps (their statements skip what another holds).
    runs_store_jobs = True

    def __init__(self, cfg: Config, *, op_timeout_s: float, tool: bool) -> None:
        self.cfg = cfg
        self._op_timeout_s = op_timeout_s
        self._tool = tool
        #: The connection pool: a server's is created here and connected in `start`, a tool's on entry.
        self.pool: Pool | None = None
        self._reads: Reads | None = None
        self._writes: PgWrites | None = None
        self._dispatcher: SharedDispatcher | None = None
        #: Puts a policy another instance (or process) stored in force here, at its notice.
        self.on_policy: Callable[[str, bytes | None, int], None] | None = None
        #: Puts every policy in force here, read again when the policy listener (re)connects.
        self.on_policies: Callable[[list[StoredPolicy]], None] | None = None
        self._sync: PolicySync | None = None
        if not tool:
            self._use(pgmode.create_pool(cfg))
            self._sync = PolicySync(
                cfg.store_url,
                self._connected_pool,
                min(cfg.policy_propagation_timeout_s, cfg.ingest_timeout_s / 2),
                on_policy=self._policy_told,
                on_policies=self._policies_read,
            )

    def _use(self, pool: Pool) -> None:
        self.pool = pool
        self._reads = PgReads(pool, self._op_timeout_s)
        self._writes = PgWrites(pool, self._op_timeout_s)

    @property
    def reads(self) -> Reads:
        assert self._reads is not None, "a tool's backend is connected on entry (async with)"
        return self._reads

    @property
    def writes(self) -> Writes:
        assert self._writes is not None, "a tool's backend is connected on entry (async with)"
        return self._writes

    def _connected_pool(self) -> Pool:
        assert self.pool is not None, "a tool's backend is connected on entry (async with)"
        return self.pool

    async def __aenter__(self) -> PgBackend:
        if self._tool and self.pool is None:
            self._use(await connect.tool_pool(self.cfg.store_url))
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- a server ------------------------------------------------------------------------
    def dispatcher(self, needs: DispatchNeeds) -> Dispatch:
        """Dispatch on the vehicles' state in the database: every instance is one of its own."""
        assert self._dispatcher is None
        cfg = self.cfg
        self._dispatcher = SharedDispatcher(
            self._connected_pool(),
            needs.publisher,
            # Event batches wait on the database, not the CPU: as many at once as connections
            # allow (bench/pg_serve.py: 2 lanes on 2 CPUs left the server half idle).
            lanes=max(1, cfg.store_pool_size - 2),
            inflight_timeout_s=cfg.inflight_timeout_s,
            sender=needs.sender,
            connected=needs.connected,
            vin_from_clientid=needs.vin_from_clientid,
            on_outcome=needs.on_outcome,
            max_attempts=cfg.max_attempts,
            response_timeout_s=cfg.response_timeout_s,
            on_response=needs.on_response,
            heartbeat_window_s=cfg.heartbeat_window_ms / 1000,
            batch_window_s=cfg.dispatch_batch_window_ms / 1000,
            batch_max=cfg.dispatch_batch_max,
            event_timeout_s=cfg.ingest_timeout_s,
            held=needs.held,
            high=needs.high,
            budget=needs.budget,
            pacing=needs.pacing,
            on_latency=needs.on_latency,
        )
        return self._dispatcher

    async def tell_policy(self, request_id: str, doc: bytes | None, set_ms: int) -> None:
        """Wait until every other live instance confirmed the policy it heard of at its commit,
        at most policy_propagation_timeout_s (policy_sync.py); the others reload the policies
        every policy_refresh_s besides."""
        if self._sync is not None:
            await self._sync.tell(request_id, set_ms)

    def _policy_told(self, request_id: str, doc: bytes | None, set_ms: int) -> None:
        if self.on_policy is not None:
            self.on_policy(request_id, doc, set_ms)

    def _policies_read(self, found: list[StoredPolicy]) -> None:
        if self.on_policies is not None:
            self.on_policies(found)

    def pacing_budget(self, clock_s: Callable[[], float]) -> tuple[Budget, Callable[[int], int]]:
        """The campaigns' buckets in the database, leased by every instance; max_in_flight
        counted there too (any instance may end a delivery another started)."""
        return PgBudget(self._connected_pool, lambda: round(clock_s() * 1000)), lambda cap: cap

    async def start(self) -> None:
        """Connect the pool, bring the schema to this release, start dispatch."""
        assert self._dispatcher is not None
        await pgmode.prepare(self._connected_pool())
        self._dispatcher.start()

    def jobs(self, shared: Callable[[], list[Job]], store_up: Callable[[bool], Coroutine[Any, Any, None]]) -> list[Job]:
        """Every instance: competing for the lead (the leader runs `shared()` and this store's
        `leader_jobs`), watching the database's reachability, ending stalled sessions."""
        return [
            ("leader", pgmode.lead(self.cfg, lambda: [job for _, job in shared()])),
            ("store", pgmode.watch(self._connected_pool(), self.cfg.store_down_grace_s, store_up)),
            ("end-stalled", pgmode.end_stalled_loop(self._connected_pool(), pgmode.stall_bound_s(self.cfg))),
            *([("policy-sync", self._sync.run())] if self._sync is not None else []),
        ]

    def leader_jobs(self) -> list[Job]:
        """The leader's jobs of this store: folding the count changes acks append, the shared
        level gauges, waking idle vehicles."""
        assert self._dispatcher is not None
        return [
            ("fold", pgmode.fold_loop(self._connected_pool())),
            ("gauges", housekeeping.gauge_loop(self._dispatcher, self.reads)),
            ("wake-idle", pgmode.wake_idle_loop(self._dispatcher, self.cfg.inflight_timeout_s)),
        ]

    def started_fields(self) -> dict[str, Any]:
        """What `server_started` says of the store."""
        return {"store": "postgresql", "stale_readers_cleared": 0}

    async def stop(self) -> None:
        """Stop dispatch (what `start` started)."""
        if self._dispatcher is not None:
            await self._dispatcher.stop()

    async def close(self) -> None:
        if self.pool is not None:
            if self._writes is not None:
                await self._writes.settle(self._op_timeout_s)
            await self.pool.close()

    # -- tools ---------------------------------------------------------------------------
    async def migrate(self) -> tuple[list[int], int]:
        """Create or upgrade the schema (under its advisory lock): (versions applied, version now).
        A tool's backend connects for it and closes after."""
        async with self, self._connected_pool().acquire() as conn:
            applied = await migrate.migrate(conn)
            return applied, await migrate.schema_version(conn)

    async def export_size(self) -> int | None:
        """Records an export writes, estimated (for a progress bar)."""
        from storage.postgres import export  # pyarrow: only tools export, a server never does

        try:
            async with self._connected_pool().acquire() as conn:
                return await export.estimated_records(conn)
        except PostgresError as exc:
            raise StorageError(f"export from store_url failed: {exc}") from None

    async def export(self, out: str, progress: Callable[[int], None]) -> dict[str, Any]:
        """One consistent snapshot as Parquet (storage/postgres/export.py); the manifest."""
        from storage.postgres import export

        try:
            async with self._connected_pool().acquire() as conn:
                return await export.export(conn, out, progress=progress)
        except PostgresError as exc:
            raise StorageError(f"export from store_url failed: {exc}") from None

    async def apply_plan(self, path: Path, *, dry_run: bool, progress: Callable[[int], None]) -> ApplyReport:
        """A Spark GC plan on one connection (storage/postgres/plan.py): the walk runs in a thread,
        each delete on this loop."""
        from storage import plan  # pyarrow: only tools apply plans

        loop = asyncio.get_running_loop()
        try:
            async with self._connected_pool().acquire() as conn:
                target = PgTarget(loop, conn, threadsafe=True)
                return await asyncio.to_thread(plan.apply_plan_to, target, path, dry_run=dry_run, progress=progress)
        except PostgresError as exc:
            raise StorageError(f"gc apply on store_url failed: {exc}") from None


class PgBudget:
    """Campaign buckets and in-flight counts in the database (storage/postgres/pacing.py): one
    statement per tick for every request that needs tokens, one for every capped request."""

    def __init__(self, pool: Callable[[], Pool], now_ms: Callable[[], int]) -> None:
        self._pool = pool
        self._now_ms = now_ms

    async def lease(self, asks: list[Lease]) -> list[int]:
        async with self._pool().acquire() as conn:
            got = await pg_pacing.lease(
                conn, [(a.request_id, a.rate_per_s, a.burst, a.want) for a in asks], self._now_ms()
            )
        metrics.DB_ROUND_TRIPS.labels("pacing").inc()
        return [got.get(a.request_id, 0) for a in asks]

    async def forget(self, request_ids: list[str]) -> None:
        async with self._pool().acquire() as conn:
            await pg_pacing.forget(conn, request_ids)

    async def out(self, request_ids: list[str]) -> dict[str, int] | None:
        async with self._pool().acquire() as conn:
            counted = await pg_pacing.out(conn, request_ids)
        metrics.DB_ROUND_TRIPS.labels("pacing").inc()
        return counted
