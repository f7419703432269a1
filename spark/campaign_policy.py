"""The campaign report's policy section: per request with a campaign policy in the export, the rate
achieved per minute against its policy's, the time its windows were open, and where its abort cut it.

The rules are exhook_server/policy.py's (`Policy.rate_per_minute`, the windows), evaluated on the
driver: policies are few (`max_policies`); the outcome records are only aggregated on the cluster.
Deliveries count by when they started (`sent_ms`, the pair's first publish: what max_per_minute
limits), whatever their outcome; a pair without one (an export or record from before send times
were kept) counts only when `delivered`, at its PUBACK time (`ended_ms`).
An export without a `policies` table (older) has no policy section.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from exhook_server.errors import BatchRejected
from exhook_server.policy import Policy, window_opens_at
from spark import check_count, read_table

MINUTE_MS = 60_000
#: Window occurrences walked per request at most (an hourly window over a year is 8,784): past it
#: the request's window times cover the span up to the last one walked (`windows_truncated`).
MAX_INTERVALS = 10_000

CAMPAIGN_COLUMNS = (
    "request_id",
    "set_ms",
    "policy",
    "max_per_minute",
    "delivered",
    "first_minute_ms",
    "last_minute_ms",
    "minutes",
    "peak_per_minute",
    "peak_ratio",
    "span_start_ms",
    "span_end_ms",
    "window_open_ms",
    "window_closed_ms",
    "windows_truncated",
    "delivered_in_window",
    "delivered_outside_window",
    "aborted_ms",
    "abort_outcome",
    "abort_ratio",
    "abort_min_finished",
    "abort_counts",
    "cancelled_by_abort",
    "ended_after_abort",
)
RATE_COLUMNS = ("request_id", "minute_ms", "minute", "delivered", "policy_per_minute", "ratio")
#: Paced requests drawn in campaigns.png (those with the most deliveries); the CSV has them all.
CHART_REQUESTS = 6


def allowed(policy: Policy, set_ms: int, start_ms: int, end_ms: int) -> float | None:
    """Deliveries the policy's rate allows from `start_ms` to `end_ms`: `rate_per_minute` integrated
    over the stretch (a ramp steps every `every_s` from `set_ms`); None when it sets no rate."""
    if policy.max_per_minute is None:
        return None
    step = policy.ramp.every_s * 1000 if policy.ramp is not None else None
    total = 0.0
    t = start_ms
    while t < end_ms:  # at most one pass per ramp step inside the stretch (every_s >= 1 s)
        upto = end_ms if step is None else min(end_ms, set_ms + (max(0, (t - set_ms) // step) + 1) * step)
        rate = policy.rate_per_minute(t - set_ms)
        assert rate is not None
        total += rate * (upto - t) / MINUTE_MS
        t = upto
    return total


def open_intervals(policy: Policy, start_ms: int, end_ms: int) -> tuple[list[tuple[int, int]], bool]:
    """The stretches of `start_ms`..`end_ms` inside one of the policy's windows (overlapping ones
    chained), and whether the walk stopped at MAX_INTERVALS before `end_ms`."""
    found: list[tuple[int, int]] = []
    t = start_ms
    while t < end_ms and len(found) < MAX_INTERVALS:
        opens = min(window_opens_at(w, t) for w in policy.windows)
        if opens >= end_ms:
            return found, False
        closes = policy.open_until(opens)
        assert closes is not None and closes > opens
        found.append((opens, min(closes, end_ms)))
        t = closes
    return found, t < end_ms


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")


def _decode(doc: str) -> Policy | None:
    """The policy as this job reads it; None for one it cannot (a field of a later release)."""
    try:
        return Policy.decode(doc.encode())
    except (BatchRejected, ValueError, AssertionError):
        return None


def policy_section(
    spark: SparkSession,
    export_uri: str,
    manifest: dict[str, Any],
    outcomes: DataFrame,
    stored: Iterable[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The campaigns table (one row per policy) and the rate table (one row per request and minute
    with a delivery) of the export's policies; `stored` are the generations as exported."""
    if "policies" not in manifest.get("counts", {}):
        return [], []
    table = read_table(spark, export_uri, "policies")
    check_count(manifest, "policies", table)
    found = [r.asDict() for r in table.collect()]
    if not found:
        return [], []
    policies = {r["request_id"]: _decode(r["policy"]) for r in found}
    aborts = {r["request_id"]: json.loads(r["aborted"]) for r in found if r["aborted"] is not None}
    spans = _spans(stored, manifest["snapshot_ms"])
    ids = spark.createDataFrame([(r,) for r in policies], "request_id string")
    started = sf.coalesce(sf.col("sent_ms"), sf.when(sf.col("outcome") == "delivered", sf.col("ended_ms")))
    delivered = (
        outcomes.join(sf.broadcast(ids), "request_id")
        .select("request_id", started.alias("start_ms"))
        .where(sf.col("start_ms").isNotNull())
    )
    minute = sf.col("start_ms") - sf.pmod(sf.col("start_ms"), sf.lit(MINUTE_MS))
    per_minute: dict[str, dict[int, int]] = {}
    for row in delivered.groupBy("request_id", minute.alias("minute_ms")).count().collect():
        per_minute.setdefault(row["request_id"], {})[row["minute_ms"]] = row["count"]

    intervals: dict[str, tuple[list[tuple[int, int]], bool]] = {}
    for rid, policy in policies.items():
        if policy is not None and policy.windows and rid in spans:
            intervals[rid] = open_intervals(policy, *spans[rid])
    inside = _in_windows(spark, delivered, intervals)
    after = _after_abort(spark, outcomes, aborts)

    campaigns, rates = [], []
    for r in sorted(found, key=lambda r: r["request_id"]):
        rid = r["request_id"]
        policy, minutes = policies[rid], per_minute.get(rid, {})
        rows = []
        for start in sorted(minutes):
            limit = None if policy is None else allowed(policy, r["set_ms"], start, start + MINUTE_MS)
            rows.append(
                {
                    "request_id": rid,
                    "minute_ms": start,
                    "minute": _utc(start),
                    "delivered": minutes[start],
                    "policy_per_minute": None if limit is None else round(limit, 3),
                    "ratio": None if not limit else round(minutes[start] / limit, 3),
                }
            )
        rates += rows
        campaigns.append(_campaign(r, policy, rows, spans.get(rid), intervals.get(rid), inside, aborts, after))
    return campaigns, rates


