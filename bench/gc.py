"""Retention/GC pipeline at scale: export rows/s, Spark plan wall time, embedded GC rows/s, apply
rows/s, and the peak RSS of each step (every step runs in its own process and reports its own ru_maxrss).

    .venv/bin/python -m bench.gc                 # 1M rows (half expired), local[2] Spark

How it measures and what each flag does: bench/README.md (`bench/gc.py`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from storage.lmdb import batches
from storage.lmdb.store import Store, now_ms
from storage.lmdb.writer import GroupCommitter

ROOT = Path(__file__).resolve().parent.parent

DAY = 86_400_000
BIN = Path(sys.executable).parent


def fill(path: Path, rows: int, seed: int) -> None:
    """`rows` rows in batches of 1,000 VINs, half past retention, over rows/500 distinct blobs."""
    rng = random.Random(seed)
    store = Store(path, map_size_bytes=4 << 30)
    writer = GroupCommitter(store)
    now = now_ms()
    futures = []
    blobs = max(2, rows // 500)
    for n in range(rows // 1000):
        old = n % 2 == 0
        blob = f"payload {rng.randrange(blobs)} ".encode() * 40
        op = functools.partial(
            batches.store_batch,
            t=store.tables,
            vins=[f"WVW{n:07d}{k:03d}" for k in range(1000)],
            request_id=f"task_t{n % 5}_{n % 7}",
            blob=blob,
            now_ms=now - (8 * DAY if old else DAY),
        )
        futures.append(writer.submit(op))
    for f in futures:
        f.result()
    writer.close()
    store.close()


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run a command; returns (seconds, stdout)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    out, err = proc.communicate(timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:3]} failed: {err[-2000:]}")
    return time.monotonic() - start, out


def run_measured(code: str, *args: str, env: dict[str, str] | None = None) -> tuple[float, float, float, str]:
    """Run python code in a fresh process that prints its own peak RSS last; (s, RSS MiB, anon MiB, stdout).

    Each step gets its own process because ru_maxrss is a high-water mark per process."""
    # RssAnon (heap) is sampled: LMDB's mapped file pages also count in RSS but are page cache.
    wrapper = (
        "import resource, sys, runpy, threading, time\n"
        "peak = [0]\n"
        "def sample():\n"
        "    while True:\n"
        "        for line in open('/proc/self/status'):\n"
        "            if line.startswith('RssAnon:'):\n"
        "                peak[0] = max(peak[0], int(line.split()[1]))\n"
        "        time.sleep(0.05)\n"
        "threading.Thread(target=sample, daemon=True).start()\n"
        f"sys.argv = {['step', *args]!r}\n"
        "try:\n"
        f"    {code}\n"
        "finally:\n"
        "    print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, peak[0], flush=True)\n"
    )
    seconds, out = timed([sys.executable, "-c", wrapper], env)
    rss, anon = next(map(int, line.split()[1:]) for line in out.splitlines() if line.startswith("PEAK_RSS_KB"))
    return seconds, rss / 1024, anon / 1024, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gc-"))
    env = {"PYTHONPATH": str(ROOT), "SDV_FANOUT_GC_GRACE_S": "60"}
    try:
        t0 = time.monotonic()
        fill(tmp / "a", args.rows, args.seed)
        fill_s = time.monotonic() - t0
        shutil.copytree(tmp / "a", tmp / "b")
        cli = "from exhook_server.cli import main; rc = main(sys.argv[1:]); assert rc == 0"
        export_s, export_rss, export_anon, _ = run_measured(
            cli, "export", "--data-dir", str(tmp / "a"), "--out", str(tmp / "export"), env=env
        )
        spark_s, spark_rss, spark_anon, _ = run_measured(
            "runpy.run_module('spark.gc_job', run_name='__main__')",
            "--export",
            str(tmp / "export"),
            "--plan",
            str(tmp / "plan"),
            "--retention",
            "7d",
            "--grace",
            "1h",
            "--master",
            args.master,
            env=env,
        )
        apply_s, apply_rss, apply_anon, apply_out = run_measured(
            cli, "gc", "apply", str(tmp / "plan"), "--data-dir", str(tmp / "a"), "--json", env=env
        )
        gc_s, gc_rss, gc_anon, gc_out = run_measured(cli, "gc", "run", "--data-dir", str(tmp / "b"), "--json", env=env)
        applied = json.loads(apply_out.splitlines()[0])
        embedded = json.loads(gc_out.splitlines()[0])
        result = {
            "rows": args.rows,
            "fill_s": round(fill_s, 1),
            "export": {
                "s": round(export_s, 2),
                "rows_per_s": round(args.rows / export_s),
                "peak_rss_mib": round(export_rss),
                "peak_anon_mib": round(export_anon),
            },
            "spark_plan": {
                "s": round(spark_s, 2),
                "master": args.master,
                "peak_rss_mib_driver_python": round(spark_rss),
                "peak_anon_mib": round(spark_anon),
            },
            "apply": {
                "s": round(apply_s, 2),
                "rows_deleted": applied["rows_deleted"],
                "rows_per_s": round(applied["rows_deleted"] / apply_s),
                "peak_rss_mib": round(apply_rss),
                "peak_anon_mib": round(apply_anon),
            },
            "embedded_gc": {
                "s": round(gc_s, 2),
                "rows_deleted": embedded["rows_expired"],
                "rows_per_s": round(embedded["rows_expired"] / gc_s),
                "peak_rss_mib": round(gc_rss),
                "peak_anon_mib": round(gc_anon),
            },
            "agree": applied["rows_deleted"] == embedded["rows_expired"]
            and applied["blobs_deleted"] == embedded["blobs_deleted"],
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"## GC pipeline, {args.rows:,} rows (half expired), Spark {args.master}\n")
    print("| step | wall s | rows/s | peak RSS MiB | peak heap (RssAnon) MiB |\n|---|---:|---:|---:|---:|")
    table = [
        ("export (LMDB -> Parquet)", result["export"], f"{result['export']['rows_per_s']:,}"),
        ("Spark plan", result["spark_plan"], "n/a"),
        ("gc apply", result["apply"], f"{result['apply']['rows_per_s']:,} deleted"),
        ("embedded GC", result["embedded_gc"], f"{result['embedded_gc']['rows_per_s']:,} deleted"),
    ]
    for name, step, rate in table:
        rss = step.get("peak_rss_mib", step.get("peak_rss_mib_driver_python"))
        print(f"| {name} | {step['s']} | {rate} | {rss} | {step['peak_anon_mib']} |")
    print(
        f"\nplan+apply and embedded GC agree: {result['agree']}; fill took {result['fill_s']} s; "
        "wall times include process start-up; Spark RSS is the Python driver only (the JVM is separate); "
        "RSS includes LMDB's mapped file pages (page cache), RssAnon is the process's own heap."
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
