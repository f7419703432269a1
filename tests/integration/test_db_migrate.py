"""`sdv-fanout db migrate` against a real PostgreSQL, and `serve` refusing a store_url it cannot serve yet."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from exhook_server.config import Config
from exhook_server.errors import ConfigError
from exhook_server.server import FanoutServer
from tests.harness import BIN
from tests.pg_cluster import PgCluster


def sdv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "sdv-fanout"), *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def test_db_migrate_creates_the_schema_once_and_then_has_nothing_to_do(pg_cluster: PgCluster) -> None:
    """From the flag or the environment variable; the second run applies nothing."""
    dsn = pg_cluster.new_database("migrate_cli")
    first = sdv("db", "migrate", "--store-url", dsn)
    assert first.returncode == 0 and "schema version 2 (applied 1, 2)" in first.stdout, first.stderr
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


def test_serve_refuses_a_postgresql_store_url_until_it_can_serve_it(tmp_path: Path) -> None:
    """A clear start-up error instead of silently serving from LMDB."""
    cfg = Config(store_url="postgresql://sdv@127.0.0.1:5432/sdv", data_dir=str(tmp_path / "lmdb"))
    with pytest.raises(ConfigError, match="not available yet"):
        FanoutServer(cfg)