def _spans(stored: Iterable[dict[str, Any]], snapshot_ms: int) -> dict[str, tuple[int, int]]:
    """Per request id, from its first stored row to its last change (the snapshot while rows are pending)."""
    spans: dict[str, tuple[int, int]] = {}
    for g in stored:
        end = snapshot_ms if g["pending"] else g["last_ms"]
        first, last = spans.get(g["request_id"], (g["first_ms"], end))
        spans[g["request_id"]] = (min(first, g["first_ms"]), max(last, end))
    return spans


def _in_windows(
    spark: SparkSession, delivered: DataFrame, intervals: dict[str, tuple[list[tuple[int, int]], bool]]
) -> dict[str, int]:
    """Per request with windows: its deliveries started inside one (a range join on the cluster)."""
    spans = [(rid, a, b) for rid, (found, _) in intervals.items() for a, b in found]
    if not spans:
        return {}
    open_ = spark.createDataFrame(spans, "request_id string, open_ms long, close_ms long").alias("w")
    d = delivered.alias("d")
    joined = d.join(
        sf.broadcast(open_),
        (sf.col("d.request_id") == sf.col("w.request_id"))
        & (sf.col("d.start_ms") >= sf.col("w.open_ms"))
        & (sf.col("d.start_ms") < sf.col("w.close_ms")),
    )
    return {r["request_id"]: r["count"] for r in joined.groupBy("d.request_id").count().collect()}


