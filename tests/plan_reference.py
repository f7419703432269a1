"""A pure-Python GC plan over an export: the rules of storage/lmdb/gc.py, written a second way.

Tests use it to check `gc apply` without Spark, and to check the Spark job against it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq


def read(export: Path, table: str) -> list[dict[str, Any]]:
    return ds.dataset(export / table, format="parquet").to_table().to_pylist()  # type: ignore[no-any-return]


def reference_plan(export: Path, retention_ms: int, grace_ms: int) -> dict[str, Any]:
    manifest = json.loads((export / "manifest.json").read_text())
    snap = manifest["snapshot_ms"]
    cutoff = snap - retention_ms
    rows, blobs, aliases = read(export, "rows"), read(export, "blobs"), read(export, "aliases")
    live = {r["sha1"] for r in rows if r["ts_ms"] >= cutoff} | {a["sha1"] for a in aliases if a["ts_ms"] >= cutoff}
    return {
        "snapshot_ms": snap,
        "expired_rows": sorted((r["vin"], r["request_id"], r["ts_ms"]) for r in rows if r["ts_ms"] < cutoff),
        "expired_aliases": sorted((a["data_id"], a["ts_ms"]) for a in aliases if a["ts_ms"] < cutoff),
        "garbage_blobs": sorted(
            (b["sha1"], b["size"])
            for b in blobs
            if b["sha1"] not in live and max(b["created_ms"], b["touched_ms"]) < snap - grace_ms
        ),
    }


def write_plan(plan_dir: Path, plan: dict[str, Any], retention_ms: int, grace_ms: int) -> None:
    """Write the plan in the layout spark/gc_job.py produces."""
    tables = {
        "expired_rows": (["vin", "request_id", "ts_ms"], [pa.string(), pa.string(), pa.int64()]),
        "expired_aliases": (["data_id", "ts_ms"], [pa.string(), pa.int64()]),
        "garbage_blobs": (["sha1", "size"], [pa.binary(), pa.int64()]),
    }
    for name, (cols, types) in tables.items():
        (plan_dir / name).mkdir(parents=True, exist_ok=True)
        schema = pa.schema(list(zip(cols, types, strict=True)))
        columns = list(zip(*plan[name], strict=True)) or [[] for _ in cols]
        table = pa.Table.from_arrays([pa.array(c, type=t) for c, t in zip(columns, types, strict=True)], schema=schema)
        pq.write_table(table, plan_dir / name / "part-00000.parquet")
    (plan_dir / "summary.json").write_text(
        json.dumps(
            {
                "format": "sdv-fanout-gc-plan",
                "format_version": 1,
                "export": "",
                "snapshot_ms": plan["snapshot_ms"],
                "retention_ms": retention_ms,
                "grace_ms": grace_ms,
                "counts": {k: len(plan[k]) for k in tables},
            }
        )
    )
