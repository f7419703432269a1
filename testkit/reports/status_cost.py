"""bench/status_cost.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from testkit.plumbing import (
    dec,
    dec3,
    min_med_max,
    num,
    share,
)

OFF = {"SDV_FANOUT_STATUS_TOPIC_PREFIX": ""}
#: The server settings of each end-to-end side (on top of bench/e2e.py's).
E2E_SIDES: dict[str, dict[str, str]] = {"off": OFF, "on": {}, "per_vehicle": {"SDV_FANOUT_STATUS_PER_VEHICLE": "true"}}
#: The issue's target: status costs at most 10 % of ingest and of end-to-end throughput.
TARGET = 0.9
REQUESTS_PER_VIN = 10
BATCH_VINS = 200
ACKS_PER_COMMIT = 100


def _mmm(values: list[float], fmt: Callable[[float], str]) -> str:
    return min_med_max(values, fmt)


def ingest_markdown(ing: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds, sides = ing["rounds"], ing["sides"]

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    label = {
        "before": f"before ({meta['before']}: no outcome records or generation counts, no status)",
        "off": 'off (status_topic_prefix = "": outcomes and counts kept, nothing published)',
        "on": "on (defaults: receipts + progress every 5 s)",
    }
    lines = [
        f"### Ingest: status on vs off, {ing['batches']:,} batches x {meta['vins']} VINs per side, "
        f"{len(rounds)} rounds, 8 channels, 1 KiB blobs"
        + (
            f", {meta['campaigns']} campaigns taking turns (a request id and payload each)" if meta["campaigns"] else ""
        ),
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    for side in sides:
        lines.append(f"| {label[side]} VIN-rows/s | {_mmm(col(side, 'rows_per_s'), num)} |")
    lines.append(
        f"| **ratio on/off VIN-rows/s** (paired; target ≥ {TARGET}) | {_mmm(_r(rounds, 'on_over_off'), dec3)} |"
    )
    if "before" in sides:
        lines += [
            f"| **ratio off/before** VIN-rows/s (outcome bookkeeping + all else since {meta['before']}) | "
            f"{_mmm(_r(rounds, 'off_over_before'), dec3)} |",
            f"| ratio on/before VIN-rows/s (all of issue 12 in the ingest path) | "
            f"{_mmm(_r(rounds, 'on_over_before'), dec3)} |",
        ]
    for side in sides:
        lines.append(f"| {side}: server CPU µs per VIN-row | {_mmm(col(side, 'server_cpu_us_per_row'), dec)} |")
    lines.append(f"| server CPU per row, on/off (paired) | {_mmm(_r(rounds, 'cpu_on_over_off'), dec3)} |")
    if "before" in sides:
        lines.append(f"| server CPU per row, off/before (paired) | {_mmm(_r(rounds, 'cpu_off_over_before'), dec3)} |")
    for side in sides:
        lines += [
            f"| {side}: batch latency p50 / p99 ms (medians) | {statistics.median(col(side, 'p50_ms')):.1f} / "
            f"{statistics.median(col(side, 'p99_ms')):.1f} | | |",
            f"| {side}: batches per commit | {_mmm(col(side, 'batches_per_commit'), dec)} |",
        ]
    other = [r[s]["other_cpu"] for r in rounds for s in sides]
    lines.append(f"| **other processes' CPU** (of one core; mosquitto included) | {_mmm(other, share)} |")
    lines += [
        "",
        "| round | order | "
        + " | ".join(f"{s} rows/s" for s in sides)
        + " | on/off | "
        + ("off/before | " if "before" in sides else "")
        + "status messages the platform got (on) |",
        "|---:|---|" + "---:|" * (len(sides) + 1 + ("before" in sides)) + "---|",
    ]
    for i, r in enumerate(rounds, 1):
        cells = [f"{r[s]['rows_per_s']:,.0f}" for s in sides] + [f"{r['on_over_off']:.3f}"]
        if "before" in sides:
            cells.append(f"{r['off_over_before']:.3f}")
        got = ", ".join(f"{k} {v:,}" for k, v in r["on"]["status"].items()) or "none"
        silent = all(not r[s]["status"] for s in sides if s != "on")
        lines.append(f"| {i} | {r['order']} | {' | '.join(cells)} | {got}{'' if silent else ' (!)'} |")
    lines += [
        "",
        f"Each side: a fresh server ({rounds[0]['on']['server_processes']} process(es)) and data dir, its delivery "
        "client connected to the run's mosquitto (no vehicle online: no deliveries), the same batches ("
        + (
            "a few campaigns: most batches extend a counted generation"
            if meta["campaigns"]
            else "a request id each, so a generation each"
        )
        + f"); {ing['batches']:,} accepted receipts per round are expected on, none off "
        "and before ((!) marks a side that published). Off still writes every outcome record and generation count "
        "(storage keeps them whatever the settings); only before, an older tree, does not.",
    ]
    return "\n".join(lines)


def _r(rounds: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rounds]


def e2e_markdown(e: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = e["rounds"]
    n, b = meta["vehicles"], meta["batches"]

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    def cpu(side: str, group: str) -> list[float]:
        return [r[side]["cpu_us_per_msg"][group] for r in rounds]

    lines = [
        f"### End to end: status off / on / per-vehicle, {n:,} vehicles x {b} batches = {n * b:,} deliveries "
        f"per measurement, {len(rounds)} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f'| off (status_topic_prefix = "") delivered+acked msgs/s | {_mmm(col("off", "msgs_per_s"), num)} |',
        f"| on (receipts + progress every 5 s) msgs/s | {_mmm(col('on', 'msgs_per_s'), num)} |",
        f"| per_vehicle (on + a `vehicle` event per delivery) msgs/s | {_mmm(col('per_vehicle', 'msgs_per_s'), num)} |",
        f"| **ratio on/off msgs/s** (paired; target ≥ {TARGET}) | {_mmm(_r(rounds, 'on_over_off'), dec3)} |",
        f"| **ratio per_vehicle/off msgs/s** (paired) | {_mmm(_r(rounds, 'per_vehicle_over_off'), dec3)} |",
        f"| server CPU per message, on/off (paired) | {_mmm(_r(rounds, 'cpu_on_over_off'), dec3)} |",
        f"| server CPU per message, per_vehicle/off (paired) | {_mmm(_r(rounds, 'cpu_per_vehicle_over_off'), dec3)} |",
    ]
    for group, label in (
        ("server", "server"),
        ("mosquitto", "mosquitto"),
        ("sim fleet", "sim fleet (vehicles + EMQX hook driver)"),
        ("bench", "this bench (FakeEmqx batches + the platform's subscriber)"),
        ("other processes", "other processes (the idle rigs included)"),
    ):
        cells = " / ".join(f"{statistics.median(cpu(s, group)):,.0f}" for s in E2E_SIDES)
        lines.append(f"| {label} CPU µs per message, off / on / per_vehicle (medians) | {cells} | | |")
    lines += [
        "",
        "| round | order | off msgs/s | on msgs/s | per_vehicle msgs/s | on/off | per_vehicle/off | "
        "server µs/msg off / on / per_vehicle |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rounds, 1):
        us = " / ".join(f"{r[s]['cpu_us_per_msg']['server']:,.0f}" for s in E2E_SIDES)
        lines.append(
            f"| {i} | {r['order']} | {r['off']['msgs_per_s']:,.0f} | {r['on']['msgs_per_s']:,.0f} | "
            f"{r['per_vehicle']['msgs_per_s']:,.0f} | {r['on_over_off']:.3f} | {r['per_vehicle_over_off']:.3f} | {us} |"
        )
    exp = e["expected"]
    got = "; ".join(
        f"{side}: " + (", ".join(f"{k} {v:,}" for k, v in sorted(c.items())) or "none")
        for side, c in e["status_totals"].items()
    )
    lines += [
        "",
        f"Status messages the platform's subscriber got over the run (warm-up included): {got}; expected on both "
        f"status sides {exp['batches']:,} accepted and {exp['batches']:,} completed (a generation per batch), and "
        f"{exp['deliveries']:,} vehicle events with per_vehicle. Three rigs (mosquitto, server with "
        f"{meta['server_processes_label']}, {meta['procs']} sim fleet processes each) are up for the whole run; "
        "the two idle ones count as other processes.",
    ]
    return "\n".join(lines)


def disk_markdown(disk: list[dict[str, Any]]) -> str:
    lines = [
        "### Disk per outcome record (LMDB pages before vs after every row was delivered)",
        "",
        "| outcomes | generations | **bytes per outcome** | record (`outcomes`) | time index (`outcome_expiry`) | "
        "`gens` (whole table, amortized) | record key + value | index key + value |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in disk:
        lines.append(
            f"| {d['outcomes']:,} | {d['generations']:,} | **{d['bytes_per_outcome']:.0f}** | "
            f"{d['record_bytes']:.0f} | {d['index_bytes']:.0f} | {d['gens_bytes']:.1f} | "
            f"{d['record_key_value_bytes']:.0f} | {d['index_key_value_bytes']:.0f} |"
        )
    lines += [
        "",
        f"Fresh store per N; {REQUESTS_PER_VIN} requests per VIN in {BATCH_VINS}-VIN batches (a request id each), "
        f"delivered {ACKS_PER_COMMIT} per commit, VINs shuffled per request. Pages (branch + leaf + overflow) x "
        f"{disk[0]['page_bytes']} B; key + value is what LMDB stores before its 8 B node header and page slack.",
    ]
    return "\n".join(lines)
