"""`open_backend(cfg)`: the one place that chooses the store (PostgreSQL when store_url is set,
else the LMDB data dir), and `Backend`, what the server and the CLI ask of either.

A backend offers the store's ports (storage/port.py), builds its dispatch, names its one-instance
jobs, exports for Spark and applies a Spark GC plan. A server's is opened here and started with
the server; a tool's is used as `async with open_backend(cfg, tool=True) as backend:`.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from exhook_server.aio import Job
from exhook_server.config import Config

if TYPE_CHECKING:
    from exhook_server.backends.lmdb.peers import Group
    from exhook_server.dispatch.pacing import Budget
    from exhook_server.dispatch.port import Dispatch, DispatchNeeds
    from storage.model import ApplyReport, StoredPolicy
    from storage.port import Reads, Writes

#: How long one operation of a tool may take: a scan of a large store (stats) takes a while,
#: and the operator watching can end it sooner with Ctrl-C.
TOOL_OP_TIMEOUT_S = 3600.0


class Backend(Protocol):
    """A store opened for a server or a tool (see the module docstring)."""

    #: Whether each process refreshes the level gauges itself (else the leader's `leader_jobs` do).
    local_gauges: bool

    @property
    def reads(self) -> Reads: ...

    @property
    def writes(self) -> Writes:
        """The writes port; a store opened read-only raises StorageError."""
        ...

    @property
    def runs_store_jobs(self) -> bool:
        """Whether this process resumes the store's unfinished work and runs its sweeps."""
        ...

    async def __aenter__(self) -> Backend: ...

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    # -- a server ------------------------------------------------------------------------
    def dispatcher(self, needs: DispatchNeeds) -> Dispatch:
        """This store's dispatch (built once)."""
        ...

    def pacing_budget(self, clock_s: Callable[[], float]) -> tuple[Budget, Callable[[int], int]]:
        """Where the campaigns' fleet-wide buckets live (dispatch/pacing.py), and this process's
        share of a max_in_flight."""
        ...

    #: Puts a policy another process stored in force in this one (request id, stored form,
    #: set_ms): set by the server, called by `tell_policy` of a sibling process (LMDB) or at the
    #: policy's notice (PostgreSQL).
    on_policy: Callable[[str, bytes | None, int], None] | None
    #: Puts every policy in force in this one, read again from the store (PostgreSQL: when its
    #: policy listener connects again and may have missed notices); set by the server.
    on_policies: Callable[[list[StoredPolicy]], None] | None

    async def tell_policy(self, request_id: str, doc: bytes | None, set_ms: int) -> None:
        """Put a policy this process just stored in force in the server's other processes before
        it is reported (those that are not told follow at their next reload)."""
        ...

    async def start(self) -> None:
        """Reach the store and start the dispatch `dispatcher` built."""
        ...

    def jobs(self, shared: Callable[[], list[Job]], store_up: Callable[[bool], Coroutine[Any, Any, None]]) -> list[Job]:
        """The background jobs this process starts: those run for the whole deployment
        (`shared()`, and `leader_jobs`) where this store has them run, and its own watches;
        `store_up` is told when the store becomes unreachable or reachable again."""
        ...

    def leader_jobs(self) -> list[Job]:
        """The store's own jobs for the whole deployment, beside the shared ones."""
        ...

    def started_fields(self) -> dict[str, Any]:
        """What the `server_started` log line says of the store."""
        ...

    async def stop(self) -> None:
        """Stop the dispatch `start` started."""
        ...

    async def close(self) -> None:
        """Commit what is queued and close the store."""
        ...

    # -- tools ---------------------------------------------------------------------------
    async def migrate(self) -> tuple[list[int], int]:
        """Create or upgrade the schema: (versions applied, version now); ConfigError on LMDB.
        Opens the store for it and closes it after (no `async with` around it)."""
        ...

    async def export_size(self) -> int | None:
        """How many records `export` writes (an estimate on PostgreSQL)."""
        ...

    async def export(self, out: str, progress: Callable[[int], None]) -> dict[str, Any]:
        """One consistent snapshot as Parquet for spark/ in `out`; the manifest."""
        ...

    async def apply_plan(self, path: Path, *, dry_run: bool, progress: Callable[[int], None]) -> ApplyReport:
        """Apply a plan of spark/gc_job.py, re-checking each candidate (storage/plan.py)."""
        ...


def local_data_dir(cfg: Config) -> str | None:
    """The directory the store keeps on this host (LMDB's data_dir: created, checked and locked
    before a server starts), or None when the store is PostgreSQL: any number of instances share
    it, the database arbitrates, and a pod's root filesystem may be read-only."""
    return None if cfg.store_url else cfg.data_dir


def open_backend(cfg: Config, *, tool: bool = False, readonly: bool = False, group: Group | None = None) -> Backend:
    """The store in force: PostgreSQL at store_url when set, else LMDB at data_dir.

    A server's (`tool` False) runs its operations within ingest_timeout_s, `group` its process
    group on one host. A tool's runs them within TOOL_OP_TIMEOUT_S and opens the store on
    `async with`; `readonly` opens LMDB read-only (PostgreSQL is the same either way).
    """
    timeout_s = TOOL_OP_TIMEOUT_S if tool else cfg.ingest_timeout_s
    if cfg.store_url:
        from exhook_server.backends.postgres.backend import PgBackend

        return PgBackend(cfg, op_timeout_s=timeout_s, tool=tool)
    from exhook_server.backends.lmdb.backend import LmdbBackend

    return LmdbBackend(cfg, op_timeout_s=timeout_s, tool=tool, readonly=readonly, group=group)
