"""Durable ingest throughput: sdv-fanout over gRPC against a raw py-lmdb loop, same run.

    .venv/bin/python -m bench.ingest [--rounds 5] [--batches 300] [--clients 8] [--vins 200] [--scale 1] [--json F]

How it measures and what each flag does: bench/README.md (`bench/ingest.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import lmdb

from storage.lmdb import keys
from testkit.batchload import (
    LMDB_OPTS,
    Batch,
    disk_usage,
    fsync_probe,
    make_workload,
    serve_batches,
)
from testkit.plumbing import machine_busy_s, own_cpu_s, pct
from testkit.reports.ingest import SIDES, disk_summary, markdown, markdown_levels, summarise

# -- raw: py-lmdb, one synced transaction per batch -----------------------------


def _raw_plain(txn: lmdb.Transaction, dbs: dict[str, Any], b: Batch, sha1: bytes, now: int) -> None:
    """The obvious loop: one put per entry, blob only if absent."""
    txn.put(sha1, keys.encode_u64(now), db=dbs["touched"])
    if txn.get(sha1, db=dbs["data"]) is None:
        txn.put(sha1, keys.blob_value(now, b.blob), db=dbs["data"])
    value = keys.row_value(now, sha1, len(b.blob))
    for vin in b.vins:
        rkey = keys.row_key(vin, b.request_id)
        txn.put(rkey, value, db=dbs["ids"])
        txn.put(keys.expiry_key(now, rkey), b"", db=dbs["expiry"])


def _raw_tuned(txn: lmdb.Transaction, dbs: dict[str, Any], b: Batch, sha1: bytes, now: int) -> None:
    """The same entries through the calls storage/lmdb/batches.py uses (no check for a row to replace)."""
    txn.put(sha1, keys.encode_u64(now), db=dbs["touched"])
    txn.put(sha1, keys.blob_value(now, b.blob), overwrite=False, db=dbs["data"])
    rkeys = sorted(keys.row_keys(b.vins, b.request_id))
    value = keys.row_value(now, sha1, len(b.blob))
    txn.cursor(dbs["ids"]).putmulti([(k, value) for k in rkeys])
    cur = txn.cursor(dbs["expiry"])
    entries = keys.expiry_entries(now, rkeys)
    cur.putmulti(entries, append=not cur.last() or bytes(cur.key()) < entries[0][0])


RAW_LOOPS = {"raw": _raw_plain, "raw_tuned": _raw_tuned}


def run_raw(batches: list[Batch], tmp: Path, variant: str = "raw") -> dict[str, Any]:
    write = RAW_LOOPS[variant]
    env = lmdb.open(str(tmp / "raw"), **LMDB_OPTS)
    try:
        dbs = {name: env.open_db(name.encode()) for name in ("data", "touched", "ids", "expiry")}
        latencies = []
        busy0, cpu0 = machine_busy_s(), own_cpu_s()
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            now = time.time_ns() // 1_000_000
            sha1 = hashlib.sha1(b.blob, usedforsecurity=False).digest()
            with env.begin(write=True) as txn:  # commits (and fsyncs) at the end of the block
                write(txn, dbs, b, sha1, now)
            latencies.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        cpu = own_cpu_s() - cpu0
        busy = machine_busy_s() - busy0
        with env.begin() as txn:
            rows = int(txn.stat(dbs["ids"])["entries"])
            blobs = int(txn.stat(dbs["data"])["entries"])
        commits = len(batches)
    finally:
        env.close()
    return {
        "seconds": seconds,
        "batches": len(batches),
        "rows": rows,
        "blobs": blobs,
        "commits": commits,
        "batches_per_commit": 1.0,
        "p50_ms": pct(latencies, 0.50) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "client_cpu": cpu / seconds,
        "other_cpu": max(0.0, busy - cpu) / seconds,
        "disk": disk_usage(tmp / "raw"),
    }


def measure(
    side: str, batches: list[Batch], tmp: Path, args: argparse.Namespace, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """One measurement of `side` on `batches` in its own fresh tmp dir, checked and with rates
    (`env`: more server settings, for ours)."""
    tmp.mkdir()
    try:
        if side == "ours":
            res = serve_batches(batches, args.clients, tmp, args.log_level, args.server_processes, env)
        else:
            res = run_raw(batches, tmp, side)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    expected = len(batches) * args.vins
    if res["rows"] != expected:
        raise SystemExit(f"{side}: {res['rows']} rows stored, expected {expected}")
    res["rows_per_s"] = expected / res["seconds"]
    res["batches_per_s"] = len(batches) / res["seconds"]
    return res


# -- main -------------------------------------------------------------------------


def run_round(r: int, batches: list[Batch], tmp_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One paired round: ours and the raw loop(s) on the same batches, order alternating."""
    sides = SIDES if args.tuned else SIDES[:2]
    order = sides if r % 2 == 0 else sides[::-1]
    result: dict[str, Any] = {"order": "->".join(order)}
    for side in order:
        result[side] = measure(side, batches, tmp_root / f"r{r}-{side}", args)
    result["ratio"] = result["ours"]["rows_per_s"] / result["raw"]["rows_per_s"]
    if "raw_tuned" in result:
        result["ratio_tuned"] = result["ours"]["rows_per_s"] / result["raw_tuned"]["rows_per_s"]
    return result


