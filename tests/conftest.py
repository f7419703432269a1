"""Shared fixtures: a real server on loopback with a fresh LMDB per test."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from exhook_server import log
from exhook_server.config import Config
from storage.lmdb.store import now_ms
from storage.postgres import migrate
from testkit.harness import ExHookClient, InProcessServer
from testkit.pg_cluster import PgCluster, find_bindir

log.configure("console", "warning", cache=False)


_databases = itertools.count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker (`make test`: `--dist loadfile --no-loadscope-reorder`, a whole
    file per worker, so a module's broker or cluster is set up once): the files with `slow`
    tests, then the Spark ones, are handed out first, so that the other worker is not left idle
    while one of them runs at the end. A serial run keeps the collected order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    weight: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        heavy = 2 if item.get_closest_marker("slow") else 1 if path.startswith("tests/spark/") else 0
        weight[path] = max(weight.get(path, 0), heavy)
    items.sort(key=lambda item: -weight[item.nodeid.split("::", 1)[0]])  # stable: files stay whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, but the Spark files go to one worker as one unit: they share its one
    SparkSession (a JVM, the `spark` fixture) instead of each worker starting its own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SparkTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope: str = super()._split_scope(nodeid)
            return "tests/spark/" if scope.startswith("tests/spark/") else scope

    return SparkTogether(config, log)


@pytest.fixture(params=["lmdb", "postgresql"])
def each_store(request: pytest.FixtureRequest) -> str:
    """Each store in turn: every test that uses this fixture, directly or through another (a store
    wrapper, `store_kind`), runs once on LMDB and once on PostgreSQL, the same body on both."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def store_kind() -> str:
    """The store `make_server`'s servers use. A module whose behaviour must hold on both stores
    overrides this fixture with one that returns `each_store` (see
    tests/integration/test_delivery_e2e.py)."""
    return "lmdb"


@pytest.fixture(params=["hooks", "mqtt"])
def each_event_mode(request: pytest.FixtureRequest) -> str:
    """Each way vehicle events reach the server in turn: every test that uses this fixture (through
    `event_mode`) runs once with heartbeats, answers and PUBACKs as hook calls and once over MQTT
    (`vehicle_events = mqtt`: shared subscription and ack rule; see testkit/emqx_sim.py)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def event_mode() -> str:
    """The `vehicle_events` of `make_server`'s servers that have a broker. A module whose behaviour
    must hold in both modes overrides this fixture with one that returns `each_event_mode`."""
    return "hooks"


@pytest.fixture
def make_server(tmp_path: Path, store_kind: str, event_mode: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start in-process servers with config overrides; all are stopped after the test. On
    PostgreSQL each data_dir stands for a database of its own (a server started again on the same
    data_dir finds the same database, as it finds the same LMDB). `clock=` (not a setting) gives
    the server a wall clock in ms that the test steps (see `StepClock`)."""
    servers: list[InProcessServer] = []
    databases: dict[str, str] = {}

    def make(**overrides: Any) -> InProcessServer:
        overrides.setdefault("mqtt_url", "")  # no broker unless the test brings one
        if event_mode == "mqtt" and overrides["mqtt_url"]:
            overrides.setdefault("vehicle_events", "mqtt")
        overrides.setdefault("metrics_listen", "")  # the registry is process-wide; one endpoint is enough
        overrides.setdefault("admin_listen", "127.0.0.1:0")  # tests run side by side: never the fixed 9001
        data_dir = overrides.pop("data_dir", str(tmp_path / f"lmdb{len(servers)}"))
        if store_kind == "postgresql" and "store_url" not in overrides:
            if data_dir not in databases:
                template: str = request.getfixturevalue("pg_migrated")
                cluster: PgCluster = request.getfixturevalue("pg_cluster")
                databases[data_dir] = cluster.new_database(f"srv_{os.getpid()}_{next(_databases)}", template)
            overrides["store_url"] = databases[data_dir]
        clock = overrides.pop("clock", now_ms)
        cfg = Config(listen="127.0.0.1:0", data_dir=data_dir, **overrides)
        srv = InProcessServer(cfg, clock=clock).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()


@pytest.fixture
def server(make_server: Any) -> InProcessServer:
    """One server with the default configuration."""
    return make_server()  # type: ignore[no-any-return]


@pytest.fixture
def client(server: InProcessServer) -> Iterator[ExHookClient]:
    """A v3 client of `server`."""
    c = ExHookClient(server.port)
    yield c
    c.close()


@pytest.fixture(scope="module")
def pg_dsn(pg_cluster: PgCluster, pg_migrated: str) -> str:
    """One migrated database for the module's tests (each store fixture empties its tables)."""
    return pg_cluster.new_database(f"parity_{os.getpid()}_{next(_databases)}", pg_migrated)


@pytest.fixture(scope="session")
def pg_migrated(pg_cluster: PgCluster) -> str:
    """The name of a database of the session's cluster migrated to the current schema, that no one
    connects to again: `make_server` and `pg_dsn` copy it (a server on such a copy finds the schema
    as after its first start; the tests of migration itself build their own databases)."""
    name = "sdv_migrated"
    dsn = pg_cluster.new_database(name)

    async def setup() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await migrate.migrate(conn)
        finally:
            await conn.close()

    asyncio.run(setup())
    return name


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """One throwaway PostgreSQL for the whole session (127.0.0.1, a free port, never as root); tests
    sharing it keep to tables or databases of their own (`PgCluster.new_database`)."""
    if find_bindir() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) found: install postgresql-15 (scripts/bootstrap)")
    cluster = PgCluster.create(name="session")
    yield cluster
    cluster.stop()
