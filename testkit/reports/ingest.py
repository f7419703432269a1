"""bench/ingest.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from testkit.plumbing import dec, num, share

SIDES = ("ours", "raw", "raw_tuned")


def _mmm(values: Sequence[float], fmt: Callable[[float], str]) -> tuple[str, str, str]:
    return fmt(min(values)), fmt(statistics.median(values)), fmt(max(values))


def _col(rounds: list[dict[str, Any]], side: str, key: str) -> list[float]:
    return [r[side][key] for r in rounds if side in r and r[side].get(key) is not None]


def _disk_col(rounds: list[dict[str, Any]], side: str, key: str) -> list[float]:
    return [r[side]["disk"][key] for r in rounds if side in r and r[side]["disk"].get(key) is not None]


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    series = {
        "ours_rows_per_s": _col(rounds, "ours", "rows_per_s"),
        "ours_batches_per_s": _col(rounds, "ours", "batches_per_s"),
        "raw_rows_per_s": _col(rounds, "raw", "rows_per_s"),
        "raw_batches_per_s": _col(rounds, "raw", "batches_per_s"),
        "raw_tuned_rows_per_s": _col(rounds, "raw_tuned", "rows_per_s"),
        "ratio_ours_over_raw": [r["ratio"] for r in rounds],
        "ratio_ours_over_raw_tuned": [r["ratio_tuned"] for r in rounds if "ratio_tuned" in r],
        "ours_batches_per_commit": _col(rounds, "ours", "batches_per_commit"),
        "ours_p50_ms": _col(rounds, "ours", "p50_ms"),
        "ours_p99_ms": _col(rounds, "ours", "p99_ms"),
        "raw_p50_ms": _col(rounds, "raw", "p50_ms"),
        "raw_p99_ms": _col(rounds, "raw", "p99_ms"),
        "ours_server_cpu": _col(rounds, "ours", "server_cpu"),
        "ours_server_cpu_us_per_row": _col(rounds, "ours", "server_cpu_us_per_row"),
        "ours_client_cpu": _col(rounds, "ours", "client_cpu"),
        "raw_cpu": _col(rounds, "raw", "client_cpu"),
        "other_cpu": [r[side]["other_cpu"] for r in rounds for side in SIDES if side in r],
        "ours_bytes_per_row": _disk_col(rounds, "ours", "bytes_per_row"),
        "ours_blob_overhead_bytes": _disk_col(rounds, "ours", "blob_overhead_bytes"),
        "raw_bytes_per_row": _disk_col(rounds, "raw", "bytes_per_row"),
    }
    for name, values in series.items():
        if values:
            out[name] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return out


def disk_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of the disk figures of ours (and raw's bytes per row, same layout)."""
    keys_ = ("bytes_per_row", "ids_bytes_per_row", "expiry_bytes_per_row", "blob_overhead_bytes", "file_bytes_per_row")
    out: dict[str, Any] = {}
    for key in keys_:
        values = _disk_col(rounds, "ours", key)
        out[key] = statistics.median(values) if values else None
    raw = _disk_col(rounds, "raw", "bytes_per_row")
    out["raw_bytes_per_row"] = statistics.median(raw) if raw else None
    if rounds:
        out["page_bytes"] = rounds[0]["ours"]["disk"]["page_bytes"]
        out["pages"] = rounds[0]["ours"]["disk"]["pages"]
    return out


