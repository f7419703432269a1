"""Run every benchmark in bench/ with moderate settings and write docs/BENCHMARKS.md + PNG charts.

    .venv/bin/python -m bench.run_all            # what `make bench` runs (~5 min on 2 cores)
    .venv/bin/python -m bench.run_all --only e2e_emqx   # one scenario, spliced into the existing report

Each script runs as its own subprocess, one after the other (never in parallel: they share the
machine's CPUs), with --json into a tmp dir. The summary table is built from those JSON files;
each script's markdown output follows verbatim. A script that fails is reported as such and the
others still run; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exhook_server.config import Config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HEADING = re.compile(r"^(#{2,6}) ")  # a script has no "# " title of its own

# (name, script, args, title): moderate settings, chosen so the whole run stays under ~10 min.
SCRIPTS: list[tuple[str, str, list[str], str]] = [
    ("ingest", "bench/ingest.py", ["--tuned", "--levels", "1,10,100"], "Durable ingest (bench/ingest.py)"),
    (
        "grpc_flavour",
        "bench/grpc_flavour.py",
        ["--rounds", "3", "--duration", "2"],
        "grpc.aio vs sync no-op server (bench/grpc_flavour.py)",
    ),
    (
        "e2e",
        "bench/e2e.py",
        ["--vehicles", "500", "--batches", "10", "--rounds", "3", "--procs", "2", "--levels", "1,10,100"],
        "End-to-end delivery (bench/e2e.py)",
    ),
    (
        "e2e_emqx",
        "bench/e2e_emqx.py",
        ["--versions", "5.8.9,5.9.1", "--vehicles", "500", "--requests", "6", "--rounds", "5"],
        "End-to-end through real EMQX 5.8.9 and 5.9.1 (bench/e2e_emqx.py)",
    ),
    ("gc", "bench/gc.py", ["--rows", "300000"], "GC pipeline (bench/gc.py)"),
    ("hooks", "bench/hooks.py", [], "Heartbeat and ack hook RPC path (bench/hooks.py)"),
    (
        "status_cost",
        "bench/status_cost.py",
        ["--before", "7fd2d64"],  # the last commit without outcome records and generation counts
        "Status topic cost: on vs off, disk per outcome (bench/status_cost.py)",
    ),
    (
        "lifecycle",
        "bench/lifecycle.py",
        [],  # ~4 min: 6 rounds of 1,200 ingest batches per side and of 500 vehicles x 8 requests per mode
        "Issue 13 lifecycle: the expiry index on ingest, response mode end to end (bench/lifecycle.py)",
    ),
    (
        "attempts",
        "bench/attempts_cost.py",
        ["--base", "2d572fd"],  # ~3 min: the last commit whose attempt counts lived in memory only
        "Delivery attempts kept in LMDB: end to end before vs after (bench/attempts_cost.py)",
    ),
    (
        "pg_serve",
        "bench/pg_serve.py",
        [],  # ~5 min: ingest vs raw asyncpg and LMDB, 1-3 instances, heartbeat round trips, e2e on both stores
        "sdv-fanout on PostgreSQL: ingest, instances, heartbeat round trips, end to end (bench/pg_serve.py)",
    ),
    (
        "failover",
        "bench/pg_failover.py",
        ["--rounds", "3"],  # ~25 s: fresh primary + synchronous standby and 2 instances per round
        "PostgreSQL failover under ingest: kill -9 of the primary, promote (bench/pg_failover.py)",
    ),
    (
        "catchup",
        "bench/catchup_outage.py",
        [],  # ~15 min: a 60 s outage of every instance per EMQX version (3) and store (2)
        "Batches published while every instance is down: the catch-up session (bench/catchup_outage.py)",
    ),
    (
        "fleet",
        "bench/fleet.py",
        [],  # ~8 min: per EMQX version (5.8.9, 5.9.1) 5 paired delivery rounds, heartbeat CPU and latency
        "Vehicle events over MQTT against the strict raw reference (bench/fleet.py)",
    ),
]

#: bench/status_cost.py: issue 12's target, the status topic costs at most 10 % of ingest and e2e.
STATUS_RATIO_MIN = 0.9

#: bench/attempts_cost.py: keeping attempts across restarts costs at most 5 % of e2e deliveries/s.
ATTEMPTS_RATIO_MIN = 0.95

#: bench/e2e_emqx.py: ours over the broker's own one-in-flight QoS 1 delivery, per EMQX version.
EMQX_RATIO_MIN = 0.6

#: Scale linearity: CPU per RPC at 10x / 100x distinct VINs over the 1x level may grow this much
#: before it counts as worse than linear (the paired ratio moves ~10 % from noise alone on 2 cores).
COST_RATIO_MAX = 1.2


def mmm(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def fmt_mmm(s: dict[str, float] | None, fmt: str = "{:.2f}") -> str:
    if not s:
        return "n/a"
    return " / ".join(fmt.format(s[k]) for k in ("min", "median", "max"))


#: A summary table row: scenario, reference in the same run, target, measured, status.
Row = tuple[str, str, str, str, str]


def linear_row(scenario: str, measured: str, worst_cost_ratio: float) -> Row:
    """A summary row for "cost grows linearly or better": the worst level's cost over the 1x level's."""
    return (
        scenario,
        "ours at 1x, same run",
        f"linear or better: ratio ≤ {COST_RATIO_MAX:.1f}x",
        measured,
        "**PASS**" if worst_cost_ratio <= COST_RATIO_MAX else "**FAIL**",
    )


def verdict(s: dict[str, float] | None, target: float, higher_is_better: bool = True) -> str:
    if not s:
        return "not measured (run failed)"
    ok = s["median"] >= target if higher_is_better else s["median"] <= target
    return "**PASS**" if ok else "**FAIL**"


def run_script(name: str, script: str, args: list[str], tmp: Path) -> dict[str, Any]:
    json_path = tmp / f"{name}.json"
    module = script.removesuffix(".py").replace("/", ".")
    cmd = [sys.executable, "-m", module, *args, "--json", str(json_path)]
    shown = " ".join(shlex.quote(c) for c in [".venv/bin/python", "-m", module, *args, "--json", f"{name}.json"])
    print(f"== {shown}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    # stderr (progress) goes straight to the terminal; stdout is the markdown we keep.
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
    wall = time.monotonic() - t0
    data = None
    if proc.returncode == 0 and json_path.exists():
        data = json.loads(json_path.read_text())
    print(f"== {name}: exit {proc.returncode}, {wall:.0f} s", file=sys.stderr, flush=True)
    return {"cmd": shown, "rc": proc.returncode, "wall_s": wall, "markdown": proc.stdout.strip(), "data": data}


# -- summary ------------------------------------------------------------------------------


def summary_rows(res: dict[str, dict[str, Any]]) -> list[Row]:
    """(scenario, reference, target, measured, status) rows of the scenarios that ran, all numbers from
    their JSON files (None where a script failed)."""
    rows: list[Row] = []
    for name, rows_of in SUMMARY_ROWS.items():
        if name in res:
            rows += rows_of(res[name]["data"])
    return rows


def ingest_rows(ing: dict[str, Any] | None) -> list[Row]:
    """bench/ingest.py: ours vs the raw py-lmdb loop, then the extra references and levels."""
    rows: list[Row] = []
    s = ing["summary"]["ratio_ours_over_raw"] if ing else None
    meas = fmt_mmm(s) + "x" if s else "n/a"
    if ing:
        meas += (
            f" (ours {ing['summary']['ours_rows_per_s']['median']:,.0f} vs raw "
            f"{ing['summary']['raw_rows_per_s']['median']:,.0f} VIN-rows/s, medians)"
        )
    rows.append(
        (
            "Durable ingest, VIN-rows/s",
            "raw py-lmdb loop, same batches, 1 synced txn per batch",
            "≥ 1.5x",
            meas,
            verdict(s, 1.5),
        )
    )
    return rows + ingest_extra_rows(ing)


def e2e_rows(e2e: dict[str, Any] | None) -> list[Row]:
    """bench/e2e.py: ours vs raw paho on mosquitto, cost at 10x / 100x, latency, RSS per VIN."""
    rows: list[Row] = []
    for key, label in (
        ("ratio_ours_over_raw_a", "raw paho QoS 1 (a): one publisher, window 50, unconstrained"),
        ("ratio_ours_over_raw_b", "raw paho QoS 1 (b): one message in flight per subscriber"),
    ):
        s = e2e["summary"][key] if e2e else None
        meas = fmt_mmm(s) + "x" if s else "n/a"
        if e2e:
            raw_key = "raw_a_msgs_per_s" if key.endswith("_a") else "raw_b_msgs_per_s"
            meas += (
                f" (ours {e2e['summary']['ours_msgs_per_s']['median']:,.0f} vs raw "
                f"{e2e['summary'][raw_key]['median']:,.0f} msgs/s, medians)"
            )
        rows.append(("End-to-end delivered+acked msgs/s", label, "≥ 0.5x", meas, verdict(s, 0.5)))

    levels = e2e.get("levels") if e2e else None
    if levels and len(levels) > 1:
        meas = "; ".join(
            f"{lv['level']}x ({lv['messages']:,} msgs): {lv['server_cost_vs_first']:.2f}x, "
            f"{lv['server_us_per_msg']:,.0f} µs/msg, {lv['msgs_per_s']:,.0f} msgs/s"
            for lv in levels[1:]
        )
        meas += f" (1x: {levels[0]['messages']:,} msgs, {levels[0]['server_us_per_msg']:,.0f} µs/msg)"
        worst = max(lv["server_cost_vs_first"] for lv in levels[1:])
        rows.append(linear_row("End-to-end cost at 10x / 100x the deliveries: server CPU per message", meas, worst))

    if e2e:
        lat = e2e["latency"]
        meas = (
            f"p50 {lat['p50_ms']:.1f} ms / p99 {lat['p99_ms']:.1f} ms "
            f"({lat['samples']:,} samples at {lat['offered_msgs_per_s']:,.0f} msgs/s offered)"
        )
    else:
        meas = "n/a"
    rows.append(("Batch-to-delivery latency", "publish_batch returned → on_message", "report", meas, "reported"))

    if e2e:
        rss = e2e["rss"]
        pres = rss["presence"]
        per_vin = pres["bytes_per_vin"]
        n = e2e["meta"]["vehicles"]
        e2e_per_vin = (rss["e2e_after"] - rss["e2e_before"]) / n
        meas = (
            f"{per_vin:,.0f} B ({pres['sessions']:,} synthetic sessions, delivery off); "
            f"{e2e_per_vin:,.0f} B in the e2e run ({n:,} real vehicles, includes fleet channels)"
        )
        status = "**PASS**" if per_vin <= 300 else "**FAIL**"
    else:
        meas, status = "n/a", "not measured (run failed)"
    rows.append(("RSS per online VIN", "—", "≤ 300 B", meas, status))
    return rows


def emqx_rows(em: dict[str, Any] | None) -> list[Row]:
    """bench/e2e_emqx.py: per EMQX version and ack path (the message.acked hook, the rule of
    ack_topic_prefix), ours over the broker-paced raw QoS 1 (one in flight)."""
    if not em:
        return [
            (
                "End-to-end through real EMQX, deliveries/s",
                "raw EMQX QoS 1, one in flight per vehicle (max_inflight 1)",
                f"≥ {EMQX_RATIO_MIN:.1f}x",
                "n/a",
                verdict(None, EMQX_RATIO_MIN),
            )
        ]
    rows: list[Row] = []
    for v in em["versions"]:
        s = v["summary"]
        for ours, name in (("ours", ""), ("ours_rule", ", acks through the rule (ack_topic_prefix)")):
            meas = (
                f"{fmt_mmm(s[f'ratio_{ours}_over_raw_paced'])}x (ours {s[f'{ours}_deliveries_per_s']['median']:,.0f} "
                f"vs raw {s['raw_paced_deliveries_per_s']['median']:,.0f} deliveries/s, medians; closed-loop raw "
                f"{s['raw_loop_deliveries_per_s']['median']:,.0f}/s: {fmt_mmm(s[f'ratio_{ours}_over_raw_loop'])}x; "
                f"CPU per delivery of all the rig's processes, raw / ours: "
                f"{fmt_mmm(s[f'cost_ratio_raw_paced_over_{ours}'])}x; server "
                f"{s[f'{ours}_server_us_per_delivery']['median']:,.0f} µs/delivery, EMQX "
                f"{s[f'{ours}_emqx_us_per_delivery']['median']:,.0f} µs, {v['server_processes']} process(es))"
            )
            rows.append(
                (
                    f"End-to-end through real EMQX {v['version']} (ExHook {v['protocol']}){name}, deliveries/s",
                    "raw EMQX QoS 1, same fleet, one in flight per vehicle (listener max_inflight 1, broker-paced)",
                    f"≥ {EMQX_RATIO_MIN:.1f}x",
                    meas,
                    verdict(s[f"ratio_{ours}_over_raw_paced"], EMQX_RATIO_MIN),
                )
            )
    return rows


def gc_rows(gc: dict[str, Any] | None) -> list[Row]:
    """bench/gc.py: rows/s and peak RSS of each step (reported, no target)."""
    if gc:
        meas = (
            f"{gc['rows']:,} rows: export {gc['export']['rows_per_s']:,} rows/s "
            f"(peak RSS {gc['export']['peak_rss_mib']} MiB); Spark plan {gc['spark_plan']['s']} s "
            f"(driver RSS {gc['spark_plan']['peak_rss_mib_driver_python']} MiB); apply "
            f"{gc['apply']['rows_per_s']:,} deleted/s ({gc['apply']['peak_rss_mib']} MiB); embedded GC "
            f"{gc['embedded_gc']['rows_per_s']:,} deleted/s ({gc['embedded_gc']['peak_rss_mib']} MiB); "
            f"results agree: {gc['agree']}"
        )
    else:
        meas = "n/a"
    return [("GC pipeline rows/s and peak RSS", "—", "report", meas, "reported" if gc else "run failed")]


def ingest_extra_rows(ing: dict[str, Any] | None) -> list[Row]:
    """bench/ingest.py: the tuned reference, disk per row and per blob, and cost at 10x / 100x rows."""
    rows: list[Row] = []
    tuned = ing["summary"].get("ratio_ours_over_raw_tuned") if ing else None
    if tuned:
        rows.append(
            (
                "Durable ingest, VIN-rows/s",
                "raw loop written with the writer's py-lmdb calls (cursors, putmulti, appends)",
                "≥ 1.5x",
                fmt_mmm(tuned) + "x",
                verdict(tuned, 1.5),
            )
        )
    disk = ing.get("disk") if ing else None
    if disk:
        rows.append(
            (
                "Disk per pending row (ids + expiry pages)",
                f"raw layout: {disk['raw_bytes_per_row']:.0f} B",
                "≤ 300 B",
                f"{disk['bytes_per_row']:.0f} B (ids {disk['ids_bytes_per_row']:.0f}, expiry "
                f"{disk['expiry_bytes_per_row']:.0f}); whole file {disk['file_bytes_per_row']:.0f} B per row",
                "**PASS**" if disk["bytes_per_row"] <= 300 else "**FAIL**",
            )
        )
        rows.append(
            (
                "Disk per blob beyond its payload (1 KiB blobs)",
                "—",
                "≤ 100 B",
                f"{disk['blob_overhead_bytes']:.0f} B (a 1 KiB value fits at most 3 to a 4 KiB page)",
                "**PASS**" if disk["blob_overhead_bytes"] <= 100 else "**FAIL**",
            )
        )
    levels = ing.get("levels") if ing else None
    if levels and len(levels["results"]) > 1:
        res = levels["results"]
        meas = "; ".join(
            f"{r['level']}x: CPU/row {r['cpu_per_row_vs_base']:.2f}x, rows/s {r['ours_rows_per_s']:,.0f} "
            f"(raw {r['raw_rows_per_s']:,.0f}), {r['bytes_per_row']:.0f} B/row"
            for r in res[1:]
        )
        meas += f" (1x = {levels['level_batches']} batches: {res[0]['ours_rows_per_s']:,.0f} rows/s)"
        worst = max(r["cpu_per_row_vs_base"] for r in res[1:])
        rows.append(linear_row("Ingest cost at 10x / 100x the batches: server CPU per row", meas, worst))
    return rows


def hook_rows(hk: dict[str, Any] | None) -> list[Row]:
    """bench/hooks.py: ours vs the no-op server and the EMQX example shape, latency, VIN scale."""
    sm = hk["summary"] if hk else None
    rows: list[Row] = []
    for key, ref, ref_key, target in (
        ("ratio_ours_over_noop", "no-op ExHook server (grpc.aio, same proto, answers at once)", "noop", 0.8),
        (
            "ratio_ours_over_example",
            "EMQX's Python example server, re-created minimal (sync ThreadPool(10), returns at once)",
            "example",
            1.0,
        ),
    ):
        s = sm[key] if sm else None
        meas = fmt_mmm(s) + "x" if sm and s else "n/a"
        if sm:
            meas += (
                f" (ours {sm['ours_rpc_per_s']['median']:,.0f} vs {sm[ref_key + '_rpc_per_s']['median']:,.0f} "
                "RPC/s, medians)"
            )
        rows.append(("Heartbeat + ack hook RPC/s, 8 channels", ref, f"≥ {target:.1f}x", meas, verdict(s, target)))

    half = sm["half_load"] if sm else None
    if half:
        meas = (
            f"p99 {fmt_mmm(half['ours_p99_ms'])} ms, p50 {half['ours_p50_ms']['median']:.2f} ms (median) at "
            f"{half['offered_rpc_per_s']['median']:,.0f} RPC/s offered; no-op at the same rate: p99 "
            f"{half['noop_p99_ms']['median']:.2f} ms (median)"
        )
    else:
        meas = "n/a"
    rows.append(
        (
            "Heartbeat + ack hook latency at half load (open loop)",
            "no-op server at the same offered rate (shown)",
            "p99 ≤ 2 ms",
            meas,
            verdict(half["ours_p99_ms"] if half else None, 2.0, higher_is_better=False),
        )
    )

    levels = sm.get("scale") if sm else None
    if levels and len(levels) > 1:
        first = levels[0]
        meas = "; ".join(
            f"{lv['factor']:g}x ({lv['vins']:,} VINs): {fmt_mmm(lv['cost_ratio_vs_first'])}x, "
            f"{lv['server_cpu_us_per_rpc']['median']:.0f} µs/RPC"
            for lv in levels[1:]
        )
        meas += f" (1x: {first['server_cpu_us_per_rpc']['median']:.0f} µs/RPC)"
        worst = max(levels[1:], key=lambda lv: lv["cost_ratio_vs_first"]["median"])["cost_ratio_vs_first"]
        status = verdict(worst, COST_RATIO_MAX, higher_is_better=False)
        ref = f"ours at {first['vins']:,} distinct VINs (1x), same run"
    else:
        meas, status, ref = "n/a", "not measured (run failed)" if not sm else "not measured (no scale levels)", "—"
    rows.append(
        (
            "Hook cost at 10x / 100x distinct VINs: server CPU per RPC",
            ref,
            f"linear or better: ratio ≤ {COST_RATIO_MAX:.1f}x",
            meas,
            status,
        )
    )

    grp = sm.get("group") if sm else None
    if grp:
        n = grp["processes"]
        med = {k: v["median"] for k, v in grp.items() if isinstance(v, dict)}
        meas = (
            f"{fmt_mmm(grp['ratio_group_over_one'])}x measured with the load generator on the same {n} CPUs "
            f"(1 process {med['one_rpc_per_s']:,.0f}, {n} processes {med['group_rpc_per_s']:,.0f} RPC/s, "
            f"medians); {fmt_mmm(grp['capacity_estimate_group_over_one'])}x estimated for {n} cores of its own "
            f"({med['one_server_cpu_us_per_rpc']:.0f} vs {med['group_server_cpu_us_per_rpc']:.0f} µs/RPC)"
        )
        status = verdict(grp["ratio_group_over_one"], 1.6)
    else:
        meas, status = "n/a", "not measured"
    rows.append(("Hook RPC/s with one server process per CPU", "ours with 1 process, same run", "≥ 1.6x", meas, status))
    return rows


def status_rows(st: dict[str, Any] | None) -> list[Row]:
    """bench/status_cost.py: ingest and e2e with status on over off (and the older tree), disk per outcome."""
    rows: list[Row] = []
    ing = st.get("ingest") if st else None
    e2e = st.get("e2e") if st else None

    def measured(s: dict[str, Any], ratio: str, cpu: str | None, rates: str) -> str:
        out = f"{fmt_mmm(s[ratio])}x ({rates}, medians)"
        return out + (f"; server CPU per unit {fmt_mmm(s[cpu])}x" if cpu else "")

    for label, ref, key, cpu, data, rate, unit in (
        ("Status topic on, ingest VIN-rows/s", 'status off (status_topic_prefix = "")', "on_over_off",
         "cpu_on_over_off", ing, ("on", "off"), "rows_per_s"),
        ("Status topic on, end-to-end deliveries/s", 'status off (status_topic_prefix = "")', "on_over_off",
         "cpu_on_over_off", e2e, ("on", "off"), "msgs_per_s"),
        ("Status topic with status_per_vehicle, end-to-end deliveries/s", "status off", "per_vehicle_over_off",
         "cpu_per_vehicle_over_off", e2e, ("per_vehicle", "off"), "msgs_per_s"),
    ):  # fmt: skip
        s = data["summary"] if data else None
        meas = "n/a"
        if s:
            a, b = (s[f"{side}_{unit}"]["median"] for side in rate)
            meas = measured(s, key, cpu, f"{rate[0]} {a:,.0f} vs {rate[1]} {b:,.0f}")
        target = f"≥ {STATUS_RATIO_MIN:.1f}x" if "per_vehicle" not in key else "report (off by default)"
        status = verdict(s[key] if s else None, STATUS_RATIO_MIN) if "per_vehicle" not in key else "reported"
        rows.append((label, ref, target, meas, status))
    if ing and "off_over_before" in ing["summary"]:
        s = ing["summary"]
        before = st["meta"]["before"]
        meas = measured(
            s,
            "off_over_before",
            "cpu_off_over_before",
            f"off {s['off_rows_per_s']['median']:,.0f} vs before {s['before_rows_per_s']['median']:,.0f}",
        )
        rows.append(
            (
                "Outcome records + generation counts (always on), ingest VIN-rows/s",
                f"the server of {before} (before them), same run; includes all else changed since",
                f"≥ {STATUS_RATIO_MIN:.1f}x",
                meas,
                verdict(s["off_over_before"], STATUS_RATIO_MIN),
            )
        )
    disk = st.get("disk") if st else None
    meas = (
        "; ".join(
            f"{d['bytes_per_outcome']:.0f} B at {d['outcomes']:,} (record {d['record_bytes']:.0f}, time index "
            f"{d['index_bytes']:.0f}, counts {d['gens_bytes']:.1f})"
            for d in disk
        )
        if disk
        else "n/a"
    )
    rows.append(("Disk per outcome record (LMDB pages)", "—", "report", meas, "reported" if disk else "run failed"))
    return rows


def lifecycle_rows(lc: dict[str, Any] | None) -> list[Row]:
    """bench/lifecycle.py (issue 13): ingest with expires_at over without, response mode over PUBACK mode."""
    ing = lc.get("ingest") if lc else None
    e2e = lc.get("e2e") if lc else None
    meas = "n/a"
    if ing:
        s = ing["summary"]
        index = ", ".join(f"`{name}` {v['bytes_per_row']:.0f} B/row" for name, v in ing["index"].items())
        meas = (
            f"{fmt_mmm(s['with_over_without'])}x (with {s['with_rows_per_s']['median']:,.0f} vs without "
            f"{s['without_rows_per_s']['median']:,.0f} VIN-rows/s, medians); server CPU per row "
            f"{fmt_mmm(s['cpu_with_over_without'])}x; index {index}; a deadline per batch instead of one for all: "
            f"{fmt_mmm(s['per_batch_over_without'])}x, CPU per row {fmt_mmm(s['cpu_per_batch_over_without'])}x"
        )
    rows: list[Row] = [
        (
            "Expiry index (`expires_at` an hour ahead on every batch), ingest VIN-rows/s",
            "the same batches without `expires_at`, same server, same run",
            "report",
            meas,
            "reported" if ing else "not measured (run failed)",
        )
    ]
    meas = "n/a"
    if e2e:
        s = e2e["summary"]
        us = {mode: s[f"{mode}_server_us_per_request"]["median"] for mode in ("response", "puback")}
        meas = (
            f"{fmt_mmm(s['response_over_puback'])}x (response {s['response_per_s']['median']:,.0f} vs PUBACK "
            f"{s['puback_per_s']['median']:,.0f} completed requests/s, medians); server CPU per request "
            f"{us['response']:,.0f} vs {us['puback']:,.0f} µs ({fmt_mmm(s['cpu_response_over_puback'])}x)"
        )
    rows.append(
        (
            "Response mode (`await_response`), end-to-end completed requests/s",
            "PUBACK mode, same rig, fleet and run",
            "report",
            meas,
            "reported" if e2e else "not measured (run failed)",
        )
    )
    return rows


def failover_rows(fo: dict[str, Any] | None) -> list[Row]:
    """bench/pg_failover.py (issue 14): acknowledged batches lost over the failovers, and how long they took."""
    if not fo:
        return [
            (
                "PostgreSQL failover mid-ingest: acknowledged batches lost",
                "n/a",
                "0",
                "n/a",
                "not measured (run failed)",
            )
        ]
    s = fo["summary"]
    lost = (
        f"{s['acked_lost']} of {s['acked']:,} acknowledged batches over {len(fo['rounds'])} rounds; failed during "
        f"the outage and retried with their batch_id: {s['stored_once']} of {s['failed']} stored exactly once; "
        f"calls timed out: {s['timed_out']}"
    )
    took = (
        f"promote → first acknowledged batch {fmt_mmm(s['promote_to_ack_s'])} s, → every instance "
        f"{fmt_mmm(s['promote_to_all_s'])} s; kill → first acknowledged batch {fmt_mmm(s['kill_to_ack_s'])} s"
    )
    return [
        (
            "PostgreSQL failover mid-ingest: acknowledged batches lost",
            "the promoted standby's receipts, rows and counts",
            "0",
            lost,
            "**PASS**" if s["acked_lost"] == 0 else "**FAIL**",
        ),
        (
            "PostgreSQL failover time, instances not restarted",
            "the start of the promote; the kill",
            "report",
            took,
            "reported",
        ),
    ]


#: bench/pg_serve.py (issue 14): PostgreSQL-mode ingest over a raw asyncpg loop writing the same rows.
PG_INGEST_RATIO_MIN = 0.8
#: bench/pg_serve.py: database round trips per heartbeat at the default heartbeat_window_ms.
PG_TRIPS_PER_HEARTBEAT_MAX = 0.05
#: The server's default heartbeat_window_ms, the window the target is for (read from an instance:
#: on a slots dataclass the class attribute is a member descriptor, not the default).
PG_DEFAULT_WINDOW_MS = Config().heartbeat_window_ms


def _pg_ingest_cell(ing: dict[str, Any], layout: str) -> str:
    """One ingest layout's ratios and rates for the summary row."""
    cpu = {k: ing[f"{k}_server_us_per_row"]["median"] + ing[f"{k}_pg_us_per_row"]["median"] for k in ("pg", "raw")}
    out = (
        f"{layout}: {fmt_mmm(ing['ratio_pg_over_raw'])}x (PostgreSQL mode {ing['pg_rows_per_s']['median']:,.0f} vs "
        f"raw {ing['raw_rows_per_s']['median']:,.0f} VIN-rows/s, medians; server + PostgreSQL CPU {cpu['pg']:.0f} "
        f"vs {cpu['raw']:.0f} µs/row); vs the same server on LMDB ({ing['lmdb_rows_per_s']['median']:,.0f}): "
        f"{fmt_mmm(ing['ratio_pg_over_lmdb'])}x"
    )
    if "ratio_pg_unbounded_over_raw" in ing:  # the backlog bound's price; the verdict stays the bounded side's
        unb = ing["pg_unbounded_server_us_per_row"]["median"] + ing["pg_unbounded_pg_us_per_row"]["median"]
        out += (
            f", without the backlog bound (max_pending_per_vehicle = 0, not the default) / raw: "
            f"{fmt_mmm(ing['ratio_pg_unbounded_over_raw'])}x ({ing['pg_unbounded_rows_per_s']['median']:,.0f} "
            f"VIN-rows/s, {unb:.0f} µs/row)"
        )
    return out


