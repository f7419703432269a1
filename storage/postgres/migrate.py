"""Creating and upgrading the PostgreSQL schema, safe when many instances start at once.

An empty database gets `sql/schema.sql`; an older one walks the numbered `sql/migrations/` it
lacks; then every file of `sql/functions/` (and the SQL `constants` generates) whose checksum
changed is applied again (each function is defined once, `CREATE OR REPLACE`). All of it in one
transaction behind a fixed advisory lock: concurrent callers queue on it and each finds what the
previous one committed. A database newer than this code is refused (`SchemaTooNew`).
"""

from __future__ import annotations

import hashlib
import re
import time
from importlib import resources

from storage.errors import StorageError
from storage.postgres import constants
from storage.postgres.types import Connection

#: Numbered migrations, applied in order to a database of an older release: (version, file in
#: sql/migrations/). A schema change is a new file here and the same change in sql/schema.sql;
#: an applied file is never edited.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, "0001_base_tables.sql"),
    (2, "0002_delivery_out.sql"),
    (3, "0003_dispatch_state.sql"),
    (4, "0004_appended_counts.sql"),
    (5, "0005_batch_in_one_statement.sql"),
    (6, "0006_insert_new_rows_first.sql"),
    (7, "0007_event_in_one_statement.sql"),
    (8, "0008_crowded.sql"),
    (9, "0009_policies.sql"),
    (10, "0010_held_requests.sql"),
    (11, "0011_priority.sql"),
    (12, "0012_campaign_aborts.sql"),
    (13, "0013_pacing.sql"),
    (14, "0014_latency.sql"),
    (15, "0015_priority_lanes.sql"),
    (16, "0016_send_times.sql"),
    (17, "0017_send_only_pending_rows.sql"),
)
#: The version sql/schema.sql describes: the last migration's.
SCHEMA_VERSION = MIGRATIONS[-1][0]
#: The functions, in files of sql/functions/ applied in this order after the tables (and after the
#: generated ones of `constants`); a function's arguments or result type change through a
#: migration that drops the old one first.
FUNCTION_FILES = (
    "batches.sql",
    "rows.sql",
    "bound.sql",
    "outcomes.sql",
    "dispatch.sql",
    "vehicle_batches.sql",
    "pacing.sql",
)
#: `functions_sha256()` as of SCHEMA_VERSION (tests/unit/test_pg_schema.py checks it). A change of a
#: function is a new schema version (a migration, with no statement if no table changes): a server
#: of the previous release then refuses the database, where at the same version it would apply its
#: own functions again over the new ones during a rolling update.
FUNCTIONS_SHA256 = "e2c758c483167b02f8bc7fb63e2165978eb05ec8cb0482d12188bc57d8692720"

_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS schema_version (
    version     integer PRIMARY KEY,
    applied_ms  bigint  NOT NULL
)
"""
_COMMENT = re.compile(r"--[^\n]*")
_DEFINES = re.compile(r"^CREATE OR REPLACE FUNCTION\s+(\w+)\s*\(", re.MULTILINE)
#: Each function's comment names the file that defined it and that file's checksum.
_RECORDED = """
SELECT p.proname, obj_description(p.oid, 'pg_proc') FROM pg_proc p
WHERE p.pronamespace = current_schema()::regnamespace AND p.proname = ANY($1::text[])
"""
_RECORD = """
SELECT format('COMMENT ON FUNCTION %s IS %L', p.oid::regprocedure, $2::text) FROM pg_proc p
WHERE p.pronamespace = current_schema()::regnamespace AND p.proname = ANY($1::text[])
"""


class SchemaTooNew(StorageError):
    """The database holds a schema version this code does not know (a newer release migrated it)."""


def sql_text(path: str) -> str:
    """A file of the sql/ tree (`schema.sql`, `migrations/…`, `functions/…`), from the installed package."""
    return resources.files("storage.postgres").joinpath("sql", path).read_text(encoding="utf-8")


def function_sources() -> list[tuple[str, str]]:
    """(name, SQL) of every function file, in the order they are applied: first the generated
    constants (`sdv_count_slot`, `sdv_lock_class`) that the files call."""
    files = [(f"functions/{name}", sql_text(f"functions/{name}")) for name in FUNCTION_FILES]
    return [("constants", constants.function_sql()), *files]


def functions_sha256() -> str:
    """One checksum over every function source, names included."""
    digest = hashlib.sha256()
    for name, sql in function_sources():
        digest.update(name.encode() + b"\0" + sql.encode() + b"\0")
    return digest.hexdigest()


def defined_functions(sql: str) -> list[str]:
    """The names of the functions a function file defines."""
    return _DEFINES.findall(sql)


async def schema_version(conn: Connection) -> int:
    """The version the database is at (0: no schema yet)."""
    exists = await conn.fetchval("SELECT to_regclass('schema_version') IS NOT NULL")
    if not exists:
        return 0
    return int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_version"))


async def migrate(conn: Connection) -> list[int]:
    """Bring the database of `conn` (an asyncpg connection) to the last of MIGRATIONS and its
    functions up to date; the versions this call applied (empty when it was there already)."""
    target = MIGRATIONS[-1][0]
    async with conn.transaction():
        # Another instance's migration may hold the lock for a while: wait for it, whatever
        # lock_timeout the connection has.
        await conn.execute("SET LOCAL lock_timeout = 0")
        await conn.execute("SELECT pg_advisory_xact_lock($1)", constants.SCHEMA_LOCK)
        # Behind the lock: two first starts never race on creating the same table.
        await conn.execute(_VERSION_TABLE)
        current = int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_version"))
        if current > SCHEMA_VERSION:
            raise SchemaTooNew(f"database schema {current} is newer than this release's {SCHEMA_VERSION}")
        if current == 0 and target == SCHEMA_VERSION:
            await conn.execute(sql_text("schema.sql"))  # several statements: the simple protocol
            applied = [version for version, _ in MIGRATIONS]
        else:
            applied = []
            for version, name in MIGRATIONS:
                if version > current:
                    sql = sql_text(f"migrations/{name}")
                    if _COMMENT.sub("", sql).strip():  # versions that changed only functions have no statement
                        await conn.execute(sql)
                    applied.append(version)
        now = int(time.time() * 1000)
        await conn.executemany(
            "INSERT INTO schema_version (version, applied_ms) VALUES ($1, $2)", [(v, now) for v in applied]
        )
        # The functions are written for the schema of SCHEMA_VERSION: a walk that stops short of
        # it (a test building an old database) leaves them out.
        if target == SCHEMA_VERSION:
            await _apply_functions(conn)
    return applied


async def _apply_functions(conn: Connection) -> list[str]:
    """Apply each function file whose functions do not all carry its current checksum; the
    files applied."""
    sources = [(name, sql, defined_functions(sql)) for name, sql in function_sources()]
    every = [f for _, _, names in sources for f in names]
    recorded: dict[str, str | None] = {r[0]: r[1] for r in await conn.fetch(_RECORDED, every)}
    applied = []
    for name, sql, names in sources:
        mark = f"sdv-fanout {name} sha256:{hashlib.sha256(sql.encode()).hexdigest()}"
        if all(recorded.get(f) == mark for f in names):
            continue
        await conn.execute(sql)
        await conn.execute(";\n".join(r[0] for r in await conn.fetch(_RECORD, names, mark)))
        applied.append(name)
    return applied
