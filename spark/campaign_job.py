"""Campaign report over an export: per generation of each request, how far it got and how fast.

    spark-submit spark/campaign_job.py --export OUT --out REPORT [--bucket 1h]
    python -m spark.campaign_job --export OUT --out REPORT [--bucket 1h] [--master local[4]]

A generation is one (request_id, payload sha1). REPORT gets generations.csv, by_task_type.csv,
delivered_over_time.csv, delivered_by_task_type.csv, count_check.csv (counts that differ from a
recount), campaigns.csv and rate_per_minute.csv (requests with a campaign policy; campaigns.png
when one sets a rate), report.png, report.json and README.md; spark/README.md describes each.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # spark-submit spark/campaign_job.py: make the `spark` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from spark import (
    check_count,
    child,
    delete,
    exists,
    parse_duration_ms,
    qualify,
    read_manifest,
    read_table,
    require_tables,
    session,
    task_type,
    write_bytes,
    write_json,
)
from spark.campaign_policy import CAMPAIGN_COLUMNS, RATE_COLUMNS, policy_section
from spark.campaign_policy import chart_png as campaigns_png

REPORT_FORMAT = "sdv-fanout-campaign-report"
#: The states a (VIN, generation) can be in: pending (a row holds it), or how it ended. Their names are
#: the export's `outcome` values and its generation count columns (storage/keys.COUNT_NAMES).
STATES = ("pending", "delivered", "superseded", "cancelled", "expired", "failed", "responded")
COUNTS = ("total", *STATES)
PERCENTILES = (0.5, 0.95, 0.99)
#: Time to delivery (`delivered`: store to PUBACK) and time to response (`responded`: store to the
#: vehicle's answer), as columns.
LATENCY = tuple(f"p{round(p * 100)}_ms" for p in PERCENTILES)
RESPONSE_LATENCY = tuple(f"response_{c}" for c in LATENCY)
#: The outcomes with a time from store to end in the report and a series over time: the vehicle took
#: the request (its PUBACK; its answer).
REACHED = ("delivered", "responded")
#: Outcome records the percentiles cover, per generation and task type (GC may have removed older ones).
RECORDS = tuple(f"{outcome}_records" for outcome in REACHED)
#: Bucket widths of the delivered-over-time series: the smallest that spans the deliveries in MAX_BUCKETS.
BUCKET_LADDER_MS = (60_000, 300_000, 900_000, 3_600_000, 21_600_000, 86_400_000, 604_800_000)
MAX_BUCKETS = 240
#: A --bucket that would give more buckets than this is refused: the series is dense (every bucket a row).
MAX_BUCKETS_ASKED = 20_000
#: Task types drawn in the chart's lower panel (those with the most deliveries and answers); the CSV has them all.
CHART_TYPES = 8

#: Check of a generation's stored counts against the recount from rows and outcome records.
CHECK_OK = "ok"
#: Only finished counts exceed the recount, pending agrees: GC removed outcome records older than
#: outcome_retention_s and the counts kept them. Expected, not an error.
CHECK_COLLECTED = "records_collected"
#: Anything else: pending differs, a record the counts miss, a generation on one side only.
CHECK_MISMATCH = "mismatch"

GENERATION_COLUMNS = (
    "request_id",
    "sha1",
    "task_type",
    "first_ms",
    "last_ms",
    *COUNTS,
    "oldest_pending_ms",
    "delivered_records",
    *LATENCY,
    "responded_records",
    *RESPONSE_LATENCY,
    "check",
)
TYPE_COLUMNS = (
    "task_type",
    "generations",
    *COUNTS,
    "oldest_pending_ms",
    "delivered_records",
    *LATENCY,
    "responded_records",
    *RESPONSE_LATENCY,
)
SERIES_COLUMNS = ("bucket_ms", "bucket", "delivered", "cumulative", "responded", "responded_cumulative")
TYPE_SERIES_COLUMNS = ("bucket_ms", "bucket", "task_type", *SERIES_COLUMNS[2:])
CHECK_COLUMNS = (
    "request_id",
    "sha1",
    "check",
    *(f"stored_{c}" for c in COUNTS),
    *(f"recounted_{c}" for c in COUNTS),
)

README = """# sdv-fanout campaign report