def pg_serve_rows(pg: dict[str, Any] | None) -> list[Row]:
    """bench/pg_serve.py: ingest vs raw asyncpg and LMDB, CPU per call over instances, round trips per
    heartbeat, end to end vs LMDB."""
    s = pg["summary"] if pg else {}
    rows: list[Row] = []
    # The verdict is the pinned layout's when it ran (PostgreSQL on a core of its own, as on its own
    # machine in production: the raw loop's limit is the database's); the shared layout follows.
    shared, pinned = s.get("ingest"), s.get("ingest_pinned")
    ing = pinned or shared
    meas = "n/a"
    if ing:
        parts = [_pg_ingest_cell(pinned, "PostgreSQL on its own core")] if pinned else []
        if shared:
            parts.append(_pg_ingest_cell(shared, "all on 2 shared cores"))
        meas = "; ".join(parts)
    clients = pg["ingest"].get("clients", 8) if pg and "ingest" in pg else 8
    rows.append(
        (
            "PostgreSQL mode, durable ingest VIN-rows/s",
            "raw asyncpg loop, same rows and schema (blob + one unnest upsert, 1 txn per batch), "
            f"same {clients} connections",
            f"≥ {PG_INGEST_RATIO_MIN:.1f}x",
            meas,
            verdict(ing["ratio_pg_over_raw"] if ing else None, PG_INGEST_RATIO_MIN),
        )
    )
    inst = s.get("instances")
    if inst:
        levels = sorted(inst, key=int)
        first = levels[0]
        parts = [
            f"{n} instances: {fmt_mmm(inst[n]['cost_vs_first'])}x ({inst[n]['us_per_call']['median']:,.0f} µs/call, "
            f"{inst[n]['calls_per_s']['median']:,.0f} calls/s)"
            for n in levels[1:]
        ]
        meas = "; ".join(parts) + (
            f" (1 instance: {inst[first]['us_per_call']['median']:,.0f} µs/call of server + PostgreSQL CPU, "
            f"{inst[first]['calls_per_s']['median']:,.0f} calls/s)"
        )
        m = pg["meta"] if pg else {}
        mix = (
            f"{1 - m['subscribe_share'] - m['ack_share']:.0%} heartbeats, {m['subscribe_share']:.0%} subscribes, "
            f"{m['ack_share']:.0%} acks"
        )
        worst = max(inst[n]["cost_vs_first"]["median"] for n in levels[1:])
        status = "**PASS**" if worst <= COST_RATIO_MAX else "**FAIL**"
    else:
        meas, status = "n/a", "not measured (run failed)"
    rows.append(
        (
            "PostgreSQL mode, server + PostgreSQL CPU per hook call as instances grow",
            "1 instance, same run and hook mix" + (f" ({mix})" if inst else ""),
            f"flat: ratio ≤ {COST_RATIO_MAX:.1f}x",
            meas,
            status,
        )
    )
    rows.append(pg_scale_out_row(pg))
    hb = s.get("heartbeat")
    status, meas = "not measured (run failed)", "n/a"
    if hb:
        cells = {tuple(k.split("/")): v for k, v in hb.items()}
        # The server's default window when it was measured, else the smallest one.
        windows = {c[0] for c in cells}
        default = next((w for w in windows if float(w) == PG_DEFAULT_WINDOW_MS), None)
        window = default or min(windows, key=float)
        rate = max((c[2] for c in cells if c[0] == window), key=float)
        at = {phase: cells[(window, phase, rate)] for phase in ("idle", "work") if (window, phase, rate) in cells}
        meas = "; ".join(
            f"{phase}: {fmt_mmm(v['trips_per_heartbeat'], '{:.3f}')} ({v['heartbeats_per_statement']['median']:.1f} "
            "heartbeats per statement)"
            for phase, v in at.items()
        )
        meas = f"window {window} ms at {float(rate):,.0f} heartbeats/s, {meas}; others: " + ", ".join(
            f"{w} ms {float(r):,.0f}/s {ph} {v['trips_per_heartbeat']['median']:.3f}"
            for (w, ph, r), v in cells.items()
            if (w, r) != (window, rate)
        )
        worst = max(v["trips_per_heartbeat"]["median"] for v in at.values())
        status = "**PASS**" if worst <= PG_TRIPS_PER_HEARTBEAT_MAX else "**FAIL**"
    rows.append(
        (
            "PostgreSQL mode, database round trips per heartbeat",
            "the server's own counters (every purpose) over its heartbeats",
            f"≤ {PG_TRIPS_PER_HEARTBEAT_MAX}",
            meas,
            status,
        )
    )
    ee = s.get("e2e")
    meas = "n/a"
    if ee:
        meas = (
            f"{fmt_mmm(ee['ratio_pg_over_lmdb'])}x (PostgreSQL {ee['pg_msgs_per_s']['median']:,.0f} vs LMDB "
            f"{ee['lmdb_msgs_per_s']['median']:,.0f} deliveries/s, medians; server + PostgreSQL CPU "
            f"{ee['pg_server_us_per_msg']['median'] + ee['pg_postgresql_us_per_msg']['median']:,.0f} vs "
            f"{ee['lmdb_server_us_per_msg']['median']:,.0f} µs/delivery; stalls rescued by a heartbeat: "
            f"{ee['pg_stalls']} vs {ee['lmdb_stalls']})"
        )
    rows.append(
        (
            "PostgreSQL mode, end-to-end deliveries/s",
            "the same rig on LMDB, same run",
            "report",
            meas,
            "reported" if ee else "not measured (run failed)",
        )
    )
    return rows


