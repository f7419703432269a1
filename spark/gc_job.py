"""GC plan over an export: the rules of storage/lmdb/gc.py as of the export's snapshot, for `sdv-fanout gc apply`.

    spark-submit spark/gc_job.py --export OUT --plan PLAN --retention 7d --grace 1h
    python -m spark.gc_job --export OUT --plan PLAN --retention 7d --grace 1h [--master local[4]]

PLAN lists candidates only (expired_rows, expired_aliases, garbage_blobs; spark/README.md): apply
re-checks each one against the live store in its write transaction. summary.json is written last,
so a plan without it is incomplete.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # spark-submit spark/gc_job.py: make the `spark` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from spark import check_count, child, delete, parse_duration_ms, qualify, read_manifest, read_table, session, write_json

PLAN_FORMAT = "sdv-fanout-gc-plan"
PLAN_FORMAT_VERSION = 1
#: As exhook_server.config: the grace must outlast any ingest still committing (its touch time is taken before).
MIN_GRACE_MS = 60_000


def plan_frames(
    rows: DataFrame, blobs: DataFrame, aliases: DataFrame, cutoff_ms: int, blob_cutoff_ms: int
) -> dict[str, DataFrame]:
    """The three plan tables, lazily. Anything unreadable (a null time) counts as live: kept, never deleted."""
    expired_rows = rows.where(sf.col("ts_ms") < cutoff_ms).select("vin", "request_id", "ts_ms")
    expired_aliases = aliases.where(sf.col("ts_ms") < cutoff_ms).select("data_id", "ts_ms")
    still = sf.col("ts_ms").isNull() | (sf.col("ts_ms") >= cutoff_ms)
    live = rows.where(still).select("sha1").unionByName(aliases.where(still).select("sha1")).distinct()
    last_use = sf.greatest(sf.col("created_ms"), sf.coalesce(sf.col("touched_ms"), sf.lit(0)))
    garbage = (
        blobs.join(live, "sha1", "left_anti")
        .where(sf.col("created_ms").isNotNull() & (last_use < blob_cutoff_ms))
        .select("sha1", "size")
    )
    return {"expired_rows": expired_rows, "expired_aliases": expired_aliases, "garbage_blobs": garbage}


def build_plan(
    spark: SparkSession, export_uri: str, plan_uri: str, retention_ms: int, grace_ms: int, *, files: int = 4
) -> dict[str, Any]:
    """Write PLAN/{expired_rows,expired_aliases,garbage_blobs}/ and then PLAN/summary.json; returns the summary."""
    if retention_ms <= 0 or files < 1:
        raise ValueError("retention and files must be positive")
    if grace_ms < MIN_GRACE_MS:
        raise ValueError(f"grace must be at least {MIN_GRACE_MS // 1000}s: it must outlast any ingest still committing")
    manifest = read_manifest(spark, export_uri)
    snapshot_ms: int = manifest["snapshot_ms"]
    summary_uri = child(plan_uri, "summary.json")
    delete(spark, summary_uri)  # a plan that fails half-way must not look complete
    tables = {name: read_table(spark, export_uri, name) for name in ("rows", "blobs", "aliases")}
    totals = {name: check_count(manifest, name, df) for name, df in tables.items()}
    frames = plan_frames(
        tables["rows"], tables["blobs"], tables["aliases"], snapshot_ms - retention_ms, snapshot_ms - grace_ms
    )
    for name, df in frames.items():
        df.coalesce(files).write.mode("overwrite").parquet(child(plan_uri, name))
    # Count what was written (what apply will read), not a recomputation.
    written = {name: spark.read.parquet(child(plan_uri, name)) for name in frames}
    garbage = written["garbage_blobs"].agg(sf.count(sf.lit(1)).alias("n"), sf.sum("size").alias("bytes")).first()
    assert garbage is not None
    counts = {
        "expired_rows": written["expired_rows"].count(),
        "expired_aliases": written["expired_aliases"].count(),
        "garbage_blobs": int(garbage["n"]),
        "garbage_bytes": int(garbage["bytes"] or 0),
    }
    counts["rows_kept"] = totals["rows"] - counts["expired_rows"]
    counts["blobs_kept"] = totals["blobs"] - counts["garbage_blobs"]
    summary = {
        "format": PLAN_FORMAT,
        "format_version": PLAN_FORMAT_VERSION,
        "export": qualify(spark, export_uri),
        "snapshot_ms": snapshot_ms,
        "retention_ms": retention_ms,
        "grace_ms": grace_ms,
        "counts": counts,
    }
    write_json(spark, summary_uri, summary)
    return summary


def _duration(text: str) -> int:
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gc_job", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--export", required=True, help="export directory or URI (holds manifest.json)")
    parser.add_argument("--plan", required=True, help="plan directory or URI to write (replaced)")
    parser.add_argument("--retention", required=True, type=_duration, help="e.g. 7d (the server's retention_s)")
    parser.add_argument("--grace", required=True, type=_duration, help="e.g. 1h (the server's gc_grace_s)")
    parser.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    parser.add_argument("--files", type=int, default=4, help="at most this many Parquet files per plan table")
    args = parser.parse_args(argv)
    spark = session("sdv-fanout-gc-plan", args.master)
    try:
        summary = build_plan(spark, args.export, args.plan, args.retention, args.grace, files=args.files)
    finally:
        spark.stop()
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
