"""Fleet report over an export: what is pending, of which kind, how old, and which vehicles lag most.

    spark-submit spark/report_job.py --export OUT --out REPORT [--max-pending-per-vehicle 1000]
    python -m spark.report_job --export OUT --out REPORT [--master local[4]]

Every row of an export is a request its vehicle has not acknowledged ("pending"). REPORT gets the
tables by_task_type, age_histogram, top_vins, at_bound and expiring_requests (Parquet and CSV),
report.png, report.json and README.md; spark/README.md describes each.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # spark-submit spark/report_job.py: make the `spark` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as sf

from spark import check_count, child, qualify, read_manifest, read_table, session, task_type, write_bytes, write_json

REPORT_FORMAT = "sdv-fanout-fleet-report"
TOP_VINS = 20
#: The server's default max_pending_per_vehicle: a vehicle with this many pending rows gets no new one.
DEFAULT_BACKLOG_BOUND = 1000
#: Rows of the expiring_requests table (the whole count is in the totals).
EXPIRING_REQUESTS = 50

_H = 3_600_000
#: (label, lower bound inclusive, upper bound exclusive) of age = snapshot_ms - ts_ms. Negative ages (clock
#: skew) count as <1h.
AGE_BUCKETS: list[tuple[str, int | None, int | None]] = [
    ("<1h", None, _H),
    ("1-6h", _H, 6 * _H),
    ("6-24h", 6 * _H, 24 * _H),
    ("1-3d", 24 * _H, 72 * _H),
    ("3-7d", 72 * _H, 168 * _H),
    (">7d", 168 * _H, None),
]

SCHEMAS = {
    "by_task_type": "task_type string, pending long, vins long, bytes long, oldest_ts_ms long",
    "age_histogram": "bucket_index int, bucket string, min_age_ms long, max_age_ms long, pending long, bytes long",
    "top_vins": "rank int, vin string, pending long, bytes long, oldest_ts_ms long, oldest_age_ms long",
    "at_bound": "rank int, vin string, pending long, bytes long, oldest_ts_ms long, oldest_age_ms long",
    "expiring_requests": "rank int, request_id string, task_type string, pending long, overdue long, "
    "earliest_expires_at_ms long, latest_expires_at_ms long, expires_in_ms long, oldest_ts_ms long",
}

README = """# sdv-fanout fleet report

Export: {export}
Snapshot: {snapshot} (snapshot_ms {snapshot_ms}); {pending} pending requests for {vins} vehicles.
Backlog bound: {bound}. Expiry: {with_expiry} pending rows of {expiring} requests carry an expires_at, \
{overdue} of them past it. {awaiting} pending rows end with the vehicle's answer (await_response), sent or not.

Every row of the export is a request stored and not yet acknowledged by its vehicle: "pending".