def markdown(rounds: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"### Durable ingest: {meta['batches']} batches x {meta['vins']} VINs per round, "
        f"{meta['rounds']} rounds, {meta['clients']} client channels",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    table = [
        ("ours (gRPC -> sdv-fanout serve) VIN-rows/s", _col(rounds, "ours", "rows_per_s"), num),
        ("ours batches/s", _col(rounds, "ours", "batches_per_s"), num),
        ("raw (py-lmdb, 1 fsync'd txn per batch) VIN-rows/s", _col(rounds, "raw", "rows_per_s"), num),
        ("raw batches/s", _col(rounds, "raw", "batches_per_s"), num),
        ("**ratio ours/raw** (paired per round)", [r["ratio"] for r in rounds], dec),
        (
            "raw-tuned (same entries, the writer's py-lmdb calls) VIN-rows/s",
            _col(rounds, "raw_tuned", "rows_per_s"),
            num,
        ),
        ("ratio ours/raw-tuned (paired per round)", [r["ratio_tuned"] for r in rounds if "ratio_tuned" in r], dec),
        ("ours batches per commit (LMDB txn ids)", _col(rounds, "ours", "batches_per_commit"), dec),
        ("ours batch latency p50 ms", _col(rounds, "ours", "p50_ms"), dec),
        ("ours batch latency p99 ms", _col(rounds, "ours", "p99_ms"), dec),
        ("raw batch latency p50 ms", _col(rounds, "raw", "p50_ms"), dec),
        ("raw batch latency p99 ms", _col(rounds, "raw", "p99_ms"), dec),
        ("ours server CPU (of one core, all its processes)", _col(rounds, "ours", "server_cpu"), share),
        ("ours server CPU µs per VIN-row", _col(rounds, "ours", "server_cpu_us_per_row"), dec),
        ("ours client CPU (of one core)", _col(rounds, "ours", "client_cpu"), share),
        ("raw loop CPU (of one core)", _col(rounds, "raw", "client_cpu"), share),
        (
            "**other processes' CPU** (of one core; should be ~0)",
            [r[side]["other_cpu"] for r in rounds for side in SIDES if side in r],
            share,
        ),
        ("ours disk bytes per pending row (ids + expiry pages)", _disk_col(rounds, "ours", "bytes_per_row"), num),
        (
            "ours blob overhead bytes (data + touched pages - payload, per blob)",
            _disk_col(rounds, "ours", "blob_overhead_bytes"),
            num,
        ),
        (
            "ours LMDB file bytes used per row (everything, free pages included)",
            _disk_col(rounds, "ours", "file_bytes_per_row"),
            num,
        ),
        ("raw disk bytes per row (ids + expiry pages)", _disk_col(rounds, "raw", "bytes_per_row"), num),
    ]
    for label, values, fmt in table:
        if values:
            lines.append(f"| {label} | {' | '.join(_mmm(values, fmt))} |")
    r0 = rounds[0]
    d0 = r0["ours"]["disk"]
    lines += [
        "",
        f"Per round: the server ({r0['ours']['server_processes']} process(es)) stored {r0['ours']['rows']:,} rows "
        f"and {r0['ours']['blobs']} blobs for {meta['batches']} batches "
        f"({meta['batches'] - r0['ours']['blobs']} dedup hits), the raw loop {r0['raw']['rows']:,} rows and "
        f"{r0['raw']['blobs']} blobs. LMDB pages of round 1 ({d0['page_bytes']} B each): "
        + ", ".join(f"{k} {v}" for k, v in d0["pages"].items())
        + f". fdatasync on the tmp filesystem: {meta['fsync_ms']:.3f} ms median. "
        f"{meta['cpus']} CPUs shared by client, server and raw loop; 1-min load average "
        f"{meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after. Seed {meta['seed']}.",
        "",
        "| round | order | ours rows/s | raw rows/s | ratio | raw-tuned rows/s | ours batches/commit "
        "| ours s | raw s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        bpc = r["ours"]["batches_per_commit"]
        tuned = f"{r['raw_tuned']['rows_per_s']:,.0f}" if "raw_tuned" in r else "-"
        lines.append(
            f"| {i} | {r['order']} | {r['ours']['rows_per_s']:,.0f} | {r['raw']['rows_per_s']:,.0f} | "
            f"{r['ratio']:.2f} | {tuned} | {'-' if bpc is None else f'{bpc:.2f}'} | {r['ours']['seconds']:.2f} | "
            f"{r['raw']['seconds']:.2f} |"
        )
    return "\n".join(lines)


def markdown_levels(scale: dict[str, Any], meta: dict[str, Any]) -> str:
    base = scale["results"][0]
    names = ", ".join(f"{r['level']}x" for r in scale["results"])
    lines = [
        f"### Ingest at {names} the work "
        f"({scale['level_batches']} batches x {meta['vins']} VINs = 1x; fresh server and env per run)",
        "",
        "| level | batches | VIN-rows | runs | ours rows/s | raw rows/s | ours/raw | ours rows/s vs "
        f"{base['level']}x | raw rows/s vs {base['level']}x | ours server CPU µs/row | CPU/row vs {base['level']}x | "
        "bytes/row | blob overhead B | batches/commit | other CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in scale["results"]:
        lines.append(
            f"| {r['level']}x | {r['batches']:,} | {r['rows']:,} | {r['runs']} | {r['ours_rows_per_s']:,.0f} | "
            f"{r['raw_rows_per_s']:,.0f} | {r['ratio']:.2f} | {r['ours_rows_per_s_vs_base']:.2f} | "
            f"{r['raw_rows_per_s_vs_base']:.2f} | {r['server_cpu_us_per_row']:.2f} | {r['cpu_per_row_vs_base']:.2f} | "
            f"{r['bytes_per_row']:,.0f} | {r['blob_overhead_bytes']:,.0f} | {r['batches_per_commit']:.2f} | "
            f"{r['other_cpu'] * 100:.0f} % |"
        )
    lines += [
        "",
        "Medians over the runs of a level (small levels run more often: they are short). "
        "Linear or better: CPU/row vs 1x stays at or below ~1 and rows/s vs 1x at or above ~1.",
    ]
    return "\n".join(lines)
