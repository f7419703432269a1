"""PostgreSQL failover under ingest (issue 14 item 4): what a kill -9 of the primary costs.

Each round starts afresh (testkit/pg_failover.py, the rig of tests/integration/test_pg_failover.py):
a primary with a synchronous standby (testkit/pg_cluster.py: 127.0.0.1, fsync and synchronous_commit
on), `--instances` 2 `sdv-fanout serve` (one process each, the server's defaults: ingest_timeout_s
4 s, store_down_grace_s 10 s) on the multi-host store_url with target_session_attrs=read-write, and
`--threads` 2 driver threads per instance, each on its own gRPC channel, sending 200-VIN batches
(a request_id, batch_id and payload each) back to back. Once each instance has acknowledged
`--warm` batches, the primary is killed -9; `--hold-s` later (0: at once, a fast operator) the
standby is promoted. The round ends when each instance has acknowledged `--settle` batches sent
after the promote; every batch that was never acknowledged is then sent again with its batch_id,
and the promoted database is read back.

Per round: failover time from the kill, and from the start of the promote, to the first
acknowledged batch sent after the kill, and to every instance having acknowledged one; acknowledged
batches lost (a receipt, a row per VIN with the batch's payload and a generation count of one per
VIN on the promoted database: must be 0); batches failed during the outage; the error calls
answered UNAVAILABLE, timed out (no answer within the client's 10 s deadline) or anything else; the
slowest error answer (against ingest_timeout_s); retried batches stored exactly once (the retry
stored it, or found the first attempt's receipt); whether a hook service reported NOT_SERVING.

    .venv/bin/python -m bench.pg_failover [--rounds 3 --instances 2 --threads 2 --hold-s 0 --json F]

Markdown to stdout, progress to stderr. About 15 s per round on the 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
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
from testkit.plumbing import dec, min_med_max, num

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


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def mmm(key: str) -> dict[str, float]:
        values = [r[key] for r in rounds]
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    return {
        **{k: mmm(k) for k in ("outage_s", "kill_to_ack_s", "promote_to_ack_s", "promote_to_all_s", "slowest_error_s")},
        **{k: sum(r[k] for r in rounds) for k in ("acked", "acked_lost", "failed", "unavailable", "timed_out")},
        "other_errors": sum(r["other_errors"] for r in rounds),
        "stored_once": sum(r["stored_once"] for r in rounds),
        "not_serving_rounds": sum(r["not_serving"] for r in rounds),
    }


def report(meta: dict[str, Any], rounds: list[dict[str, Any]], s: dict[str, Any]) -> None:
    print("## PostgreSQL failover under ingest (bench/pg_failover.py)")
    print()
    print(f"`{meta['command']}`")
    print()
    print(f"{meta['cpus']} CPUs; load average (1 min) {meta['load_before']:.2f} before, {meta['load_after']:.2f} "
          f"after; {meta['instances']} instances x {meta['threads']} driver threads, {meta['vins']}-VIN batches; "
          f"primary killed -9 after {meta['warm']} acknowledged batches per instance, standby promoted "
          f"{meta['hold_s']:g} s later; server defaults (ingest_timeout_s 4 s, store_down_grace_s 10 s). "
          "Times in seconds from the first SIGKILL; \"first ack\" is the first acknowledged batch sent once every "
          "process of the primary was gone (one sent while they were dying can still commit); \"all\" is "
          "every instance having acknowledged one sent after the promote started.")  # fmt: skip
    print()
    print("| round | kill → promoted | kill → first ack | promote → first ack | promote → all | acknowledged "
          "| acknowledged lost | failed in outage | UNAVAILABLE | timed out | other errors | slowest error answer "
          "| retried, stored once | landed despite the error | NOT_SERVING |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {dec(r['outage_s'])} | {dec(r['kill_to_ack_s'])} | {dec(r['promote_to_ack_s'])} "
              f"| {dec(r['promote_to_all_s'])} | {num(r['acked'])} | **{r['acked_lost']}** | {num(r['failed'])} "
              f"| {num(r['unavailable'])} | {num(r['timed_out'])} | {num(r['other_errors'])} "
              f"| {dec(r['slowest_error_s'])} | {r['stored_once']} of {r['failed']} | {r['landed_despite_error']} "
              f"| {'yes' if r['not_serving'] else 'no'} |")  # fmt: skip
    print()
    print("| over the rounds | min | median | max |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("kill_to_ack_s", "kill → first acknowledged batch, s"),
        ("promote_to_ack_s", "promote → first acknowledged batch, s"),
        ("promote_to_all_s", "promote → every instance acknowledging, s"),
        ("slowest_error_s", "slowest error answer, s"),
    ):
        print(f"| {label} | {min_med_max([r[key] for r in rounds], dec)} |")
    print()
    print(f"Acknowledged batches lost: **{s['acked_lost']} of {s['acked']:,}**; failed batches retried and stored "
          f"exactly once: {s['stored_once']} of {s['failed']}; calls timed out: {s['timed_out']}; "
          f"rounds with a hook service NOT_SERVING: {s['not_serving_rounds']} of {len(rounds)}.")  # fmt: skip
    others = sorted({d for r in rounds for d in r["other_error_details"]})
    if others:
        print()
        print("Other error answers (neither UNAVAILABLE nor a timeout): " + "; ".join(f"`{d}`" for d in others))


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