def pg_scale_out_row(pg: dict[str, Any] | None) -> Row:
    """bench/pg_serve.py's equal-load cells: n instances offered n x R calls/s, R each (scaling out,
    each instance on cores of its own in production), server + PostgreSQL CPU per call vs 1."""
    s = pg["summary"] if pg else {}
    eq = s.get("instances_per_instance_rate")
    scenario = "PostgreSQL mode, server + PostgreSQL CPU per hook call, equal load per instance (scale-out)"
    if not eq:
        why = "not measured (--inst-rate-per-instance 0)" if s.get("instances") else "not measured (run failed)"
        return (
            scenario,
            "1 instance at the same rate per instance",
            f"flat: ratio ≤ {COST_RATIO_MAX:.1f}x",
            "n/a",
            why,
        )
    at = eq["levels"]
    levels = sorted(at, key=int)
    each = eq["per_instance_per_s"]
    meas = "; ".join(
        f"{n} instances: {fmt_mmm(at[n]['cost_vs_first'])}x ({at[n]['us_per_call']['median']:,.0f} µs/call, "
        f"{at[n]['calls_per_s']['median']:,.0f} of {at[n]['offered_per_s']:,.0f} calls/s)"
        for n in levels[1:]
    ) + (
        f" ({levels[0]} instance{'s' * (int(levels[0]) > 1)}: {at[levels[0]]['us_per_call']['median']:,.0f} µs/call "
        "of server + PostgreSQL CPU, "
        f"{at[levels[0]]['calls_per_s']['median']:,.0f} of {at[levels[0]]['offered_per_s']:,.0f} calls/s)"
    )
    late = {n: at[n]["late"] / max(1, at[n]["arrivals"]) for n in levels}
    if any(v > 0.01 for v in late.values()):
        meas += "; late (not sent): " + ", ".join(f"{n} instances {v:.1%}" for n, v in late.items())
    m = pg["meta"] if pg else {}
    mix = (
        f"{1 - m['subscribe_share'] - m['ack_share']:.0%} heartbeats, {m['subscribe_share']:.0%} subscribes, "
        f"{m['ack_share']:.0%} acks"
    )
    worst = max((at[n]["cost_vs_first"]["median"] for n in levels[1:]), default=1.0)
    return (
        scenario,
        f"1 instance at the same {each:,.0f} calls/s, same run and hook mix ({mix}); n instances offered "
        f"n x {each:,.0f}",
        f"flat: ratio ≤ {COST_RATIO_MAX:.1f}x",
        meas,
        "**PASS**" if worst <= COST_RATIO_MAX else "**FAIL**",
    )


