"""The throwaway PostgreSQL of testkit/pg_cluster.py: reachable through asyncpg, durable settings, never
root, and a synchronous standby that holds every acknowledged commit and takes over when promoted."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import asyncpg
import pytest

from testkit.harness import poll
from testkit.pg_cluster import PgCluster, find_bindir, pid_alive


def _fetch(dsn: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    async def go() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return [tuple(r) for r in await conn.fetch(sql, *args)]
        finally:
            await conn.close()

    return asyncio.run(go())


def _uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:")))


def test_asyncpg_round_trips_a_row(pg_cluster: PgCluster) -> None:
    """The product's role connects to its database on 127.0.0.1 and reads back the row it wrote."""

    async def go() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(pg_cluster.dsn, timeout=10)
        try:
            await conn.execute("CREATE TABLE roundtrip (vin text PRIMARY KEY, sha1 bytea NOT NULL, ts bigint)")
            await conn.execute("INSERT INTO roundtrip VALUES ($1, $2, $3)", "LSVTEST0000000001", b"\x01" * 20, 42)
            rows = await conn.fetch("SELECT vin, sha1, ts, current_user FROM roundtrip")
            await conn.execute("DROP TABLE roundtrip")
            return [tuple(r) for r in rows]
        finally:
            await conn.close()

    assert pg_cluster.dsn == f"postgresql://sdv@127.0.0.1:{pg_cluster.port}/sdv"
    assert asyncio.run(go()) == [("LSVTEST0000000001", b"\x01" * 20, 42, "sdv")]


def test_cluster_is_durable_loopback_only_and_not_root(pg_cluster: PgCluster) -> None:
    """fsync and synchronous_commit are on, the server listens on 127.0.0.1 only, and no process of
    it (nor its data dir) belongs to root."""
    names = ["fsync", "synchronous_commit", "listen_addresses", "unix_socket_directories"]
    rows = _fetch(pg_cluster.admin_dsn, "SELECT name, setting FROM pg_settings WHERE name = ANY($1)", names)
    settings = {name: value for name, value in rows}
    assert settings == {
        "fsync": "on",
        "synchronous_commit": "on",
        "listen_addresses": "127.0.0.1",
        "unix_socket_directories": str(pg_cluster.dir),
    }
    assert _uid_of(pg_cluster.pid) != 0
    assert pg_cluster.data_dir.stat().st_uid == _uid_of(pg_cluster.pid)
    if os.geteuid() != 0:
        assert _uid_of(pg_cluster.pid) == os.geteuid()


def test_synchronous_standby_holds_acknowledged_commits_and_takes_over() -> None:
    """A commit acknowledged by a primary with a synchronous standby is on the standby; after kill -9
    of the primary and a promote, the standby has the row and accepts writes; stop() leaves nothing."""
    if find_bindir() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) found: install postgresql-15 (scripts/bootstrap)")
    primary = PgCluster.create(name="failover-primary")
    standby = None
    pids = [primary.pid]
    try:
        standby = primary.basebackup_standby("standby1")
        pids.append(standby.pid)
        assert _fetch(primary.admin_dsn, "SELECT application_name, sync_state FROM pg_stat_replication") == [
            ("standby1", "sync")
        ]
        _fetch(primary.dsn, "CREATE TABLE acked (id int PRIMARY KEY, note text)")
        poll(lambda: _fetch(standby.dsn, "SELECT to_regclass('acked') IS NOT NULL") == [(True,)], timeout_s=10)
        [(lsn,)] = _fetch(
            primary.dsn, "INSERT INTO acked VALUES (1, 'acknowledged') RETURNING pg_current_wal_insert_lsn()::text"
        )
        # The commit returned, so the standby has flushed its WAL: no waiting here. Replay (and so
        # visibility to readers) may follow a moment later.
        assert _fetch(standby.admin_dsn, "SELECT pg_last_wal_receive_lsn() >= $1::text::pg_lsn", lsn) == [(True,)]
        poll(lambda: _fetch(standby.dsn, "SELECT count(*) FROM acked") == [(1,)], timeout_s=10)
        assert standby.is_in_recovery()

        primary.kill()
        standby.promote()
        assert not standby.is_in_recovery()
        _fetch(standby.dsn, "INSERT INTO acked VALUES (2, 'after failover')")
        assert _fetch(standby.dsn, "SELECT id, note FROM acked ORDER BY id") == [
            (1, "acknowledged"),
            (2, "after failover"),
        ]
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()
    assert not primary.dir.exists() and standby is not None and not standby.dir.exists()
    assert not any(pid_alive(pid) for pid in pids)
