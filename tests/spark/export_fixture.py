"""Write exports in storage/lmdb/export.py's layout with pyarrow, for the Spark job tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.lmdb.export import (
    ALIASES_SCHEMA,
    BLOBS_SCHEMA,
    FORMAT_VERSION,
    GENERATIONS_SCHEMA,
    OUTCOMES_SCHEMA,
    POLICIES_SCHEMA,
    ROWS_SCHEMA,
)

#: The export's own schemas: a fixture export differs from a real one only in how it was made.
SCHEMAS = {
    "rows": ROWS_SCHEMA,
    "blobs": BLOBS_SCHEMA,
    "aliases": ALIASES_SCHEMA,
    "outcomes": OUTCOMES_SCHEMA,
    "generations": GENERATIONS_SCHEMA,
    "policies": POLICIES_SCHEMA,
}

#: The columns export format 2 added, with the value a record that leaves them out gets; an export
#: written as version 1 has none of them.
ADDED_IN_2: dict[str, dict[str, Any]] = {
    "rows": {"expires_at_ms": None, "await_response": False},
    "outcomes": {"response": None, "response_bytes": None},
    "generations": {"responded": 0},
}
#: The column export format 3 added, likewise.
ADDED_IN_3: dict[str, dict[str, Any]] = {"rows": {"high_priority": False}, "outcomes": {"sent_ms": None}}


def _added(name: str, version: int) -> dict[str, Any]:
    """The columns of `name` after version 1 that an export of `version` has, with their defaults."""
    added = dict(ADDED_IN_2.get(name, {})) if version >= 2 else {}
    return {**added, **ADDED_IN_3.get(name, {})} if version >= 3 else added


Record = Sequence[Any] | Mapping[str, Any]


def _schema(name: str, version: int) -> pa.Schema:
    schema = SCHEMAS[name]
    kept = _added(name, version)
    for column in [*ADDED_IN_2.get(name, {}), *ADDED_IN_3.get(name, {})]:
        if column not in kept:
            schema = schema.remove(schema.get_field_index(column))
    return schema


def _table(schema: pa.Schema, records: list[Record], defaults: Mapping[str, Any]) -> pa.Table:
    names = schema.names
    columns: list[list[Any]] = [[] for _ in names]
    for rec in records:
        if isinstance(rec, Mapping):
            values = [rec[n] if n in rec or n not in defaults else defaults[n] for n in names]
        else:
            values = list(rec)
            values += [defaults[n] for n in names[len(values) :] if n in defaults]
        if len(values) != len(names):
            raise ValueError(f"expected {names}, got {rec!r}")
        for col, v in zip(columns, values, strict=True):
            col.append(v)
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)], schema=schema)


def write_export(
    out: Path,
    rows: Iterable[Record],
    blobs: Iterable[Record],
    aliases: Iterable[Record],
    snapshot_ms: int,
    *,
    parts: int = 1,
    outcomes: Iterable[Record] | None = None,
    generations: Iterable[Record] | None = None,
    policies: Iterable[Record] | None = None,
    version: int = FORMAT_VERSION,
) -> dict[str, Any]:
    """Write OUT/{rows,blobs,aliases}/part-NNNNN.parquet and OUT/manifest.json; returns the manifest.

    Records are tuples in schema order (rows: vin, request_id, ts_ms, sha1, size, expires_at_ms,
    await_response, high_priority; blobs: sha1, created_ms, touched_ms, size; aliases: data_id, sha1,
    ts_ms; outcomes: vin, request_id, sha1 hex, outcome, ended_ms, stored_ms, attempts, response,
    response_bytes, sent_ms; generations: request_id, sha1 hex, first_ms, last_ms, then the eight counts;
    policies: request_id, policy JSON, set_ms, aborted JSON or None) or dicts; the columns of
    ADDED_IN_2 and ADDED_IN_3 may be left off (the end of a tuple) and take their "nothing" value.
    `version` 1 (2) writes an export from before them (before ADDED_IN_3's). `outcomes`,
    `generations` and `policies` are written only when given (without them: an export of a server
    from before they existed). `parts` splits each non-empty table into that many part files; an
    empty table still gets one part file with the schema.
    """
    counts = {}
    tables = [
        ("rows", rows),
        ("blobs", blobs),
        ("aliases", aliases),
        ("outcomes", outcomes),
        ("generations", generations),
        ("policies", policies),
    ]
    for name, records in tables:
        if records is None:
            continue
        table = _table(_schema(name, version), list(records), _added(name, version))
        (out / name).mkdir(parents=True, exist_ok=True)
        n_parts = max(1, min(parts, table.num_rows))
        step = -(-table.num_rows // n_parts) if table.num_rows else 0
        for i in range(n_parts):
            pq.write_table(table.slice(i * step, step) if step else table, out / name / f"part-{i:05d}.parquet")
        counts[name] = table.num_rows
    manifest = {
        "format": "sdv-fanout-export",
        "format_version": version,
        "schema_version": 3 if version >= 2 else 2,
        "snapshot_ms": snapshot_ms,
        "counts": counts,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
