"""Creating and upgrading the PostgreSQL schema, safe when many instances start at once.

Every migration runs in one transaction that first takes a transaction-level advisory lock on a
fixed key: concurrent callers queue on it, and each finds the version the previous one committed,
so a migration runs exactly once and nobody sees half a schema. A database newer than this code
is refused (`SchemaTooNew`), never downgraded.
"""

from __future__ import annotations

import time
from importlib import resources

from storage.errors import StorageError
from storage.postgres.types import Connection

#: The advisory lock every schema change holds ("SDVFANOU" as a bigint): one fixed key, so the
#: lock means the same to every version of this code.
LOCK_KEY = 0x5344_5646_414E_4F55
#: Numbered migrations, applied in order: (version, SQL file in this package). A later version is
#: a new file, never an edit of an applied one.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, "schema.sql"),
    (2, "claims.sql"),
    (3, "dispatch.sql"),
    (4, "deltas.sql"),
    (5, "batch.sql"),
    (6, "batch6.sql"),
    (7, "events.sql"),
    (8, "bound.sql"),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]

_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS schema_version (
    version     integer PRIMARY KEY,
    applied_ms  bigint  NOT NULL
)
"""


class SchemaTooNew(StorageError):
    """The database holds a schema version this code does not know (a newer release migrated it)."""


def migration_sql(name: str) -> str:
    return resources.files("storage.postgres").joinpath(name).read_text(encoding="utf-8")


async def schema_version(conn: Connection) -> int:
    """The version the database is at (0: no schema yet)."""
    exists = await conn.fetchval("SELECT to_regclass('schema_version') IS NOT NULL")
    if not exists:
        return 0
    return int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_version"))


async def migrate(conn: Connection) -> list[int]:
    """Bring the database of `conn` (an asyncpg connection) to SCHEMA_VERSION; the versions this
    call applied (empty when it was there already)."""
    applied: list[int] = []
    async with conn.transaction():
        # Another instance's migration may hold the lock for a while: wait for it, whatever
        # lock_timeout the connection has.
        await conn.execute("SET LOCAL lock_timeout = 0")
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
        # Behind the lock: two first starts never race on creating the same table.
        await conn.execute(_VERSION_TABLE)
        current = int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_version"))
        if current > SCHEMA_VERSION:
            raise SchemaTooNew(f"database schema {current} is newer than this release's {SCHEMA_VERSION}")
        for version, name in MIGRATIONS:
            if version > current:
                await conn.execute(migration_sql(name))  # several statements: the simple protocol
                await conn.execute(
                    "INSERT INTO schema_version (version, applied_ms) VALUES ($1, $2)", version, int(time.time() * 1000)
                )
                applied.append(version)
    return applied
