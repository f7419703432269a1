"""PostgreSQL failover under ingest: what a kill -9 of the primary costs.

    .venv/bin/python -m bench.pg_failover [--rounds 3 --instances 2 --threads 2 --hold-s 0 --json F]

How it measures and what each flag does: bench/README.md (`bench/pg_failover.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from testkit.pg_failover import (
    HOOK_SERVICE,
    Driver,
    FailoverRig,
    HealthWatch,
    acked,
    check_stored,
    fail_over,
    ingest_events,
    never_acked,
    wait_acked,
)
from testkit.reports.pg_failover import report, summary

#: Waiting for a phase (warm-up, recovery) longer than this fails the round: something is wrong.
PHASE_DEADLINE_S = 120.0


def one_round(r: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One failover from fresh clusters and servers; its numbers."""
    with FailoverRig(tmp / f"round{r}", [{}] * args.instances, name=f"bench{r}") as rig:
        assert rig.standby is not None
        health = HealthWatch(rig.ports, interval_s=0.1).start()
        driver = Driver(rig.ports, per_instance=args.threads, vins=args.vins, fleet_size=args.fleet).start()
        instances = range(args.instances)
        try:
            for i in instances:
                wait_acked(driver, args.warm, started_after=0.0, instance=i, timeout_s=PHASE_DEADLINE_S)
            # The outage's length is the experiment's parameter here, not a synchronisation.
            t = fail_over(rig, (lambda _killed: time.sleep(args.hold_s)) if args.hold_s else None)
            print(f"round {r}: killed, promoted after {t.promoted - t.killed:.2f} s", file=sys.stderr)
            for i in instances:
                wait_acked(driver, args.settle, started_after=t.promoted, instance=i, timeout_s=PHASE_DEADLINE_S)
            driver.stop()
            calls = driver.calls()
            failed = never_acked(calls)
            retries = [driver.send(b, b.n % args.instances) for b in failed]
        finally:
            driver.stop()
            health.stop()
        stored = check_stored(rig.standby.dsn, sorted({c.batch for c in calls}, key=lambda b: b.n))
        rig.stop_servers()
        stored_events, duplicate_events = ingest_events(rig.servers)

    ok = {c.batch for c in calls if c.ok}
    first = acked(calls, started_after=t.dead)[0]  # sent once no process of the primary was left
    back = [acked(calls, started_after=t.promote_started, instance=i)[0].answered for i in instances]
    errors = [c for c in calls + retries if not c.ok]
    codes = Counter(c.code for c in errors)
    once = [
        b
        for b in failed
        if stored[b.n].whole(len(b.vins))
        and stored_events[b.request_id] <= 1
        and stored_events[b.request_id] + duplicate_events[b.batch_id] == 1
    ]
    return {
        "outage_s": t.promoted - t.killed,
        "kill_to_ack_s": first.answered - t.killed,
        "promote_to_ack_s": first.answered - t.promote_started,
        "promote_to_all_s": max(back) - t.promote_started,
        "acked": len(ok),
        "acked_lost": sum(not stored[b.n].whole(len(b.vins)) for b in ok),
        "failed": len(failed),
        "unavailable": codes[grpc.StatusCode.UNAVAILABLE],
        "timed_out": codes[grpc.StatusCode.DEADLINE_EXCEEDED],
        "other_errors": sum(n for code, n in codes.items() if code not in _COUNTED),
        "other_error_details": sorted({f"{c.code.name}: {c.detail}" for c in errors if c.code not in _COUNTED}),
        "slowest_error_s": max((c.seconds for c in errors), default=0.0),
        "slowest_call_s": max(c.seconds for c in calls + retries),
        "retried_ok": sum(c.ok for c in retries),
        "stored_once": len(once),
        "landed_despite_error": sum(duplicate_events[b.batch_id] for b in failed),
        "not_serving": any(s == "NOT_SERVING" for i in instances for _, s in health.samples(i, HOOK_SERVICE)),
    }


_COUNTED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="failovers, each on fresh clusters (default 3)")
    p.add_argument("--instances", type=int, default=2, help="server instances on the database (default 2)")
    p.add_argument("--threads", type=int, default=2, help="driver threads (channels) per instance (default 2)")
    p.add_argument("--vins", type=int, default=200, help="VINs per batch (default 200)")
    p.add_argument("--fleet", type=int, default=5000, help="distinct VINs the batches draw from (default 5000)")
    p.add_argument("--warm", type=int, default=50, help="batches acknowledged per instance before the kill")
    p.add_argument("--settle", type=int, default=20, help="batches acknowledged per instance after the promote")
    p.add_argument("--hold-s", type=float, default=0.0, help="kill → promote, seconds (default 0: at once)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if min(args.rounds, args.instances, args.threads, args.vins, args.warm, args.settle) < 1 or args.hold_s < 0:
        p.error("--rounds, --instances, --threads, --vins, --warm, --settle must be positive, --hold-s >= 0")
    load_before = os.getloadavg()[0]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="sdv-bench-failover-") as tmp:
        for r in range(1, args.rounds + 1):
            rounds.append(one_round(r, args, Path(tmp)))
            print(f"round {r}: {json.dumps(rounds[-1])}", file=sys.stderr)
    meta = {
        "command": shlex.join([".venv/bin/python", "-m", "bench.pg_failover", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        **{k: getattr(args, k) for k in ("rounds", "instances", "threads", "vins", "warm", "settle", "hold_s")},
    }
    s = summary(rounds)
    report(meta, rounds, s)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rounds": rounds, "summary": s}, indent=2))
    return 0  # measured: a loss or a timeout is the report's verdict (bold, and FAIL in run_all's summary)


if __name__ == "__main__":
    raise SystemExit(main())