def attempts_rows(at: dict[str, Any] | None) -> list[Row]:
    """bench/attempts_cost.py: e2e deliveries/s with attempts kept in LMDB over the commit before."""
    s = at["summary"] if at else None
    base = at["meta"]["base"] if at else "the commit before"
    meas = "n/a"
    if s:
        meas = (
            f"{fmt_mmm(s['ratio'])}x (this {s['this_msgs_per_s']['median']:,.0f} vs "
            f"{s['base_msgs_per_s']['median']:,.0f}/s, medians); server CPU per delivery {fmt_mmm(s['cpu_ratio'])}x"
        )
    return [
        (
            "Attempts kept across restarts (LMDB), end-to-end deliveries/s",
            f"the server of {base} (attempts in memory only), same run, rigs alternating",
            f"≥ {ATTEMPTS_RATIO_MIN:.2f}x",
            meas,
            verdict(s["ratio"] if s else None, ATTEMPTS_RATIO_MIN),
        )
    ]


def catchup_rows(cu: dict[str, Any] | None) -> list[Row]:
    """bench/catchup_outage.py: batches published during an outage of every instance, stored and
    delivered once afterwards, over every EMQX version and store."""
    s = cu["summary"] if cu else None
    meas = "n/a"
    ok = False
    if cu and s:
        m = cu["meta"]
        meas = (
            f"{s['runs']} runs ({m['versions']}; {m['stores']}), {m['outage_s']:.0f} s at {m['rate']:g} batches/s: "
            f"{s['stored']} of {s['published']} stored, {s['stored_twice']} twice; "
            f"{s['delivered_once']:,} of {s['pairs']:,} (vehicle, batch) pairs delivered exactly once"
        )
        ok = (
            s["runs"] == s["expected_runs"]
            and s["stored"] == s["published"]
            and not s["stored_twice"]
            and s["delivered_once"] == s["pairs"]
        )
    return [
        (
            "Batches published while every instance is down (kill -9), caught by the catch-up session",
            "the batches the platform had PUBACKed",
            "all stored once, delivered once",
            meas,
            "**PASS**" if ok else ("**FAIL**" if s else "not measured (run failed)"),
        )
    ]