def run_levels(args: argparse.Namespace, levels: list[int], tmp_root: Path) -> dict[str, Any]:
    """Ours and raw at each multiple of --level-batches; medians per level and ratios to the first."""
    results = []
    for level in levels:
        n = args.level_batches * level
        batches = make_workload(args.seed + level, n, args.vins, args.fleet, args.blob_bytes, args.shared_blobs)
        runs = []
        for k in range(max(1, math.ceil(args.level_repeats / level))):
            order = ("ours", "raw") if k % 2 == 0 else ("raw", "ours")
            run = {side: measure(side, batches, tmp_root / f"L{level}-{k}-{side}", args) for side in order}
            runs.append(run)
        med = statistics.median
        ours = [x["ours"] for x in runs]
        res = {
            "level": level,
            "batches": n,
            "rows": n * args.vins,
            "runs": len(runs),
            "ours_rows_per_s": med(o["rows_per_s"] for o in ours),
            "raw_rows_per_s": med(x["raw"]["rows_per_s"] for x in runs),
            "ratio": med(x["ours"]["rows_per_s"] / x["raw"]["rows_per_s"] for x in runs),
            "server_cpu_us_per_row": med(o["server_cpu_us_per_row"] for o in ours),
            "batches_per_commit": med(o["batches_per_commit"] for o in ours),
            "bytes_per_row": med(o["disk"]["bytes_per_row"] for o in ours),
            "blob_overhead_bytes": med(o["disk"]["blob_overhead_bytes"] for o in ours),
            "file_bytes_per_row": med(o["disk"]["file_bytes_per_row"] for o in ours),
            "other_cpu": med(x[side]["other_cpu"] for x in runs for side in ("ours", "raw")),
            "p50_ms": med(o["p50_ms"] for o in ours),
            "runs_detail": runs,
        }
        results.append(res)
        print(
            f"level {level}x: {n} batches, ours {res['ours_rows_per_s']:,.0f} rows/s, "
            f"raw {res['raw_rows_per_s']:,.0f} rows/s, {res['server_cpu_us_per_row']:.2f} µs CPU/row",
            file=sys.stderr,
            flush=True,
        )
    base = results[0]
    for res in results:
        res["ours_rows_per_s_vs_base"] = res["ours_rows_per_s"] / base["ours_rows_per_s"]
        res["raw_rows_per_s_vs_base"] = res["raw_rows_per_s"] / base["raw_rows_per_s"]
        res["cpu_per_row_vs_base"] = res["server_cpu_us_per_row"] / base["server_cpu_us_per_row"]
        res["bytes_per_row_vs_base"] = res["bytes_per_row"] / base["bytes_per_row"]
    return {"levels": levels, "level_batches": args.level_batches, "results": results}