| file | what |
|---|---|
| `report.png` | the first three tables below as charts |
| `parquet/by_task_type/`, `csv/by_task_type/` | pending requests per task type: request ids `task_<type>_<n>` \
grouped by `<type>`, others as `other`; distinct vehicles, bytes, oldest request time (ms) |
| `parquet/age_histogram/`, `csv/age_histogram/` | pending requests by age at the snapshot (snapshot_ms - ts_ms): \
<1h, 1-6h, 6-24h, 1-3d, 3-7d, >7d; bounds in ms, lower inclusive |
| `parquet/top_vins/`, `csv/top_vins/` | the {top} vehicles with the most pending requests (ties: oldest first) |
| `parquet/at_bound/`, `csv/at_bound/` | vehicles with at least `max_pending_per_vehicle` pending requests \
(the server refuses them new ones, reason `vehicle_backlog_full`): the {top} whose oldest request is oldest; \
empty when the report was run with `--max-pending-per-vehicle 0` |
| `parquet/expiring_requests/`, `csv/expiring_requests/` | requests whose pending rows carry an `expires_at`: \
the {expiring_top} expiring soonest, with their pending rows, how many are past it (`overdue`: never sent, \
the server's sweep ends them `expired`), earliest and latest expiry, and `expires_in_ms` (earliest - snapshot) |
| `report.json` | the snapshot, the totals, and the same tables as JSON |

A row's time is when it was last written (a newer batch with the same VIN and request id replaces it).
`bytes` is what delivery would send (the payload size, once per row); a payload shared by many rows is
stored once. Rows older than the retention period (7 days by default: the >7d bucket) are still here
until GC deletes them.

Not in this report: deliveries per day. The rows are what is pending; deliveries are in the export's
outcome records, which the campaign report (spark/campaign_job.py) reads.
"""


def pending_rows(rows: DataFrame, snapshot_ms: int) -> DataFrame:
    """Rows with their task type and age bucket (and what the lifecycle sections read)."""
    age = sf.lit(snapshot_ms) - sf.col("ts_ms")
    bucket = sf.lit(len(AGE_BUCKETS) - 1)
    for i, (_, _, upper) in reversed(list(enumerate(AGE_BUCKETS[:-1]))):
        bucket = sf.when(age < sf.lit(upper), i).otherwise(bucket)  # upper: every bucket but the last has one
    return rows.select(
        "vin",
        "request_id",
        "ts_ms",
        "size",
        "expires_at_ms",
        "await_response",
        task_type("request_id").alias("task_type"),
        age.alias("age_ms"),
        bucket.cast("int").alias("bucket_index"),
    )


def report_tables(pending: DataFrame, snapshot_ms: int, bound: int) -> tuple[dict[str, list[Row]], dict[str, Any]]:
    """The tables, computed on the cluster and collected (they are small by construction), and the
    lifecycle totals: vehicles at the backlog `bound` (None when 0: not asked), rows and requests
    with an expiry, rows past it, rows awaiting an answer."""
    by_type = (
        pending.groupBy("task_type")
        .agg(
            sf.count(sf.lit(1)).alias("pending"),
            sf.countDistinct("vin").alias("vins"),
            sf.coalesce(sf.sum("size"), sf.lit(0)).alias("bytes"),
            sf.min("ts_ms").alias("oldest_ts_ms"),
        )
        .orderBy(sf.desc("pending"), "task_type")
    )
    counts = {
        r["bucket_index"]: r
        for r in pending.groupBy("bucket_index")
        .agg(sf.count(sf.lit(1)).alias("pending"), sf.coalesce(sf.sum("size"), sf.lit(0)).alias("bytes"))
        .collect()
    }
    histogram = [
        Row(
            bucket_index=i,
            bucket=label,
            min_age_ms=lo,
            max_age_ms=hi,
            pending=counts[i]["pending"] if i in counts else 0,
            bytes=counts[i]["bytes"] if i in counts else 0,
        )
        for i, (label, lo, hi) in enumerate(AGE_BUCKETS)
    ]
    per_vin = (
        pending.groupBy("vin")
        .agg(
            sf.count(sf.lit(1)).alias("pending"),
            sf.coalesce(sf.sum("size"), sf.lit(0)).alias("bytes"),
            sf.min("ts_ms").alias("oldest_ts_ms"),
        )
        .withColumn("oldest_age_ms", sf.lit(snapshot_ms) - sf.col("oldest_ts_ms"))
    )
    tables = {
        "by_task_type": by_type.collect(),
        "age_histogram": histogram,
        "top_vins": ranked(per_vin, "top_vins", TOP_VINS, sf.desc("pending"), "oldest_ts_ms", "vin"),
        "at_bound": [],
        "expiring_requests": expiring_requests(pending, snapshot_ms),
    }
    expires = sf.col("expires_at_ms")
    lifecycle = (
        pending.agg(
            sf.count(expires).alias("rows_with_expiry"),
            sf.count(sf.when(expires <= snapshot_ms, 1)).alias("overdue_rows"),
            sf.countDistinct(sf.when(expires.isNotNull(), sf.col("request_id"))).alias("requests_with_expiry"),
            sf.count(sf.when(sf.col("await_response"), 1)).alias("await_response_rows"),
        )
        .collect()[0]
        .asDict()
    )
    lifecycle["backlog_bound"] = bound or None
    lifecycle["vins_at_bound"] = None
    if bound:
        # The bound is the server's max_pending_per_vehicle: they all hold about as many, so the ones
        # whose oldest request waits longest come first.
        full = per_vin.where(sf.col("pending") >= bound)
        lifecycle["vins_at_bound"] = full.count()
        tables["at_bound"] = ranked(full, "at_bound", TOP_VINS, "oldest_ts_ms", sf.desc("pending"), "vin")
    return tables, lifecycle


def ranked(df: DataFrame, table: str, limit: int, *order: Any) -> list[Row]:
    """The first `limit` rows of `df` in `order`, numbered from 1 (`rank`), in the columns of SCHEMAS[table]."""
    columns = [field.split()[0] for field in SCHEMAS[table].split(", ")]
    found = df.orderBy(*order).limit(limit).select(*columns[1:]).collect()
    return [Row(rank=n, **r.asDict()) for n, r in enumerate(found, 1)]


def expiring_requests(pending: DataFrame, snapshot_ms: int) -> list[Row]:
    """Requests with pending rows that carry an expires_at, the EXPIRING_REQUESTS expiring soonest."""
    expires = sf.col("expires_at_ms")
    requests = (
        pending.where(expires.isNotNull())
        .groupBy("request_id", "task_type")
        .agg(
            sf.count(sf.lit(1)).alias("pending"),
            sf.count(sf.when(expires <= snapshot_ms, 1)).alias("overdue"),
            sf.min(expires).alias("earliest_expires_at_ms"),
            sf.max(expires).alias("latest_expires_at_ms"),
            sf.min("ts_ms").alias("oldest_ts_ms"),
        )
        .withColumn("expires_in_ms", sf.col("earliest_expires_at_ms") - sf.lit(snapshot_ms))
    )
    return ranked(requests, "expiring_requests", EXPIRING_REQUESTS, "earliest_expires_at_ms", "request_id")


def chart_png(tables: dict[str, list[Row]], title: str, total: int, bound: int | None = None) -> bytes:
    """Three panels: pending by task type, age histogram, top VINs (with the backlog `bound` drawn when
    a vehicle is at it)."""
    from matplotlib.figure import Figure  # Agg canvas; no pyplot, no display

    fig = Figure(figsize=(18, 6), layout="constrained")
    fig.suptitle(title)
    ax_type, ax_age, ax_vin = fig.subplots(1, 3, width_ratios=[1, 1, 1.2])

    types = tables["by_task_type"][:15][::-1]
    bars = ax_type.barh([r["task_type"] for r in types], [r["pending"] for r in types], color="tab:blue")
    ax_type.bar_label(bars, padding=2)
    more = len(tables["by_task_type"]) - 15
    ax_type.set_title("Pending requests by task type" + (f" (top 15 of {more + 15})" if more > 0 else ""))
    ax_type.set_xlabel("pending requests")

    hist = tables["age_histogram"]
    colors = ["tab:green", "tab:green", "tab:olive", "tab:orange", "tab:orange", "tab:red"]
    bars = ax_age.bar([r["bucket"] for r in hist], [r["pending"] for r in hist], color=colors)
    ax_age.bar_label(bars, padding=2)
    ax_age.set_title("Age of pending requests at the snapshot")
    ax_age.set_ylabel("pending requests")

    top = tables["top_vins"][::-1]
    bars = ax_vin.barh([r["vin"] for r in top], [r["pending"] for r in top], color="tab:purple")
    ax_vin.bar_label(bars, padding=2)
    ax_vin.set_title(f"Top {TOP_VINS} vehicles by backlog")
    if bound and top and top[-1]["pending"] >= bound:
        ax_vin.axvline(bound, color="tab:red", linestyle="--", label=f"max_pending_per_vehicle {bound}")
        ax_vin.legend(loc="lower right", fontsize=8)
    ax_vin.set_xlabel("pending requests")
    ax_vin.tick_params(axis="y", labelsize=8)

    for ax in (ax_type, ax_age, ax_vin):
        ax.margins(x=0.12, y=0.08)
        if total == 0:
            ax.text(0.5, 0.5, "nothing pending", ha="center", va="center", transform=ax.transAxes, color="gray")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def build_report(
    spark: SparkSession, export_uri: str, out_uri: str, max_pending_per_vehicle: int = DEFAULT_BACKLOG_BOUND
) -> dict[str, Any]:
    """Write the report under `out_uri` (any Hadoop URI); returns report.json's content.
    `max_pending_per_vehicle`: the server's backlog bound (0: no at-bound section)."""
    if max_pending_per_vehicle < 0:
        raise ValueError("max_pending_per_vehicle must be >= 0 (0 = skip the at-bound section)")
    manifest = read_manifest(spark, export_uri)
    snapshot_ms: int = manifest["snapshot_ms"]
    rows = read_table(spark, export_uri, "rows")
    total = check_count(manifest, "rows", rows)
    tables, lifecycle = report_tables(pending_rows(rows, snapshot_ms), snapshot_ms, max_pending_per_vehicle)
    for name, data in tables.items():
        df = spark.createDataFrame(data, SCHEMAS[name]).coalesce(1)
        df.write.mode("overwrite").parquet(child(child(out_uri, "parquet"), name))
        df.write.mode("overwrite").option("header", True).csv(child(child(out_uri, "csv"), name))
    vins = rows.select("vin").distinct().count()
    snapshot = datetime.fromtimestamp(snapshot_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    export = qualify(spark, export_uri)
    title = f"sdv-fanout fleet report: {total} pending requests, {vins} vehicles, snapshot {snapshot}"
    write_bytes(spark, child(out_uri, "report.png"), chart_png(tables, title, total, max_pending_per_vehicle))
    bound = (
        f"{lifecycle['vins_at_bound']} vehicles hold at least {max_pending_per_vehicle} pending requests"
        if max_pending_per_vehicle
        else "not checked (--max-pending-per-vehicle 0)"
    )
    text = README.format(
        export=export,
        snapshot=snapshot,
        snapshot_ms=snapshot_ms,
        pending=total,
        vins=vins,
        top=TOP_VINS,
        expiring_top=EXPIRING_REQUESTS,
        bound=bound,
        with_expiry=lifecycle["rows_with_expiry"],
        expiring=lifecycle["requests_with_expiry"],
        overdue=lifecycle["overdue_rows"],
        awaiting=lifecycle["await_response_rows"],
    )
    write_bytes(spark, child(out_uri, "README.md"), text.encode())
    report = {
        "format": REPORT_FORMAT,
        "format_version": 1,
        "export": export,
        "snapshot_ms": snapshot_ms,
        "pending": total,
        "vins": vins,
        **lifecycle,
        "tables": {name: [r.asDict() for r in data] for name, data in tables.items()},
    }
    write_json(spark, child(out_uri, "report.json"), report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="report_job", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--export", required=True, help="export directory or URI (holds manifest.json)")
    parser.add_argument("--out", required=True, help="report directory or URI to write (its tables are replaced)")
    parser.add_argument(
        "--max-pending-per-vehicle",
        type=int,
        default=DEFAULT_BACKLOG_BOUND,
        help="the server's backlog bound: list the vehicles with at least this many pending requests "
        f"(default {DEFAULT_BACKLOG_BOUND}, the server's default; 0 = skip)",
    )
    parser.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    args = parser.parse_args(argv)
    if args.max_pending_per_vehicle < 0:
        parser.error("--max-pending-per-vehicle must be >= 0 (0 = skip)")
    spark = session("sdv-fanout-fleet-report", args.master)
    try:
        report = build_report(spark, args.export, args.out, args.max_pending_per_vehicle)
    finally:
        spark.stop()
    print(json.dumps({k: v for k, v in report.items() if k != "tables"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
