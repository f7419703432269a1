"""`sdv-fanout db migrate` against a real PostgreSQL, and `serve` migrating at start."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from exhook_server.config import Config
from storage.postgres import migrate
from testkit.harness import BIN, InProcessServer
from testkit.pg_cluster import PgCluster


def sdv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "sdv-fanout"), *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def test_db_migrate_creates_the_schema_once_and_then_has_nothing_to_do(pg_cluster: PgCluster) -> None:
    """From the flag or the environment variable; the second run applies nothing."""
    dsn = pg_cluster.new_database("migrate_cli")
    first = sdv("db", "migrate", "--store-url", dsn)
    every = ", ".join(str(v) for v, _ in migrate.MIGRATIONS)
    want = f"schema version {migrate.SCHEMA_VERSION} (applied {every})"
    assert first.returncode == 0 and want in first.stdout, first.stderr
    again = sdv("db", "migrate", env={"SDV_FANOUT_STORE_URL": dsn})
    assert again.returncode == 0 and "(nothing to apply)" in again.stdout, again.stderr


def test_db_migrate_says_what_is_wrong(tmp_path: Path) -> None:
    """No store_url, a wrong scheme, nobody listening: exit 2 with a one-line reason."""
    missing = sdv("db", "migrate", env={"SDV_FANOUT_STORE_URL": ""})
    assert missing.returncode == 2 and "needs store_url" in missing.stderr
    wrong = sdv("db", "migrate", "--store-url", "mysql://x/y")
    assert wrong.returncode == 2 and "postgresql://" in wrong.stderr
    nobody = sdv("db", "migrate", "--store-url", "postgresql://sdv@127.0.0.1:1/sdv")
    assert nobody.returncode == 2 and "cannot connect" in nobody.stderr


def test_serve_migrates_at_start_and_leaves_data_dir_alone(tmp_path: Path, pg_cluster: PgCluster) -> None:
    """A server on store_url brings an empty database to this release's schema when it starts, and
    neither creates nor locks data_dir (a pod's root filesystem may be read-only)."""
    dsn = pg_cluster.new_database("migrate_serve")
    data_dir = tmp_path / "lmdb"
    srv = InProcessServer(
        Config(
            listen="127.0.0.1:0", store_url=dsn, data_dir=str(data_dir), mqtt_url="", admin_listen="", metrics_listen=""
        )
    ).start()
    try:
        assert srv.server is not None and srv.server.store is None

        async def version() -> int:
            async with srv.server.pool.acquire() as conn:  # type: ignore[union-attr]
                return await migrate.schema_version(conn)

        assert srv.run(version()) == migrate.SCHEMA_VERSION
    finally:
        srv.stop()
    assert not data_dir.exists()