#: Each scenario's summary rows, in the order of the summary table.
SUMMARY_ROWS: dict[str, Callable[[dict[str, Any] | None], list[Row]]] = {
    "ingest": ingest_rows,
    "hooks": hook_rows,
    "e2e": e2e_rows,
    "e2e_emqx": emqx_rows,
    "gc": gc_rows,
    "status_cost": status_rows,
    "lifecycle": lifecycle_rows,
    "attempts": attempts_rows,
    "pg_serve": pg_serve_rows,
    "failover": failover_rows,
    "catchup": catchup_rows,
}


def data_of(res: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    """A scenario's JSON numbers; None if it failed or did not run."""
    return res.get(name, {}).get("data")


# -- charts -------------------------------------------------------------------------------


def charts(res: dict[str, dict[str, Any]], out_dir: Path) -> list[tuple[str, str]]:
    """PNG charts next to the report (it links them by file name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []

    def bars(path: Path, title: str, ylabel: str, xlabels: list[str], series: dict[str, list[float]]) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(values))]
            ax.bar(xs, values, width, label=label)
        ax.set_xticks(range(len(xlabels)), xlabels)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    ing = data_of(res, "ingest")
    if ing:
        rounds = ing["rounds"]
        bars(
            out_dir / "bench_ingest.png",
            "Durable ingest: ours vs raw py-lmdb, per round",
            "VIN-rows/s",
            [f"round {i}" for i in range(1, len(rounds) + 1)],
            {
                "ours (gRPC → sdv-fanout)": [r["ours"]["rows_per_s"] for r in rounds],
                "raw py-lmdb": [r["raw"]["rows_per_s"] for r in rounds],
            },
        )
        made.append(("bench_ingest.png", "Durable ingest, VIN-rows/s per round"))

    e2e = data_of(res, "e2e")
    if e2e:
        rounds = e2e["rounds"]
        bars(
            out_dir / "bench_e2e.png",
            "End to end: ours vs raw paho QoS 1, per round",
            "delivered (+acked) msgs/s",
            [f"round {i}" for i in range(1, len(rounds) + 1)],
            {
                "ours": [r["ours"]["msgs_per_s"] for r in rounds],
                "raw (a) unconstrained": [r["raw_a"]["msgs_per_s"] for r in rounds],
                "raw (b) 1 in flight/VIN": [r["raw_b"]["msgs_per_s"] for r in rounds],
            },
        )
        made.append(("bench_e2e.png", "End-to-end msgs/s per round"))

    gc = data_of(res, "gc")
    if gc:
        steps = [("export", "export"), ("gc apply", "apply"), ("embedded GC", "embedded_gc")]
        bars(
            out_dir / "bench_gc.png",
            f"GC pipeline, {gc['rows']:,} rows (half expired)",
            "rows/s (export: read; others: deleted)",
            [label for label, _ in steps],
            {"rows/s": [gc[key]["rows_per_s"] for _, key in steps]},
        )
        made.append(("bench_gc.png", "GC pipeline rows/s per step"))

    hk = data_of(res, "hooks")
    if hk:
        hooks_chart(plt, hk, out_dir / "bench_hooks.png")
        made.append(("bench_hooks.png", "Heartbeat + ack hook RPC/s per round, latency at half load, VIN scale"))
    return made


def hooks_chart(plt: Any, hk: dict[str, Any], path: Path) -> None:
    """Three panels: RPC/s per round, latency at half load, CPU per RPC per VIN level."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rounds = hk["rounds"]
    ax = axes[0]
    names = (("ours", "ours"), ("noop", "no-op (aio)"), ("example", "EMQX example (sync)"))
    for i, (key, label) in enumerate(names):
        xs = [x + (i - 1) * 0.27 for x in range(len(rounds))]
        ax.bar(xs, [r["closed"][key]["rpc_per_s"] for r in rounds], 0.27, label=label)
    ax.set_xticks(range(len(rounds)), [f"round {i}" for i in range(1, len(rounds) + 1)])
    ax.set_title("Heartbeat + ack, closed loop, 8 channels")
    ax.set_ylabel("RPC/s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[1]
    for i, (key, label) in enumerate(names[:2]):
        xs = [x + (i - 0.5) * 0.4 for x in range(len(rounds))]
        ax.bar(xs, [r["open"][key]["p99_ms"] for r in rounds], 0.4, label=f"{label} p99")
        ax.plot(xs, [r["open"][key]["p50_ms"] for r in rounds], "k_", markersize=12)
    ax.axhline(2.0, color="red", linestyle="--", linewidth=1, label="target p99 2 ms")
    ax.set_xticks(range(len(rounds)), [f"r{i}\n{r['half_rate']:,.0f}/s" for i, r in enumerate(rounds, 1)])
    ax.set_title("Latency at half of ours' max (bars p99, ticks p50)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[2]
    levels = hk["summary"].get("scale") or []
    if levels:
        med = [lv["server_cpu_us_per_rpc"]["median"] for lv in levels]
        lo = [m - lv["server_cpu_us_per_rpc"]["min"] for m, lv in zip(med, levels, strict=True)]
        hi = [lv["server_cpu_us_per_rpc"]["max"] - m for m, lv in zip(med, levels, strict=True)]
        ax.bar(range(len(levels)), med, 0.6, yerr=[lo, hi], capsize=4, label="ours, median (min-max)")
        ax.set_xticks(range(len(levels)), [f"{lv['vins']:,} VINs ({lv['factor']:g}x)" for lv in levels])
        ax.legend(fontsize=8)
    ax.set_title("Server CPU per RPC vs distinct VINs (flat = linear)")
    ax.set_ylabel("µs/RPC")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- report -------------------------------------------------------------------------------


def versions() -> str:
    import grpc

    parts = [f"Python {platform.python_version()}", f"grpcio {grpc.__version__}"]
    try:
        import lmdb

        parts.append(f"py-lmdb {lmdb.__version__}")
    except ImportError:
        pass
    try:
        import paho.mqtt

        parts.append(f"paho-mqtt {paho.mqtt.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def nest(markdown: str) -> str:
    """A script's markdown under this report's "## " section: its top heading level becomes "###",
    the others keep their distance to it."""
    levels = [len(m[1]) for ln in markdown.splitlines() if (m := HEADING.match(ln))]
    shift = max(0, 3 - min(levels)) if levels else 0
    out = []
    for ln in markdown.splitlines():
        m = HEADING.match(ln)
        out.append("#" * min(6, len(m[1]) + shift) + ln[len(m[1]) :] if m else ln)
    return "\n".join(out)


def write_report(
    res: dict[str, dict[str, Any]],
    started: dt.datetime,
    wall_s: float,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    made: list[tuple[str, str]],
) -> str:
    def load(t: tuple[float, float, float]) -> str:
        return " / ".join(f"{v:.2f}" for v in t)

    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run_all.py`); do not edit by hand. See `bench/README.md` for what",
        "each scenario measures and how to read the ratios. Client, servers and reference share the machine's",
        "CPUs, so compare the paired ratios (measured in the same run), not absolute numbers across machines.",
        "",
        f"- **Date:** {started.strftime('%Y-%m-%d %H:%M UTC')}, total wall time {wall_s:.0f} s",
        f"- **Machine:** {os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}",
        f"- **Versions:** {versions()}",
        f"- **Load average (1/5/15 min):** {load(load_before)} before, {load(load_after)} after",
        "- **Commands** (run one after the other from the checkout, `--json` into a tmp dir):",
        "",
        "```",
        *[r["cmd"] for r in res.values()],
        "```",
        "",
        "## Summary",
        "",
        "Ratios are ours / reference, paired per round, shown as min / median / max over the rounds; "
        "PASS / FAIL compares the **median** with the target.",
        "",
        "| scenario | reference in the same run | target | measured ratio (min / median / max) | status |",
        "|---|---|---|---|---|",
    ]
    for row in summary_rows(res):
        lines.append("| " + " | ".join(row) + " |")
    failed = [f"`{name}` (exit {r['rc']})" for name, r in res.items() if r["rc"] != 0]
    if failed:
        lines += ["", f"**Failed runs:** {', '.join(failed)}; their rows above read n/a."]
    if made:
        lines += ["", "## Charts", ""]
        for fname, alt in made:
            lines += [f"![{alt}]({fname})", ""]
    for name, r in res.items():
        lines += ["", *section(name, r)]
    return "\n".join(lines).rstrip() + "\n"


def section(name: str, r: dict[str, Any], note: str = "") -> list[str]:
    """A scenario's "## " section: its command, exit code and wall time, then its markdown."""
    title = next(title for n, _, _, title in SCRIPTS if n == name)
    return [
        f"## {title}",
        "",
        f"`{r['cmd']}` — exit {r['rc']}, {r['wall_s']:.0f} s{note}",
        "",
        nest(r["markdown"]) or "_(no output)_",
    ]


def splice(report: str, res: dict[str, dict[str, Any]], started: dt.datetime) -> str:
    """The report with the command, summary rows and section of each scenario in `res` replaced by
    the new run's (or added: rows at the end of the summary table, sections in the order of SCRIPTS)."""
    lines = report.rstrip("\n").split("\n")
    note = f" (run alone with `run_all.py --only` on {started.strftime('%Y-%m-%d %H:%M UTC')})"
    fence = [i for i, ln in enumerate(lines) if ln == "```"][:2]
    if len(fence) != 2:
        raise SystemExit("the report has no commands block: run the whole `make bench` first")
    for r in res.values():
        module = r["cmd"].split()[2]  # ".venv/bin/python -m bench.x ...", or bench/x.py in an older report
        mine = (module, module.replace(".", "/") + ".py")
        at = next((i for i in range(fence[0] + 1, fence[1]) if set(lines[i].split()[1:3]) & set(mine)), None)
        if at is None:
            lines.insert(fence[1], r["cmd"])
            fence[1] += 1
        else:
            lines[at] = r["cmd"]
    new_rows = summary_rows(res)
    scenarios = {row[0] for row in new_rows}
    table = [i for i, ln in enumerate(lines) if ln.startswith("| ") and i > fence[1]]
    head = table[0] + 2 if table else None  # the header line and |---|
    if head is None or not lines[table[0]].startswith("| scenario |"):
        raise SystemExit("the report has no summary table: run the whole `make bench` first")
    end = head
    while end < len(lines) and lines[end].startswith("| "):
        end += 1
    rows = lines[head:end]
    old = [i for i, ln in enumerate(rows) if ln.split(" | ")[0][2:] in scenarios]
    at = old[0] if old else len(rows)
    rows = [ln for i, ln in enumerate(rows) if i not in old]
    rows[at:at] = ["| " + " | ".join(row) + " |" for row in new_rows]
    lines[head:end] = rows
    for name, r in res.items():
        title = section(name, r)[0]
        new = section(name, r, note)
        start = next((i for i, ln in enumerate(lines) if ln == title), None)
        if start is None:
            names = [n for n, *_ in SCRIPTS]
            later = {section(n, r)[0] for n in names[names.index(name) + 1 :]}
            at = next((i for i, ln in enumerate(lines) if ln in later), None)
            if at is None:
                lines += ["", *new]
            else:
                lines[at:at] = [*new, ""]
            continue
        stop = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:stop] = [*new, ""] if stop < len(lines) else new
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        default=str(DOCS / "BENCHMARKS.md"),
        help="report path (default docs/BENCHMARKS.md); the charts are written next to it",
    )
    p.add_argument(
        "--only",
        metavar="NAMES",
        help=f"run only these scenarios (comma-separated: {', '.join(n for n, *_ in SCRIPTS)}) and splice their "
        "commands, summary rows and sections into the existing report; the charts and the rest stay as they were",
    )
    args = p.parse_args()
    only = [n.strip() for n in (args.only or "").split(",") if n.strip()]
    unknown = sorted(set(only) - {n for n, *_ in SCRIPTS})
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sdv-bench-all-") as tmp:
        for name, script, script_args, _ in SCRIPTS:
            if not only or name in only:
                res[name] = run_script(name, script, script_args, Path(tmp))
    if only:
        failed = [name for name, r in res.items() if r["rc"] != 0]
        if failed:  # a failed run would leave stale rows next to n/a: keep the report as it was
            print(f"{', '.join(failed)} failed; {out} left as it was", file=sys.stderr)
            return 1
        out.write_text(splice(out.read_text(), res, started))
        print(f"spliced {', '.join(only)} into {out} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        return 0
    load_after = os.getloadavg()
    made = charts(res, out.parent)
    wall = time.monotonic() - t0
    report = write_report(res, started, wall, load_before, load_after, made)
    out.write_text(report)
    shown = ", ".join(str(out.parent / f) for f, _ in made) or "no charts"
    print(f"wrote {out} and {shown} in {wall:.0f} s", file=sys.stderr)
    return 0 if all(r["rc"] == 0 for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
