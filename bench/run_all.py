"""Run every benchmark in bench/ with moderate settings and write docs/BENCHMARKS.md + PNG charts.

    .venv/bin/python -m bench.run_all            # what `make bench` runs (~5 min on 2 cores)

How it measures and what each flag does: bench/README.md (`bench/run_all.py`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testkit.report import (
    charts,
    splice,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

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
        "abort",
        "bench/abort_reaction.py",
        ["--rounds", "2"],  # ~3 min: 100,000 pending rows aborted and cancelled, per store and round
        "Automatic abort: crossing commit to the last row cancelled (bench/abort_reaction.py)",
    ),
    (
        "pacing",
        "bench/pacing.py",
        [],  # ~2 min: 10 s per rate and setup (a full run: --seconds 60), 3 paired e2e rounds
        "Campaign pacing: achieved vs set rate, the cost of an active policy (bench/pacing.py)",
    ),
    (
        "fleet",
        "bench/fleet.py",
        # ~9 min: per EMQX version (5.8.9, 5.9.1) 5 paired delivery rounds, heartbeat CPU (5 s rounds) and latency
        ["--beats", "10000"],
        "Vehicle events over MQTT against the strict raw reference (bench/fleet.py)",
    ),
]


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


# -- report -------------------------------------------------------------------------------


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
        for name, script, script_args, title in SCRIPTS:
            if not only or name in only:
                res[name] = {**run_script(name, script, script_args, Path(tmp)), "title": title}
    if only:
        failed = [name for name, r in res.items() if r["rc"] != 0]
        if failed:  # a failed run would leave stale rows next to n/a: keep the report as it was
            print(f"{', '.join(failed)} failed; {out} left as it was", file=sys.stderr)
            return 1
        out.write_text(splice(out.read_text(), res, started, {n: t for n, _, _, t in SCRIPTS}))
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