def add_ingest_options(p: argparse.ArgumentParser) -> None:
    """The workload's options `measure` and testkit.batchload.make_workload read."""
    p.add_argument("--clients", type=int, default=8, help="concurrent gRPC channels, like EMQX pool_size (default 8)")
    p.add_argument("--vins", type=int, default=200, help="VINs per batch (default 200)")
    p.add_argument("--fleet", type=int, default=20_000, help="distinct VINs batches draw from (default 20000)")
    p.add_argument("--blob-bytes", type=int, default=1024, help="payload size (default 1024)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="sdv-fanout durable ingest vs a raw py-lmdb loop (same run).")
    p.add_argument(
        "--rounds", type=int, default=5, help="measurement pairs; 0 with --levels: scale run only (default 5)"
    )
    p.add_argument("--batches", type=int, default=300, help="batches per round before --scale (default 300)")
    add_ingest_options(p)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies --batches; 0.1 for a smoke run (default 1)")
    p.add_argument("--shared-blobs", type=int, default=4, help="popular payloads half the batches reuse (default 4)")
    p.add_argument("--seed", type=int, default=20240607)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level (default info, as in production)")  # fmt: skip
    p.add_argument("--server-processes", type=int, default=0,
                   help="SDV_FANOUT_PROCESSES for the server (default 0: the server's own default)")  # fmt: skip
    p.add_argument("--tuned", action="store_true", help="also measure the raw-tuned reference (about +4 s)")
    p.add_argument("--levels", metavar="L,L,...", help="also run the scale test at these multiples, e.g. 1,10,100")
    p.add_argument("--level-batches", type=int, default=30, help="batches at level 1x (default 30)")
    p.add_argument("--level-repeats", type=int, default=5,
                   help="runs of level L: ceil(this / L), so short levels repeat (default 5)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    n_batches = max(1, round(args.batches * args.scale))
    levels = [int(x) for x in args.levels.split(",")] if args.levels else []
    if args.rounds < (0 if levels else 1) or args.clients < 1 or args.vins < 1:
        p.error("--rounds (unless --levels), --clients and --vins must be positive")
    if levels and (min(levels) < 1 or args.level_batches < 1):
        p.error("--levels and --level-batches must be positive")

    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop every server this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()[0]  # other work on the machine skews every number
    batches = make_workload(args.seed, n_batches, args.vins, args.fleet, args.blob_bytes, args.shared_blobs)
    tmp_root = Path(tempfile.mkdtemp(prefix="sdv-bench-ingest-"))
    rounds: list[dict[str, Any]] = []
    scale: dict[str, Any] | None = None
    try:
        fsync_ms = fsync_probe(tmp_root)
        for r in range(args.rounds):
            result = run_round(r, batches, tmp_root, args)
            rounds.append(result)
            print(
                f"round {r + 1}/{args.rounds}: ours {result['ours']['rows_per_s']:,.0f} rows/s, "
                f"raw {result['raw']['rows_per_s']:,.0f} rows/s, ratio {result['ratio']:.2f}",
                file=sys.stderr,
                flush=True,
            )
        if levels:
            scale = run_levels(args, levels, tmp_root)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    meta = {
        "rounds": args.rounds,
        "batches": n_batches,
        "vins": args.vins,
        "clients": args.clients,
        "fleet": args.fleet,
        "blob_bytes": args.blob_bytes,
        "shared_blobs": args.shared_blobs,
        "seed": args.seed,
        "log_level": args.log_level,
        "server_processes": args.server_processes,
        "fsync_ms": fsync_ms,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "lmdb": lmdb.__version__,
    }
    parts = []
    if rounds:
        parts.append(markdown(rounds, meta))
    if scale:
        parts.append(markdown_levels(scale, meta))
    print("\n\n".join(parts))
    if args.json:
        out: dict[str, Any] = {"meta": meta, "summary": summarise(rounds), "rounds": rounds}
        if rounds:
            out["disk"] = disk_summary(rounds)
        if scale:
            out["levels"] = scale
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
