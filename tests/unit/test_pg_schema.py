"""The SQL as a schema: a new database (sql/schema.sql and the function files) and a database
walked through every migration from version 1 have the same catalog; each function is defined
once, in a function file, applied again only when that file changed."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, TypeVar

import asyncpg
import pytest

from storage import model
from storage.postgres import constants, migrate
from testkit.pg_cluster import PgCluster

T = TypeVar("T")
_names = itertools.count()

#: What the catalog says about each kind of object of the public schema, one query each.
CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), co.collname, a.attidentity, a.attgenerated
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm') AND a.attnum > 0
          AND NOT a.attisdropped""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, contype, pg_get_constraintdef(oid) FROM pg_constraint
        WHERE connamespace = 'public'::regnamespace""",
    "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = 'public'",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, increment_by, max_value, cache_size, cycle
        FROM pg_sequences WHERE schemaname = 'public'""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), md5(pg_get_functiondef(p.oid)),
               obj_description(p.oid, 'pg_proc')
        FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace""",
    "types": """
        SELECT t.typname, t.typtype FROM pg_type t LEFT JOIN pg_class c ON c.oid = t.typrelid
        WHERE t.typnamespace = 'public'::regnamespace AND t.typcategory <> 'A'
          AND (t.typrelid = 0 OR c.relkind = 'c')""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal""",
}

Catalog = dict[str, set[tuple[Any, ...]]]


async def catalog(conn: asyncpg.Connection) -> Catalog:
    return {kind: {tuple(r) for r in await conn.fetch(sql)} for kind, sql in CATALOG.items()}


def differences(a: Catalog, b: Catalog) -> dict[str, tuple[list[Any], list[Any]]]:
    """Per kind, what only `a` has and what only `b` has (empty when the catalogs are equal)."""
    out = {}
    for kind in CATALOG:
        only_a, only_b = sorted(a[kind] - b[kind], key=repr), sorted(b[kind] - a[kind], key=repr)
        if only_a or only_b:
            out[kind] = (only_a, only_b)
    return out


def _on(dsn: str, body: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    async def go() -> T:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return await body(conn)
        finally:
            await conn.close()

    return asyncio.run(go())


async def _walked(conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Version 1 (its frozen base tables), then every later migration; the versions of the walk."""
    with monkeypatch.context() as m:
        m.setattr(migrate, "MIGRATIONS", migrate.MIGRATIONS[:1])
        first = await migrate.migrate(conn)
    return first + await migrate.migrate(conn)


@pytest.fixture(scope="module")
def new_dsn(pg_cluster: PgCluster) -> str:
    """A new database: sql/schema.sql and every function file."""
    dsn = pg_cluster.new_database(f"schema_new_{next(_names)}")
    _on(dsn, migrate.migrate)
    return dsn


@pytest.fixture(scope="module")
def new_catalog(new_dsn: str) -> Catalog:
    return _on(new_dsn, catalog)


