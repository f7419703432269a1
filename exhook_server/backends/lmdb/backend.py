"""The LMDB store as a backend: the environment of data_dir and its group committer, the worker
pool that dispatches over it, and the store-wide jobs, which one process of a host runs.

A server opens it writable with the configured commit limits; a tool opens it read-only (LMDB
readers never block a running server's writer) or writable through a committer of its own,
serialised with a running server's by LMDB's write lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from exhook_server.aio import Job
from exhook_server.backends.lmdb.peers import Group, Peers
from exhook_server.backends.lmdb.pool import Dispatcher
from exhook_server.backends.lmdb.rows import StoreRows
from exhook_server.config import Config
from exhook_server.dispatch.pacing import Budget, Lease, LocalBudget
from exhook_server.dispatch.port import Dispatch, DispatchNeeds
from exhook_server.errors import ConfigError
from storage.errors import StorageError
from storage.lmdb.reads import LmdbReads
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.lmdb.writes import LmdbWrites
from storage.model import ApplyReport, StoredPolicy
from storage.port import Reads, Writes

log = structlog.get_logger("sdv_fanout.server")

#: How long a policy's setter waits for each other process of the group to put it in force.
POLICY_TELL_S = 2.0


class LmdbBackend:
    """One process's view of the LMDB store (see the module docstring)."""

    #: Each process refreshes its own level gauges (its workers' vehicles; the store is local).
    local_gauges = True

    def __init__(
        self, cfg: Config, *, op_timeout_s: float, tool: bool, readonly: bool, group: Group | None = None
    ) -> None:
        self.cfg = cfg
        self.group = group
        self._op_timeout_s = op_timeout_s
        self._tool, self._readonly = tool, readonly
        self._store: Store | None = None
        self.committer: GroupCommitter | None = None
        self._reads: Reads | None = None
        self._writes: Writes | None = None
        #: Dispatch's row source, once `dispatcher` built it.
        self.rows: StoreRows | None = None
        self.peers: Peers | None = None
        self._dispatcher: Dispatcher | None = None
        #: The campaigns' fleet-wide buckets, in process 0 of a group (`pacing_budget`).
        self._budget: LocalBudget | None = None
        #: Puts a policy another process of the group stored in force here (request id, stored
        #: form, set_ms); set by the server.
        self.on_policy: Callable[[str, bytes | None, int], None] | None = None
        #: Unused: a group's processes tell each other (`tell_policy`).
        self.on_policies: Callable[[list[StoredPolicy]], None] | None = None
        if not tool:
            self._open()

    def _open(self) -> None:
        cfg = self.cfg
        if self._readonly:
            self._store = Store(cfg.data_dir, readonly=True)
        else:
            self._store = Store(cfg.data_dir, map_size_bytes=cfg.map_size_bytes, map_max_bytes=cfg.map_max_bytes)
            self.committer = (
                GroupCommitter(self._store)
                if self._tool
                else GroupCommitter(
                    self._store,
                    max_ops=cfg.group_commit_max_ops,
                    max_rows=cfg.max_rows_per_commit,
                    lazy_delay_s=cfg.ack_commit_delay_ms / 1000,
                )
            )
            self._writes = LmdbWrites(self._store, self.committer, self._op_timeout_s)
        self._reads = LmdbReads(self._store, self.committer)

    @property
    def store(self) -> Store:
        assert self._store is not None, "a tool's backend is opened on entry (async with)"
        return self._store

    @property
    def reads(self) -> Reads:
        assert self._reads is not None, "a tool's backend is opened on entry (async with)"
        return self._reads

    @property
    def writes(self) -> Writes:
        if self._writes is None:
            raise StorageError(f"{self.store.path}: opened read-only")
        return self._writes

    @property
    def runs_store_jobs(self) -> bool:
        """Whether this process resumes and sweeps the store's work: once per data dir."""
        return self.group is None or self.group.index == 0

    async def __aenter__(self) -> LmdbBackend:
        if self._store is None:
            self._open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- a server ------------------------------------------------------------------------
    def dispatcher(self, needs: DispatchNeeds) -> Dispatch:
        """The worker pool over this store; with a group, events forwarded to the VIN's process."""
        assert self.committer is not None and self._dispatcher is None
        cfg, group = self.cfg, self.group
        self.rows = StoreRows(self.store, self.committer)
        dispatcher = Dispatcher(
            self.rows,
            needs.publisher,
            workers=cfg.worker_count,
            inflight_timeout_s=cfg.inflight_timeout_s,
            vin_from_clientid=needs.vin_from_clientid,
            process=group.index if group else 0,
            processes=group.size if group else 1,
            forward=(lambda process, item: self._peers().send(process, item)) if group else None,
            ask=(lambda process, query: self._peers().ask(process, query)) if group else None,
            on_outcome=needs.on_outcome,
            max_attempts=cfg.max_attempts,
            response_timeout_s=cfg.response_timeout_s,
            on_response=needs.on_response,
            held=needs.held,
            pacing=needs.pacing,
            high=needs.high,
            budget=needs.budget,
            on_latency=needs.on_latency,
        )
        self.peers = Peers(group, dispatcher.receive, self._answer) if group else None
        self._dispatcher = dispatcher
        return dispatcher

    def pacing_budget(self, clock_s: Callable[[], float]) -> tuple[Budget, Callable[[int], int]]:
        """The campaigns' buckets: in this process when alone or process 0 of a group (the
        others lease from it over the group's links), and this process's share of a
        max_in_flight (its VINs are its own: a cap split over the processes holds exactly)."""
        self._budget = LocalBudget(clock_s)
        group = self.group
        if group is None or group.size == 1:
            return self._budget, lambda cap: cap
        index, size = group.index, group.size

        def share(cap: int) -> int:
            return cap // size + (1 if index < cap % size else 0)

        if index == 0:
            return self._budget, share
        return _GroupBudget(self._peers), share

    async def tell_policy(self, request_id: str, doc: bytes | None, set_ms: int) -> None:
        """Put a policy this process stored in force in the group's other processes, each
        answering once it is; one that does not answer within `POLICY_TELL_S` follows at its
        next reload (policy_refresh_s), as the log line `policy_not_told` says."""
        group = self.group
        if self.peers is None or group is None or group.size == 1:
            return
        others = [i for i in range(group.size) if i != group.index]
        query = ("policy", request_id, doc, set_ms)
        answers = await asyncio.gather(
            *(self.peers.ask(i, query, timeout_s=POLICY_TELL_S) for i in others), return_exceptions=True
        )
        for index, answer in zip(others, answers, strict=True):
            if isinstance(answer, Exception):
                log.warning("policy_not_told", request_id=request_id, peer=index, error=repr(answer))

    def _answer(self, query: tuple[Any, ...]) -> Any:
        """A peer's question: a policy to put in force, a lease of process 0's buckets, else one
        for dispatch."""
        if query[0] == "policy" and self.on_policy is not None:
            self.on_policy(query[1], query[2], query[3])
            return True
        if query[0] == "lease" and self._budget is not None:
            return self._budget.take(query[1])
        if query[0] == "forget" and self._budget is not None:
            self._budget.drop(query[1])
            return None
        assert self._dispatcher is not None
        return self._dispatcher.answer(query)

    def _peers(self) -> Peers:
        assert self.peers is not None
        return self.peers

    async def start(self) -> None:
        """Start dispatch: the group's links first, then the workers, then the answers awaited
        from before this start."""
        assert self._dispatcher is not None and self.rows is not None
        if self.peers is not None:
            await self.peers.start()
        self._dispatcher.start()
        # Deliveries PUBACKed before this start, still awaiting their answer: the sweep ends
        # them at their response timeout even if their vehicles stay away.
        restored = self._dispatcher.restore_awaited(self.rows.awaited())
        if restored:
            log.info("answers_awaited_restored", deliveries=restored)
        # Deliveries sent before this start and not ended: they count for their campaign's
        # max_in_flight until they end or their in-flight timeout passes.
        carried = self._dispatcher.carry_out(self.rows.sent_out(self.cfg.inflight_timeout_s))
        if carried:
            log.info("deliveries_out_carried", deliveries=carried)

    def jobs(self, shared: Callable[[], list[Job]], store_up: Callable[[bool], Coroutine[Any, Any, None]]) -> list[Job]:
        """The jobs this process runs for the whole host: `shared()` in process 0 only."""
        return shared() if self.runs_store_jobs else []

    def leader_jobs(self) -> list[Job]:
        """The store's own one-instance jobs: none beside the shared ones."""
        return []

    def started_fields(self) -> dict[str, Any]:
        """What `server_started` says of the store."""
        return {"store": str(self.store.path), "stale_readers_cleared": self.store.stale_readers_cleared}

    async def stop(self) -> None:
        """Stop dispatch (what `start` started)."""
        if self._dispatcher is not None:
            await self._dispatcher.stop()
        if self.peers is not None:
            await self.peers.stop()

    async def close(self) -> None:
        """Commit what is queued, then close the environment."""
        if self.committer is not None:
            await asyncio.to_thread(self.committer.close)
        if self._store is not None:
            self._store.close()

    # -- tools ---------------------------------------------------------------------------
    async def migrate(self) -> tuple[list[int], int]:
        """No schema to migrate: LMDB's is the one of this release, from its first write."""
        raise ConfigError("db migrate needs store_url (flag --store-url, env SDV_FANOUT_STORE_URL)")

    async def export_size(self) -> int | None:
        """Records an export writes (for a progress bar)."""
        n = self.store.counts()
        return n["ids"] + n["data"] + n["aliases"] + n["outcomes"] + n["gens"]

    async def export(self, out: str, progress: Callable[[int], None]) -> dict[str, Any]:
        """One consistent snapshot as Parquet (storage/lmdb/export.py); the manifest."""
        from storage.lmdb import export  # pyarrow: only tools export, a server never does

        return export.export(self.store, out, progress=progress)

    async def apply_plan(self, path: Path, *, dry_run: bool, progress: Callable[[int], None]) -> ApplyReport:
        """A Spark GC plan, each delete through the committer (storage/lmdb/plan.py)."""
        from storage.lmdb import plan  # pyarrow: only tools apply plans, a server never does

        assert self.committer is not None
        return plan.apply_plan(self.store, self.committer.submit, path, dry_run=dry_run, progress=progress)


class _GroupBudget:
    """The buckets of process 0 of the group, leased over the group's links."""

    def __init__(self, peers: Callable[[], Peers]) -> None:
        self._peers = peers

    async def lease(self, asks: list[Lease]) -> list[int]:
        got: list[int] = await self._peers().ask(0, ("lease", asks))
        return got

    async def forget(self, request_ids: list[str]) -> None:
        await self._peers().ask(0, ("forget", request_ids))

    async def out(self, request_ids: list[str]) -> dict[str, int] | None:
        return None  # each process counts its own VINs' deliveries
