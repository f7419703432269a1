"""PostgreSQL: the Parquet export, with the LMDB export's tables, columns, types, order and manifest,
so the Spark jobs read either store's.

One `REPEATABLE READ READ ONLY` transaction reads every table, so counts, rows and outcomes are of one
instant (writers are never blocked). Each table streams through a server-side cursor (`FETCH_ROWS`
records a fetch) into record batches bounded as the LMDB export's; answers longer than
`INLINE_ANSWER_BYTES` are read by key per batch, so memory stays bounded. Primary key order is LMDB's
key order (text keys are `COLLATE "C"`; LMDB joins key parts with NUL, which sorts first).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage import export_format, model
from storage.errors import StorageError
from storage.model import Outcome, now_ms
from storage.postgres.migrate import SCHEMA_VERSION as PG_SCHEMA_VERSION
from storage.postgres.migrate import schema_version
from storage.postgres.types import Connection

Progress = Callable[[int], None]

#: Records per round trip of a server-side cursor.
FETCH_ROWS = 4_096
#: Answers up to this long come with their outcome record; longer ones are read per batch by key
#: (a cursor fetch then holds at most FETCH_ROWS x this of answers: 16 MiB).
INLINE_ANSWER_BYTES = 4_096

_ROWS = f"""
SELECT vin, request_id, ts_ms, sha1, size::int8, nullif(expires_ms, 0),
       (flags & {model.FLAG_AWAIT_RESPONSE}) <> 0, (flags & {model.FLAG_HIGH_PRIORITY}) <> 0
FROM rows ORDER BY vin, request_id
"""
# octet_length of a bytea reads its stored length: the payload is not fetched or decompressed.
_BLOBS = "SELECT sha1, created_ms, touched_ms, octet_length(data)::int8 FROM blobs ORDER BY sha1"
_ALIASES = "SELECT data_id, sha1, ts_ms FROM aliases ORDER BY data_id"
# response_bytes is null for every outcome but `responded` (as on LMDB, whose other records keep
# no answer); the answer itself only when short (see INLINE_ANSWER_BYTES).
_OUTCOMES = """
SELECT vin, request_id, sha1, code, ended_ms, stored_ms, attempts::int8,
       CASE WHEN code = $1 AND octet_length(response) <= $2 THEN response END,
       CASE WHEN code = $1 THEN octet_length(response)::int8 END, sent_ms
FROM outcomes ORDER BY vin, request_id, sha1
"""
_LONG_ANSWERS = """
SELECT o.vin, o.request_id, o.sha1, o.response
FROM unnest($1::text[], $2::text[], $3::bytea[]) AS k(vin, request_id, sha1)
JOIN outcomes o ON o.vin = k.vin AND o.request_id = k.request_id AND o.sha1 = k.sha1
"""
_GENERATIONS = f"""
SELECT request_id, encode(sha1, 'hex'), first_ms, last_ms, {", ".join(model.COUNT_NAMES)}
FROM generation_counts ORDER BY request_id, sha1
"""
# The policy and its abort as stored (JSON bytes, never read here), as text.
_POLICIES = """
SELECT request_id, convert_from(doc, 'UTF8'), set_ms, convert_from(aborted, 'UTF8')
FROM policies ORDER BY request_id
"""
# Planner estimates (no scan): a progress bar's total. -1 (PostgreSQL 14+) or 0: never analysed.
_ESTIMATES = """
SELECT coalesce(sum(greatest(reltuples, 0)), 0)::int8 FROM pg_class
WHERE oid = ANY(ARRAY['rows', 'blobs', 'aliases', 'outcomes', 'generations', 'policies']::regclass[])
"""


async def estimated_records(conn: Connection) -> int | None:
    """About how many records an export of this database writes (planner statistics, no scan);
    None when the tables were never analysed."""
    return int(await conn.fetchval(_ESTIMATES)) or None


async def _cursor(conn: Connection, sql: str, *args: object) -> AsyncIterator[tuple[Any, ...]]:
    async for record in conn.cursor(sql, *args, prefetch=FETCH_ROWS):
        yield tuple(record)


async def _chunks(
    records: AsyncIterator[tuple[Any, ...]], weight: Callable[[tuple[Any, ...]], int] | None = None
) -> AsyncIterator[list[tuple[Any, ...]]]:
    """`storage.lmdb.export._batched` over an async source: BATCH_ROWS records, or fewer once their
    `weight` (bytes) reaches BATCH_BYTES. The limits are read at each call, as the LMDB export's."""
    chunk: list[tuple[Any, ...]] = []
    held = 0
    async for item in records:
        chunk.append(item)
        if weight is not None:
            held += weight(item)
        if len(chunk) >= export_format.BATCH_ROWS or held >= export_format.BATCH_BYTES:
            yield chunk
            chunk = []
            held = 0
    if chunk:
        yield chunk


