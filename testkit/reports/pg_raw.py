"""bench/pg_raw.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import math
import statistics
from typing import Any

from testkit.plumbing import dec, min_med_max, num

BATCH_VINS = 200


def med(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def ratio(v: float) -> str:
    """dec(), or a dash where nothing was synced (a statement that wrote no WAL)."""
    return "-" if math.isnan(v) else dec(v)


def report(
    meta: dict[str, Any], ingest: list[dict[str, Any]], claim: list[dict[str, Any]], filt: list[dict[str, Any]]
) -> None:
    print("## PostgreSQL raw limits (bench/pg_raw.py)")
    print()
    print(f"`{meta['command']}`")
    print()
    print(f"PostgreSQL {meta['server_version']}, asyncpg {meta['asyncpg']}, {meta['cpus']} CPUs, "
          f"fsync={meta['fsync']}, synchronous_commit={meta['synchronous_commit']}, "
          f"wal_sync_method={meta['wal_sync_method']}, 8 KiB write+fdatasync in the cluster's dir: "
          f"{meta['fdatasync_ms']:.2f} ms; load average (1 min) {meta['load_before']:.2f} before, "
          f"{meta['load_after']:.2f} after; {meta['rounds']} rounds, medians (rates: min | median | max); "
          f"client = this one asyncio process, sharing the CPUs with the server.")  # fmt: skip
    print()
    if ingest:
        print(f"### (a) ingest: {meta['batches']} batches x {BATCH_VINS} rows per cell, one commit per "
              "batch, into `rows` (primary key (vin, request_id), index (vin, ts, request_id)), empty at "
              "the start")  # fmt: skip
        print()
        print("| method | conns | VIN-rows/s min | median | max | batches/s | batch p50 ms | p99 ms "
              "| commits per WAL fsync | WAL bytes/row | server CPU µs/row | client CPU µs/row |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in ingest:
            rs = c["runs"]
            print(f"| {c['method']} | {c['conns']} | {min_med_max([r['per_s'] for r in rs], num)} "
                  f"| {num(med(rs, 'ops_per_s'))} | {dec(med(rs, 'p50_ms'))} | {dec(med(rs, 'p99_ms'))} "
                  f"| {ratio(med(rs, 'commits_per_wal_sync'))} | {num(med(rs, 'wal_bytes_per_unit'))} "
                  f"| {dec(med(rs, 'server_cpu_us'))} | {dec(med(rs, 'client_cpu_us'))} |")  # fmt: skip
        print()
    if claim:
        print(f"### (b) claim: the first design's statement on {meta['claims']:,} VINs with 3 pending rows "
              "each, one autocommit statement per VIN; `miss` = the same on VINs already in flight (no row "
              "changes)")  # fmt: skip
        print()
        print("| statement | conns | per s min | median | max | p50 ms | p99 ms | commits per WAL fsync "
              "| WAL bytes/claim | server CPU µs/claim | client CPU µs/claim |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in claim:
            rs = c["runs"]
            print(f"| {c['kind']} | {c['conns']} | {min_med_max([r['per_s'] for r in rs], num)} "
                  f"| {dec(med(rs, 'p50_ms'))} | {dec(med(rs, 'p99_ms'))} | {ratio(med(rs, 'commits_per_wal_sync'))} "
                  f"| {num(med(rs, 'wal_bytes_per_unit'))} | {dec(med(rs, 'server_cpu_us'))} "
                  f"| {dec(med(rs, 'client_cpu_us'))} |")  # fmt: skip
        print()
    if filt:
        print(f"### (c) heartbeat filter: {meta['filters']} statements per cell, N random VINs of a fleet "
              f"of {meta['fleet']:,} ({meta['pending_share']:.0%} with 3 pending rows, half of those in "
              "flight)")  # fmt: skip
        print()
        print("| N VINs | conns | statements/s min | median | max | VINs/s | p50 ms | p99 ms | matched/statement "
              "| server CPU µs/VIN | client CPU µs/VIN | vin_state read by |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for c in filt:
            rs, n = c["runs"], c["vins"]
            print(f"| {n:,} | {c['conns']} | {min_med_max([r['per_s'] for r in rs], num)} "
                  f"| {num(med(rs, 'vins_per_s'))} | {dec(med(rs, 'p50_ms'))} | {dec(med(rs, 'p99_ms'))} "
                  f"| {dec(med(rs, 'matched_per_statement'))} | {dec(med(rs, 'server_cpu_us') / n)} "
                  f"| {dec(med(rs, 'client_cpu_us') / n)} | {c['plan']} |")  # fmt: skip
        print()
