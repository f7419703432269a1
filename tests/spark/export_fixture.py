"""Write exports in storage/export.py's layout with pyarrow, for the Spark job tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMAS = {
    "rows": pa.schema(
        [
            ("vin", pa.string()),
            ("request_id", pa.string()),
            ("ts_ms", pa.int64()),
            ("sha1", pa.binary()),
            ("size", pa.int64()),
        ]
    ),
    "blobs": pa.schema(
        [("sha1", pa.binary()), ("created_ms", pa.int64()), ("touched_ms", pa.int64()), ("size", pa.int64())]
    ),
    "aliases": pa.schema([("data_id", pa.string()), ("sha1", pa.binary()), ("ts_ms", pa.int64())]),
}

Record = Sequence[Any] | Mapping[str, Any]


def _table(schema: pa.Schema, records: list[Record]) -> pa.Table:
    names = schema.names
    columns: list[list[Any]] = [[] for _ in names]
    for rec in records:
        values = [rec[n] for n in names] if isinstance(rec, Mapping) else list(rec)
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
) -> dict[str, Any]:
    """Write OUT/{rows,blobs,aliases}/part-NNNNN.parquet and OUT/manifest.json; returns the manifest.

    Records are tuples in schema order (rows: vin, request_id, ts_ms, sha1, size; blobs: sha1,
    created_ms, touched_ms, size; aliases: data_id, sha1, ts_ms) or dicts. `parts` splits each
    non-empty table into that many part files; an empty table still gets one part file with the schema.
    """
    counts = {}
    for name, records in (("rows", rows), ("blobs", blobs), ("aliases", aliases)):
        table = _table(SCHEMAS[name], list(records))
        (out / name).mkdir(parents=True, exist_ok=True)
        n_parts = max(1, min(parts, table.num_rows))
        step = -(-table.num_rows // n_parts) if table.num_rows else 0
        for i in range(n_parts):
            pq.write_table(table.slice(i * step, step) if step else table, out / name / f"part-{i:05d}.parquet")
        counts[name] = table.num_rows
    manifest = {
        "format": "sdv-fanout-export",
        "format_version": 1,
        "schema_version": 1,
        "snapshot_ms": snapshot_ms,
        "counts": counts,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