def _after_abort(spark: SparkSession, outcomes: DataFrame, aborts: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per aborted request: its pairs cancelled at or after the abort, and those that ended
    otherwise then (deliveries already out finish as they will)."""
    if not aborts:
        return {}
    at = spark.createDataFrame([(rid, a["at_ms"]) for rid, a in aborts.items()], "request_id string, at_ms long")
    later = outcomes.join(sf.broadcast(at), "request_id").where(sf.col("ended_ms") >= sf.col("at_ms"))
    cancelled = sf.col("outcome") == "cancelled"
    counted = later.groupBy("request_id").agg(
        sf.count(sf.when(cancelled, 1)).alias("cut"), sf.count(sf.when(~cancelled, 1)).alias("other")
    )
    return {r["request_id"]: (r["cut"], r["other"]) for r in counted.collect()}


def _campaign(
    row: dict[str, Any],
    policy: Policy | None,
    rates: list[dict[str, Any]],
    span: tuple[int, int] | None,
    walked: tuple[list[tuple[int, int]], bool] | None,
    inside: dict[str, int],
    aborts: dict[str, Any],
    after: dict[str, tuple[int, int]],
) -> dict[str, Any]:
    rid = row["request_id"]
    delivered = sum(r["delivered"] for r in rates)
    ratios = [r["ratio"] for r in rates if r["ratio"] is not None]
    out: dict[str, Any] = {
        "request_id": rid,
        "set_ms": row["set_ms"],
        "policy": row["policy"],
        "max_per_minute": None if policy is None else policy.max_per_minute,
        "delivered": delivered,
        "first_minute_ms": rates[0]["minute_ms"] if rates else None,
        "last_minute_ms": rates[-1]["minute_ms"] if rates else None,
        "minutes": len(rates),
        "peak_per_minute": max((r["delivered"] for r in rates), default=None),
        "peak_ratio": max(ratios, default=None),
    }
    if walked is not None and span is not None:
        found, truncated = walked
        open_ms = sum(b - a for a, b in found)
        covered = (found[-1][1] if truncated else span[1]) - span[0]
        out |= {
            "span_start_ms": span[0],
            "span_end_ms": span[1],
            "window_open_ms": open_ms,
            "window_closed_ms": covered - open_ms,
            "windows_truncated": truncated,
            "delivered_in_window": inside.get(rid, 0),
            "delivered_outside_window": delivered - inside.get(rid, 0),
        }
    abort = aborts.get(rid)
    if abort is not None:
        criterion = abort.get("criterion", {})
        cut, other = after.get(rid, (0, 0))
        out |= {
            "aborted_ms": abort.get("at_ms"),
            "abort_outcome": criterion.get("outcome"),
            "abort_ratio": criterion.get("ratio"),
            "abort_min_finished": criterion.get("min_finished"),
            "abort_counts": json.dumps(abort.get("counts", {}), sort_keys=True),
            "cancelled_by_abort": cut,
            "ended_after_abort": other,
        }
    return {c: out.get(c) for c in CAMPAIGN_COLUMNS}


def chart_png(rates: list[dict[str, Any]]) -> bytes | None:
    """One panel per paced request (the CHART_REQUESTS with most deliveries): deliveries per minute
    as bars, what its policy allowed as a step line; None when no request has a rate."""
    paced: dict[str, list[dict[str, Any]]] = {}
    for r in rates:
        if r["policy_per_minute"] is not None:
            paced.setdefault(r["request_id"], []).append(r)
    if not paced:
        return None
    from matplotlib.figure import Figure  # Agg canvas; no pyplot, no display

    drawn = sorted(paced, key=lambda rid: (-sum(r["delivered"] for r in paced[rid]), rid))[:CHART_REQUESTS]
    fig = Figure(figsize=(12, 3 * len(drawn)), layout="constrained")
    axes = fig.subplots(len(drawn), 1, squeeze=False)[:, 0]
    for ax, rid in zip(axes, drawn, strict=True):
        mine = paced[rid]
        at = [datetime.fromtimestamp(r["minute_ms"] / 1000, tz=UTC) for r in mine]
        ax.bar(at, [r["delivered"] for r in mine], width=1 / 1440 * 0.9, align="edge", label="delivered")
        allows = [r["policy_per_minute"] for r in mine]
        end = datetime.fromtimestamp((mine[-1]["minute_ms"] + MINUTE_MS) / 1000, tz=UTC)
        ax.step([*at, end], [*allows, allows[-1]], where="post", color="tab:red", label="policy allows")
        ax.set_title(f"{rid}: deliveries per minute (UTC) against its policy")
        ax.set_ylabel("per minute")
        ax.legend(loc="upper left", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()