Export: {export}
Snapshot: {snapshot} (snapshot_ms {snapshot_ms}); {generations} generations, {total} (vehicle, request) pairs,
{delivered} delivered, {responded} responded, {cancelled} cancelled, {expired} expired, {failed} failed,
{pending} pending. Over-time buckets: {bucket_ms} ms.
Count check: {checks}.

A generation is one (request_id, payload sha1): a request id sent again with another payload is a new
generation. Each of its (vehicle, generation) pairs is pending (stored, not yet ended) or ended once:
delivered (the vehicle's PUBACK), responded (a request that awaited the vehicle's answer got it),
superseded (replaced by a newer payload before delivery), cancelled (by the platform's cancel),
expired (its `expires_at` passed, or the retention period) or failed (refused by the broker too often,
`max_attempts` sends without a PUBACK, or no answer within `response_timeout_s`). `total` counts every pair.

| file | what |
|---|---|
| `generations.csv` | per generation, newest first: the counts as the server keeps them, first and last change \
(ms), the oldest pending row's store time, time from store to delivery over its delivery records \
(`p50_ms`, `p95_ms`, `p99_ms`) and from store to the vehicle's answer over its response records \
(`response_p50_ms`, ...): in ms, exact, interpolated between the two nearest values, to 0.001 ms |
| `by_task_type.csv` | the same per task type: request ids `task_<type>_<n>` grouped by `<type>`, others as `other` |
| `delivered_over_time.csv` | deliveries (`delivered`) and answers (`responded`) per bucket of their end time \
(`bucket_ms` is its start, UTC) and their running totals; every bucket from the first to the last |
| `delivered_by_task_type.csv` | the same per task type |
| `count_check.csv` | generations whose counts differ from a recount of pending rows and outcome records; \
`records_collected`: only ended counts are higher and pending agrees (GC removed outcome records older \
than `outcome_retention_s`; the counts keep them); `mismatch`: anything else, worth a look |
| `campaigns.csv` | per request with a campaign policy ({campaigns}): the policy as set, deliveries per minute \
(peak, and against the policy's rate), time inside and outside its windows and deliveries in each, its abort \
(time, criterion, counts then, pairs cancelled by it and those that ended otherwise after it) |
| `rate_per_minute.csv` | per such request and UTC minute with a delivery: deliveries (PUBACK time standing for \
the start) and what its rate allowed in that minute (`policy_per_minute`, the ramp included) |
| `campaigns.png` | when a policy sets a rate: deliveries per minute against it, one panel per paced request |
| `report.png` | deliveries and answers over time (all, and by task type) |
| `report.json` | everything above as JSON |

Times to delivery cover delivered pairs whose outcome record is still kept (`delivered_records`), times to
response the responded ones (`responded_records`); pending pairs have none yet, so a generation with many
pending has optimistic percentiles: its `oldest_pending_ms` shows how long the longest wait has been so far.
"""


def pairs(rows: DataFrame, outcomes: DataFrame) -> DataFrame:
    """Every (VIN, generation) in the export with its state: each pending row and each outcome record."""
    pending = rows.select(
        "request_id",
        sf.lower(sf.hex("sha1")).alias("sha1"),
        sf.lit("pending").alias("state"),
        sf.lit(None).cast("long").alias("ended_ms"),
        sf.col("ts_ms").alias("stored_ms"),
    )
    ended = outcomes.select("request_id", "sha1", sf.col("outcome").alias("state"), "ended_ms", "stored_ms")
    return pending.unionByName(ended).withColumn("task_type", task_type("request_id"))


def recount(pairs: DataFrame) -> list[dict[str, Any]]:
    """Per generation, per task type and over all (`level`: generation, task_type, all): the counts
    recounted from the pairs, the oldest pending row, and the delivery and response time percentiles.

    One aggregation over grouping sets, so the export is read once. `percentile` is exact: it keeps
    each group's distinct delivery (and response) times (a few MB for a million deliveries), and
    interpolates linearly between the two nearest ranks like numpy's default.
    """
    state = sf.col("state")
    aggs = [
        sf.count(sf.lit(1)).alias("total"),
        *(sf.count(sf.when(state == name, 1)).alias(name) for name in STATES),
        sf.min(sf.when(state == "pending", sf.col("stored_ms"))).alias("oldest_pending_ms"),
    ]
    for outcome in REACHED:
        ended = state == outcome
        latency = sf.when(ended, sf.col("ended_ms") - sf.col("stored_ms"))
        aggs += [
            sf.count(latency).alias(f"{outcome}_records"),
            sf.percentile(latency, list(PERCENTILES)).alias(f"{outcome}_latency"),
            sf.min(sf.when(ended, sf.col("ended_ms"))).alias(f"first_{outcome}_ms"),
            sf.max(sf.when(ended, sf.col("ended_ms"))).alias(f"last_{outcome}_ms"),
        ]
    aggs.append(sf.grouping_id().alias("gid"))
    levels = {0: "generation", 3: "task_type", 7: "all"}  # grouping_id bits: task_type, request_id, sha1
    grouped = pairs.groupingSets(
        [["task_type", "request_id", "sha1"], ["task_type"], []], "task_type", "request_id", "sha1"
    ).agg(*aggs)
    out = []
    for row in grouped.collect():
        rec = row.asDict()
        rec["level"] = levels[rec.pop("gid")]
        for columns, outcome in ((LATENCY, "delivered"), (RESPONSE_LATENCY, "responded")):
            # Inputs are whole ms: rounding to µs drops only float noise of the interpolation (…1999999995).
            found = rec.pop(f"{outcome}_latency") or [None] * len(columns)
            rec.update(zip(columns, [None if p is None else round(p, 3) for p in found], strict=True))
        out.append(rec)
    if not any(r["level"] == "all" for r in out):  # an empty export has no groups at all
        out.append({"level": "all", **dict.fromkeys((*COUNTS, *RECORDS), 0)})
    return out


def check(stored: dict[str, Any] | None, recounted: dict[str, Any] | None) -> str:
    """How a generation's stored counts compare with the recount (CHECK_*)."""
    if stored is None:
        return CHECK_MISMATCH
    again = recounted or dict.fromkeys(COUNTS, 0)
    if all(stored[c] == again[c] for c in COUNTS):
        return CHECK_OK
    ended = STATES[1:]
    if stored["pending"] == again["pending"] and all(stored[c] >= again[c] for c in ended):
        missing = sum(stored[c] - again[c] for c in ended)
        if stored["total"] - again["total"] == missing:
            return CHECK_COLLECTED
    return CHECK_MISMATCH


def bucket_width_ms(first_ms: int, last_ms: int, asked_ms: int | None = None) -> int:
    """The delivered-over-time bucket: `asked_ms` if given, else the smallest ladder width that spans
    first..last in MAX_BUCKETS (whole days beyond the ladder)."""
    span = last_ms - first_ms + 1
    if asked_ms is not None:
        if asked_ms <= 0:
            raise ValueError("the bucket must be positive")
        if span // asked_ms >= MAX_BUCKETS_ASKED:
            raise ValueError(f"a {asked_ms} ms bucket gives more than {MAX_BUCKETS_ASKED} buckets: choose a wider one")
        return asked_ms
    for width in BUCKET_LADDER_MS:
        if -(-span // width) <= MAX_BUCKETS:
            return width
    day = 86_400_000
    return -(-span // (MAX_BUCKETS * day)) * day


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def delivered_series(outcomes: DataFrame, width_ms: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deliveries and answers per bucket (start = ended_ms rounded down to a multiple of `width_ms`), over
    all and per task type, with running totals; dense from the first bucket of either to the last, so
    gaps show as zeros."""
    bucket = sf.col("ended_ms") - sf.pmod(sf.col("ended_ms"), sf.lit(width_ms))
    outcome = sf.col("outcome")
    counted = (
        outcomes.where(outcome.isin(*REACHED))
        .groupBy(bucket.alias("bucket_ms"), task_type("request_id").alias("task_type"))
        .agg(*(sf.count(sf.when(outcome == name, 1)).alias(name) for name in REACHED))
        .collect()
    )
    if not counted:
        return [], []
    per: dict[str, dict[int, tuple[int, int]]] = {}
    for r in counted:
        per.setdefault(r["task_type"], {})[r["bucket_ms"]] = (r["delivered"], r["responded"])
    starts = range(min(r["bucket_ms"] for r in counted), max(r["bucket_ms"] for r in counted) + 1, width_ms)

    def running(counts: dict[int, tuple[int, int]], **extra: Any) -> list[dict[str, Any]]:
        delivered = responded = 0
        out = []
        for b in starts:
            in_bucket, answered = counts.get(b, (0, 0))
            delivered, responded = delivered + in_bucket, responded + answered
            out.append(
                {
                    "bucket_ms": b,
                    "bucket": _utc(b),
                    **extra,
                    "delivered": in_bucket,
                    "cumulative": delivered,
                    "responded": answered,
                    "responded_cumulative": responded,
                }
            )
        return out

    overall: dict[int, tuple[int, int]] = {}
    for counts in per.values():
        for b, (in_bucket, answered) in counts.items():
            so_far = overall.get(b, (0, 0))
            overall[b] = (so_far[0] + in_bucket, so_far[1] + answered)
    by_type = [rec for name in sorted(per) for rec in running(per[name], task_type=name)]
    return running(overall), by_type


def build_tables(
    stored: Iterable[dict[str, Any]], recounted: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The generations, by-task-type and count-check tables and the totals, from the stored generations
    (with their task type; authoritative for counts) and the recount (pending rows, delivery times, the
    check). A generation found only by the recount is in the count check alone."""
    again = {(r["request_id"], r["sha1"]): r for r in recounted if r["level"] == "generation"}
    types = {r["task_type"]: r for r in recounted if r["level"] == "task_type"}
    everything = next(r for r in recounted if r["level"] == "all")
    generations, checks = [], []
    for g in stored:
        key = (g["request_id"], g["sha1"])
        r = again.pop(key, None)
        verdict = check(g, r)
        generations.append(
            {
                **{c: g[c] for c in ("request_id", "sha1", "task_type", "first_ms", "last_ms", *COUNTS)},
                **_timings(r),
                "check": verdict,
            }
        )
        if verdict != CHECK_OK:
            checks.append(_check_row(key, verdict, g, r))
    checks.extend(_check_row(key, CHECK_MISMATCH, None, r) for key, r in again.items())
    generations.sort(key=lambda g: (-g["first_ms"], g["request_id"], g["sha1"]))
    checks.sort(key=lambda c: (c["request_id"], c["sha1"]))

    by_type: dict[str, dict[str, Any]] = {}
    for g in generations:
        t = by_type.setdefault(
            g["task_type"], {"task_type": g["task_type"], "generations": 0, **dict.fromkeys(COUNTS, 0)}
        )
        t["generations"] += 1
        for c in COUNTS:
            t[c] += g[c]
    for name, t in by_type.items():
        t.update(_timings(types.get(name)))
    type_rows = sorted(by_type.values(), key=lambda t: (-t["total"], t["task_type"]))

    verdicts = [g["check"] for g in generations] + [CHECK_MISMATCH] * len(again)
    totals = {
        "generations": len(generations),
        **{c: sum(g[c] for g in generations) for c in COUNTS},
        **_timings(everything),
        **{f"{end}_{o}_ms": everything.get(f"{end}_{o}_ms") for o in REACHED for end in ("first", "last")},
        "checks": {v: verdicts.count(v) for v in (CHECK_OK, CHECK_COLLECTED, CHECK_MISMATCH)},
    }
    return generations, type_rows, checks, totals


def _timings(recounted: dict[str, Any] | None) -> dict[str, Any]:
    """What the recount adds to a generation, a task type or the totals: the oldest pending row, the
    outcome records the percentiles cover, and the percentiles (None where there are none)."""
    r = recounted or {}
    return {
        "oldest_pending_ms": r.get("oldest_pending_ms"),
        **{c: r.get(c) or 0 for c in RECORDS},
        **{p: r.get(p) for p in (*LATENCY, *RESPONSE_LATENCY)},
    }


def _check_row(
    key: tuple[str, str], verdict: str, stored: dict[str, Any] | None, recounted: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "request_id": key[0],
        "sha1": key[1],
        "check": verdict,
        **{f"stored_{c}": stored[c] if stored else None for c in COUNTS},
        **{f"recounted_{c}": recounted[c] if recounted else 0 for c in COUNTS},
    }


def csv_bytes(columns: Sequence[str], records: Iterable[dict[str, Any]]) -> bytes:
    """One CSV file with a header; None as an empty field."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    return buf.getvalue().encode()


def chart_png(series: list[dict[str, Any]], by_type: list[dict[str, Any]], width_ms: int, title: str) -> bytes:
    """Two panels sharing the time axis: deliveries and answers per bucket (stacked) with their running
    totals, and the running total of both together for the CHART_TYPES task types with the most."""
    from matplotlib import dates as mdates  # registers datetime axis units
    from matplotlib.figure import Figure  # Agg canvas; no pyplot, no display
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(14, 9), layout="constrained")
    fig.suptitle(title)
    ax_all, ax_type = fig.subplots(2, 1, sharex=True)
    width = timedelta(milliseconds=width_ms)

    def at(ms: int) -> datetime:
        return datetime.fromtimestamp(ms / 1000, tz=UTC)

    type_title = "Delivered or responded by task type, running total"
    if series:
        starts = [at(r["bucket_ms"]) for r in series]
        delivered = [r["delivered"] for r in series]
        bar = {"width": width * 0.9, "align": "edge"}
        ax_all.bar(starts, delivered, color="tab:blue", **bar)
        answered = any(r["responded"] for r in series)
        if answered:
            ax_all.bar(starts, [r["responded"] for r in series], bottom=delivered, color="tab:green", **bar)
        ax_cum = ax_all.twinx()
        ends = [starts[0], *(s + width for s in starts)]
        ax_cum.plot(ends, [0, *(r["cumulative"] for r in series)], color="tab:orange", label="delivered, running total")
        if answered:
            ax_cum.plot(
                ends,
                [0, *(r["responded_cumulative"] for r in series)],
                color="tab:olive",
                label="responded, running total",
            )
        ax_cum.set_ylabel("running total")
        ax_cum.set_ylim(bottom=0)
        ax_cum.legend(loc="upper left")
        totals: dict[str, int] = {}
        for r in by_type:
            totals[r["task_type"]] = r["cumulative"] + r["responded_cumulative"]  # the last bucket's wins
        drawn = sorted(totals, key=lambda name: (-totals[name], name))[:CHART_TYPES]
        for name in drawn:
            mine = [r for r in by_type if r["task_type"] == name]
            ax_type.plot(
                [starts[0], *(at(r["bucket_ms"]) + width for r in mine)],
                [0, *(r["cumulative"] + r["responded_cumulative"] for r in mine)],
                label=f"{name} ({totals[name]})",
            )
        ax_type.legend(loc="upper left", fontsize=8)
        more = len(totals) - len(drawn)
        ax_type.set_title(type_title + (f" (top {len(drawn)} of {len(totals)})" if more > 0 else ""))
        ax_type.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax_type.xaxis.get_major_locator()))  # type: ignore[no-untyped-call]
    else:
        for ax in (ax_all, ax_type):
            ax.text(0.5, 0.5, "no deliveries", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax_type.set_title(type_title)
    minutes = width_ms / 60_000
    per = f"{minutes:g} min" if minutes < 120 else f"{minutes / 60:g} h"
    ax_all.set_title(f"Delivered (blue) and responded (green) per {per} (UTC)")
    ax_all.set_ylabel("per bucket")
    ax_all.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_type.set_ylabel("delivered + responded")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def build_report(spark: SparkSession, export_uri: str, out_uri: str, bucket_ms: int | None = None) -> dict[str, Any]:
    """Write the campaign report under `out_uri` (any Hadoop URI); returns report.json's content."""
    manifest = read_manifest(spark, export_uri)
    require_tables(manifest, export_uri, "rows", "outcomes", "generations")
    snapshot_ms: int = manifest["snapshot_ms"]
    tables = {name: read_table(spark, export_uri, name) for name in ("rows", "outcomes", "generations")}
    for name, df in tables.items():
        check_count(manifest, name, df)
    recounted = recount(pairs(tables["rows"], tables["outcomes"]))
    gens = tables["generations"].withColumn("task_type", task_type("request_id"))
    stored = [r.asDict() for r in gens.collect()]
    generations, by_type, checks, totals = build_tables(stored, recounted)
    firsts = [totals[f"first_{o}_ms"] for o in REACHED if totals[f"first_{o}_ms"] is not None]
    lasts = [totals[f"last_{o}_ms"] for o in REACHED if totals[f"last_{o}_ms"] is not None]
    width = bucket_width_ms(min(firsts), max(lasts), bucket_ms) if firsts else bucket_ms or BUCKET_LADDER_MS[0]
    series, type_series = delivered_series(tables["outcomes"], width)
    campaigns, rates = policy_section(spark, export_uri, manifest, tables["outcomes"], stored)
    totals["campaigns"] = len(campaigns)

    files = {
        "generations.csv": (GENERATION_COLUMNS, generations),
        "by_task_type.csv": (TYPE_COLUMNS, by_type),
        "delivered_over_time.csv": (SERIES_COLUMNS, series),
        "delivered_by_task_type.csv": (TYPE_SERIES_COLUMNS, type_series),
        "count_check.csv": (CHECK_COLUMNS, checks),
        "campaigns.csv": (CAMPAIGN_COLUMNS, campaigns),
        "rate_per_minute.csv": (RATE_COLUMNS, rates),
    }
    for name, (columns, records) in files.items():
        write_bytes(spark, child(out_uri, name), csv_bytes(columns, records))
    snapshot = _utc(snapshot_ms)
    answered = f"{totals['responded']} responded, " if totals["responded"] else ""
    title = (
        f"sdv-fanout campaign report: {totals['delivered']} delivered, {answered}{totals['pending']} pending "
        f"in {totals['generations']} generations, snapshot {snapshot}"
    )
    write_bytes(spark, child(out_uri, "report.png"), chart_png(series, type_series, width, title))
    paced_png = campaigns_png(rates)
    if paced_png is not None:
        write_bytes(spark, child(out_uri, "campaigns.png"), paced_png)
    elif exists(spark, child(out_uri, "campaigns.png")):  # an earlier report's, into the same directory
        delete(spark, child(out_uri, "campaigns.png"))
    export = qualify(spark, export_uri)
    text = README.format(
        export=export,
        snapshot=snapshot,
        snapshot_ms=snapshot_ms,
        generations=totals["generations"],
        total=totals["total"],
        **{c: totals[c] for c in STATES},
        bucket_ms=width,
        campaigns=len(campaigns),
        checks=", ".join(f"{n} {k}" for k, n in totals["checks"].items()),
    )
    write_bytes(spark, child(out_uri, "README.md"), text.encode())
    report = {
        "format": REPORT_FORMAT,
        "format_version": 1,
        "export": export,
        "snapshot_ms": snapshot_ms,
        "bucket_ms": width,
        "totals": totals,
        "tables": {name.removesuffix(".csv"): records for name, (_, records) in files.items()},
    }
    write_json(spark, child(out_uri, "report.json"), report)
    if totals["checks"][CHECK_MISMATCH]:
        print(
            f"campaign_job: {totals['checks'][CHECK_MISMATCH]} generations whose counts do not match a recount "
            f"(see {child(out_uri, 'count_check.csv')})",
            file=sys.stderr,
            flush=True,
        )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="campaign_job", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--export", required=True, help="export directory or URI (holds manifest.json)")
    parser.add_argument("--out", required=True, help="report directory or URI to write (its files are replaced)")
    parser.add_argument(
        "--bucket",
        type=parse_duration_ms,
        help="delivered-over-time bucket (7d, 1h, 30m, 45s or seconds); default: the smallest of 1m, 5m, 15m, "
        f"1h, 6h, 1d, 7d that spans the deliveries and answers in {MAX_BUCKETS} buckets",
    )
    parser.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    args = parser.parse_args(argv)
    spark = session("sdv-fanout-campaign-report", args.master)
    try:
        report = build_report(spark, args.export, args.out, args.bucket)
    finally:
        spark.stop()
    print(json.dumps({k: v for k, v in report.items() if k != "tables"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