def test_a_database_walked_from_version_1_has_the_catalog_of_a_new_one(
    pg_cluster: PgCluster, new_catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frozen version 1 and every migration after it give the tables, columns (types,
    defaults, not-null, collations), constraints, indexes, views, sequences and functions that
    sql/schema.sql and the function files give a new database."""

    async def body(conn: asyncpg.Connection) -> tuple[list[int], Catalog]:
        return await _walked(conn, monkeypatch), await catalog(conn)

    walk, walked = _on(pg_cluster.new_database(f"schema_walk_{next(_names)}"), body)
    assert walk == [v for v, _ in migrate.MIGRATIONS]
    assert differences(new_catalog, walked) == {}
    assert {r[0] for r in new_catalog["functions"]} >= {"sdv_put_rows", "sdv_vin_load", "sdv_end_row"}


def test_an_edit_of_the_schema_without_a_migration_shows_in_the_catalog(
    pg_cluster: PgCluster, new_catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sql/schema.sql with a column and an index no migration adds: the comparison above names
    both (it is not blind to what a walk lacks)."""
    edited = migrate.sql_text("schema.sql").replace(
        "    touched_ms  bigint NOT NULL\n);",
        "    touched_ms  bigint NOT NULL,\n    hits  integer\n);\nCREATE INDEX blobs_hits ON blobs (hits);",
    )
    real = migrate.sql_text
    monkeypatch.setattr(migrate, "sql_text", lambda path: edited if path == "schema.sql" else real(path))

    async def body(conn: asyncpg.Connection) -> Catalog:
        await migrate.migrate(conn)
        return await catalog(conn)

    found = differences(_on(pg_cluster.new_database(f"schema_edit_{next(_names)}"), body), new_catalog)
    assert set(found) == {"relations", "columns", "indexes"}
    assert [c[:3] for c in found["columns"][0]] == [("blobs", 5, "hits")] and found["columns"][1] == []
    assert [i[1] for i in found["indexes"][0]] == ["blobs_hits"] and found["indexes"][1] == []


def test_a_function_file_is_applied_again_only_when_it_changed(
    pg_cluster: PgCluster, new_catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database of the previous release (functions of other bodies, no checksums) gets every
    function file at its next migrate and then the catalog of a new database; after that, a
    migrate re-creates no function, and an edited file is applied at the next one."""
    changed = "functions/outcomes.sql"

    async def body(conn: asyncpg.Connection) -> tuple[Catalog, list[int], int, int, bool]:
        await migrate.migrate(conn)
        # The previous release: the same functions without their checksum, one body older.
        await conn.execute(
            "CREATE OR REPLACE FUNCTION sdv_vehicles_at(p_bound integer) RETURNS bigint"
            " LANGUAGE sql AS 'SELECT 0::bigint'"
        )
        for (sig,) in await conn.fetch("SELECT oid::regprocedure::text FROM pg_proc WHERE proname LIKE 'sdv\\_%'"):
            await conn.execute(f"COMMENT ON FUNCTION {sig} IS NULL")
        upgraded = await migrate.migrate(conn)
        after_upgrade = await catalog(conn)
        xmin = "SELECT xmin::text::bigint FROM pg_proc WHERE proname = 'sdv_end_row'"
        before = await conn.fetchval(xmin)
        await migrate.migrate(conn)
        untouched = await conn.fetchval(xmin)
        real = migrate.sql_text
        with monkeypatch.context() as m:
            edited = real(changed).replace("    v_stored bigint;", "    v_stored bigint;  -- edited")
            m.setattr(migrate, "sql_text", lambda path: edited if path == changed else real(path))
            await migrate.migrate(conn)
        source = await conn.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'sdv_end_row'")
        return after_upgrade, upgraded, before, untouched, "-- edited" in source

    after_upgrade, upgraded, before, untouched, edited = _on(pg_cluster.new_database(f"schema_fn_{next(_names)}"), body)
    assert upgraded == [] and differences(after_upgrade, new_catalog) == {}
    assert untouched == before and edited


def test_each_function_is_defined_once_in_a_function_file() -> None:
    """No function is defined in sql/schema.sql or a migration, nor in two function files: each
    has one definition, the live one (a migration may only drop a function whose arguments change)."""
    sql = resources.files("storage.postgres").joinpath("sql")
    outside = [sql.joinpath("schema.sql"), *sql.joinpath("migrations").iterdir()]
    assert [p.name for p in outside if re.search(r"\bCREATE\b[^;]*\bFUNCTION\b", p.read_text())] == []
    defined = [f for _, text in migrate.function_sources() for f in migrate.defined_functions(text)]
    assert len(defined) == len(set(defined)) and len(defined) >= 10
    files = {p.name for p in sql.joinpath("functions").iterdir()}
    assert files == set(migrate.FUNCTION_FILES)
    every = [p.name for p in sql.joinpath("migrations").iterdir()]
    assert sorted(every) == [name for _, name in migrate.MIGRATIONS]


def test_the_database_numbers_counts_outcomes_and_locks_as_python_does(new_dsn: str) -> None:
    """sdv_count_slot gives each count its slot in storage.model.COUNT_NAMES (an Outcome's code) and
    sdv_lock_class each lock class its key, as Python has them; an unknown name is an error."""

    async def body(conn: asyncpg.Connection) -> tuple[dict[str, int], dict[str, int], str]:
        slots = {n: await conn.fetchval("SELECT sdv_count_slot($1)", n) for n in model.COUNT_NAMES}
        locks = {c.name: await conn.fetchval("SELECT sdv_lock_class($1)", c.name.lower()) for c in constants.LockClass}
        try:
            await conn.fetchval("SELECT sdv_lock_class('vehicles')")
        except asyncpg.RaiseError as exc:
            return slots, locks, str(exc)
        return slots, locks, ""

    slots, locks, unknown = _on(new_dsn, body)
    assert slots == {n: i for i, n in enumerate(model.COUNT_NAMES)}
    assert all(slots[o.label] == o.value for o in model.Outcome)
    assert locks == {c.name: int(c) for c in constants.LockClass}
    assert unknown == "sdv: no lock class named vehicles"


def test_the_function_files_name_codes_and_locks_instead_of_writing_numbers() -> None:
    """No advisory lock class and no outcome code is written as a number in a function file: they
    come from sdv_lock_class and sdv_count_slot, so Python's table is the only one."""
    literal = re.compile(r"advisory\w*\(\s*\d|CONSTANT smallint := \d|\bcode\s*=\s*\d|slot\s*=\s*\d")
    found = [
        (name, line.strip())
        for name, text in migrate.function_sources()
        if name != "constants"
        for line in text.splitlines()
        if literal.search(line)
    ]
    assert found == []


def test_a_change_of_the_functions_comes_with_a_new_schema_version() -> None:
    """The function sources are those recorded for the current schema version: editing one without
    a migration (a new version) fails here, since a server of the previous release at the same
    version would put its own functions back during a rolling update."""
    assert migrate.functions_sha256() == migrate.FUNCTIONS_SHA256, (
        "the function files changed: add the next migration (sql/migrations/, no statement needed) "
        f"and set FUNCTIONS_SHA256 = {migrate.functions_sha256()!r} in storage/postgres/migrate.py"
    )