async def _write(
    path: Path, schema: pa.Schema, chunks: AsyncIterator[list[tuple[Any, ...]]], progress: Progress
) -> int:
    """One table as part-00000.parquet, chunk by chunk (the LMDB export's `_write`); its row count."""
    path.mkdir(parents=True, exist_ok=True)
    n = 0
    with pq.ParquetWriter(path / "part-00000.parquet", schema, compression="zstd") as writer:
        async for chunk in chunks:
            columns = list(zip(*chunk, strict=True))
            writer.write_batch(
                pa.record_batch([pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)], schema=schema)
            )
            n += len(chunk)
            progress(len(chunk))
    return n


def _answer_weight(item: tuple[Any, ...]) -> int:
    return int(item[8] or 0)  # response_bytes; null for every outcome but `responded`


async def _outcomes(conn: Connection) -> AsyncIterator[list[tuple[Any, ...]]]:
    """Outcome records in batches, each with its long answers read by key in the same snapshot."""
    responded = int(Outcome.RESPONDED)

    async def records() -> AsyncIterator[tuple[Any, ...]]:
        async for vin, request_id, sha1, code, ended, stored, attempts, answer, length, sent in _cursor(
            conn, _OUTCOMES, responded, INLINE_ANSWER_BYTES
        ):
            yield vin, request_id, bytes(sha1), Outcome(code).label, ended, stored, attempts, answer, length, sent

    async for chunk in _chunks(records(), _answer_weight):
        long = [r for r in chunk if r[8] is not None and r[7] is None]
        answers: dict[tuple[str, str, bytes], bytes] = {}
        if long:
            found = await conn.fetch(_LONG_ANSWERS, [r[0] for r in long], [r[1] for r in long], [r[2] for r in long])
            answers = {(f[0], f[1], bytes(f[2])): bytes(f[3]) for f in found}
        yield [
            (vin, rid, sha1.hex(), label, ended, stored, attempts, answers.get((vin, rid, sha1), answer), length, sent)
            for vin, rid, sha1, label, ended, stored, attempts, answer, length, sent in chunk
        ]


async def export(conn: Connection, out: str | os.PathLike[str], progress: Progress | None = None) -> dict[str, Any]:
    """Write OUT/{rows,blobs,aliases,outcomes,generations,policies}/part-00000.parquet from the database of
    `conn` (an asyncpg connection, outside any transaction), then OUT/manifest.json (last: an
    export without it is incomplete); returns the manifest, the LMDB export's to the key."""
    out = Path(out)
    tick = progress or (lambda n: None)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        # The first statement takes the snapshot; the wall clock after it is the snapshot's time,
        # as the LMDB export reads the clock once its read transaction has begun.
        version = await schema_version(conn)
        snapshot = now_ms()
        if version == 0:
            raise StorageError("the database at store_url has no sdv-fanout schema (run `sdv-fanout db migrate`)")
        if version > PG_SCHEMA_VERSION:
            raise StorageError(f"database schema {version} is newer than this release's {PG_SCHEMA_VERSION}")
        counts = {
            "rows": await _write(out / "rows", export_format.ROWS_SCHEMA, _chunks(_cursor(conn, _ROWS)), tick),
            "blobs": await _write(out / "blobs", export_format.BLOBS_SCHEMA, _chunks(_cursor(conn, _BLOBS)), tick),
            "aliases": await _write(
                out / "aliases", export_format.ALIASES_SCHEMA, _chunks(_cursor(conn, _ALIASES)), tick
            ),
            "outcomes": await _write(out / "outcomes", export_format.OUTCOMES_SCHEMA, _outcomes(conn), tick),
            "generations": await _write(
                out / "generations", export_format.GENERATIONS_SCHEMA, _chunks(_cursor(conn, _GENERATIONS)), tick
            ),
            "policies": await _write(
                out / "policies", export_format.POLICIES_SCHEMA, _chunks(_cursor(conn, _POLICIES)), tick
            ),
        }
    manifest = {
        "format": export_format.FORMAT,
        "format_version": export_format.FORMAT_VERSION,
        # Which store this is a snapshot of, and that store's own schema version (the database's,
        # as `sdv-fanout db migrate` reports it): the tables and columns are the same from either
        # store, `format_version` says what readers need to know.
        "store": "postgresql",
        "schema_version": version,
        "snapshot_ms": snapshot,
        "counts": counts,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
