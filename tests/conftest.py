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
from testkit.emqx_shared import SharedBrokers
from testkit.harness import ExHookClient, InProcessServer
from testkit.pg_cluster import PgCluster, find_bindir

log.configure("console", "warning", cache=False)


_databases = itertools.count()


#: The files that take their real EMQX brokers from `emqx_brokers`. Under `make test` they run one
#: after another on one worker (one xdist unit, handed out first), so each broker boots once for all.
SHARED_EMQX_FILES = frozenset(
    f"tests/integration/{name}.py"
    for name in (
        "test_catchup",
        "test_emqx_acl",
        "test_emqx_shared",
        "test_emqx_sync",
        "test_real_emqx",
        "test_real_emqx_events",
        "test_real_emqx_rule_acks",
        "test_sim_vs_real",
    )
)


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _weight(item: pytest.Item) -> int:
    """The higher, the earlier the item's file is handed out."""
    path = _file(item)
    if path in SHARED_EMQX_FILES:
        return 3
    if item.get_closest_marker("slow"):
        return 2
    return 1 if path.startswith("tests/spark/") else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker (`make test`: `--dist loadfile --no-loadscope-reorder`, a whole
    file per worker, so a module's broker or cluster is set up once): the files sharing real EMQX
    brokers, then those with `slow` tests, then the Spark ones, are handed out first, so that the
    other worker is not left idle while one of them runs at the end. A serial run keeps the
    collected order."""
    stray = {_file(item) for item in items if "emqx_brokers" in item.fixturenames} - SHARED_EMQX_FILES
    if stray:
        raise pytest.UsageError(f"add {', '.join(sorted(stray))} to SHARED_EMQX_FILES in tests/conftest.py")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    weight: dict[str, int] = {}
    for item in items:
        weight[_file(item)] = max(weight.get(_file(item), 0), _weight(item))
    items.sort(key=lambda item: -weight[_file(item)])  # stable: files stay whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, but the Spark files go to one worker as one unit: they share its one
    SparkSession (a JVM, the `spark` fixture) instead of each worker starting its own; so do the
    SHARED_EMQX_FILES, which share its brokers."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Together(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope: str = super()._split_scope(nodeid)
            if scope.startswith("tests/spark/"):
                return "tests/spark/"
            return "shared EMQX" if scope in SHARED_EMQX_FILES else scope

    return Together(config, log)


_emqx_pools: list[SharedBrokers] = []


@pytest.fixture(scope="session")
def emqx_brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedBrokers]:
    """Real EMQX brokers for the SHARED_EMQX_FILES, one per (version, env), each handed out in the
    state it booted in (testkit/emqx_shared.py). They are killed once the next test needs none."""
    with SharedBrokers(tmp_path_factory.mktemp("emqx-shared")) as pool:
        _emqx_pools.append(pool)
        yield pool


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test that uses `emqx_brokers` (and its module's teardown), kill the brokers:
    idle, they would still hold memory and wake up for the rest of the session."""
    try:
        return (yield)
    finally:
        if nextitem is None or "emqx_brokers" not in nextitem.fixturenames:
            for pool in _emqx_pools:
                pool.close()


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
