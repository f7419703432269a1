"""Batches published while every server instance is down, caught by the catch-up session: per
EMQX version and store, how many were published, stored afterwards, and delivered exactly once.

    .venv/bin/python -m bench.catchup_outage [--versions 5.1.6,5.8.9,5.9.1] [--stores lmdb,postgresql]

How it measures and what each flag does: bench/README.md (`bench/catchup_outage.py`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import structlog

from testkit.catchup import Rig, batch, hold_acks, hooks_reach, release_acks
from testkit.emqx_real import EmqxError, Platform, find_release, running_emqx
from testkit.harness import Throttle, poll, signal_all
from testkit.pg_cluster import PgCluster
from testkit.plumbing import say
from testkit.vehicle import Fleet

#: How long the catch-up and the deliveries may take after the restart.
DEADLINE_S = 300.0


def one(version: str, store: str, args: argparse.Namespace, workdir: Path, cluster: PgCluster | None) -> dict[str, Any]:
    store_url = cluster.new_database(f"catchup_{version.replace('.', '_')}_{int(time.time())}") if cluster else ""
    out: dict[str, Any] = {"version": version, "store": store, "how": args.how}
    with running_emqx(version, workdir / f"emqx-{version}-{store}") as broker:
        (srv_dir := workdir / f"srv-{version}-{store}").mkdir()
        rig = Rig(broker, srv_dir, store_url)
        fleet = Fleet(broker)
        platform = Platform(broker, clientid=f"sdv-platform-bench-{version}-{store}")
        try:
            poll(rig.session_held, 30, interval_s=0.1)
            vins = [f"BENCH{n:04d}" for n in range(args.vehicles)]
            vehicles = fleet.online(vins)
            platform.publish("$SDV-FANOUT", batch(vins, "warm"))
            poll(lambda: all("warm" in v.request_ids() for v in vehicles), 30)

            hold_acks(vehicles)
            if args.how == "kill":
                rig.srv.kill()
            else:
                signal_all(rig.srv, signal.SIGSTOP)
            say(f"{version} {store}: every server process {args.how}ed; publishing for {args.outage_s} s")
            rids: list[str] = []
            codes: Counter[int] = Counter()
            start = time.monotonic()
            n = 0
            while time.monotonic() - start < args.outage_s:
                due = start + n / args.rate
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                rid = f"out_{n:05d}"
                codes[platform.publish("$SDV-FANOUT", batch(vins, rid))] += 1
                rids.append(rid)
                n += 1
            back = time.monotonic()
            if args.how == "kill":
                rig.start()
                hooks_reach(rig.srv, vehicles)
            else:
                signal_all(rig.srv, signal.SIGCONT)
            release_acks(vehicles)
            say(f"{version} {store}: {len(rids)} published; server back")

            def stored() -> set[str]:
                return {e["request_id"] for e in rig.events("batch_stored")} & set(rids)

            poll(lambda: len(stored()) == len(rids), DEADLINE_S, interval_s=0.5)
            all_stored_s = time.monotonic() - back
            beat = Throttle(2.0)

            def delivered() -> bool:
                missing = [v for v in vehicles if not set(rids) <= set(v.request_ids())]
                if missing and beat.due():
                    for v in missing:
                        v.heartbeat("heartbeat")
                return not missing

            try:
                poll(delivered, DEADLINE_S, interval_s=0.2)
            except AssertionError:
                say(f"{version} {store}: not every pair delivered within {DEADLINE_S} s")
            all_delivered_s = time.monotonic() - back
            poll(lambda: rig.rows(vins) == 0, 60, interval_s=0.5)
            times = Counter(e["request_id"] for e in rig.events("batch_stored"))
            got = [Counter(v.request_ids()) for v in vehicles]
            out.update(
                published=len(rids),
                puback_ok=codes.get(0, 0),
                puback_other={hex(c): k for c, k in codes.items() if c},
                stored=sum(1 for r in rids if times[r] >= 1),
                stored_twice=sum(1 for r in rids if times[r] > 1),
                pairs=len(rids) * len(vehicles),
                delivered_once=sum(1 for g in got for r in rids if g[r] == 1),
                delivered_more=sum(1 for g in got for r in rids if g[r] > 1),
                never=sum(1 for g in got for r in rids if g[r] == 0),
                caught=len(rig.events("catchup_ingested")),
                all_stored_s=round(all_stored_s, 1),
                all_delivered_s=round(all_delivered_s, 1),
            )
        finally:
            platform.close()
            fleet.close()
            rig.close()
    say(json.dumps(out))
    return out


def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: the table only
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="5.1.6,5.8.9,5.9.1")
    ap.add_argument("--stores", default="lmdb,postgresql")
    ap.add_argument("--outage-s", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=5.0, help="batches per second during the outage")
    ap.add_argument("--vehicles", type=int, default=10)
    ap.add_argument("--how", choices=("kill", "sigstop"), default="kill")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers to PATH")
    args = ap.parse_args()
    stores = args.stores.split(",")
    results = []
    cluster = PgCluster.create(name="catchup-bench") if "postgresql" in stores else None
    try:
        with tempfile.TemporaryDirectory(prefix="catchup-bench-") as tmp:
            for version in args.versions.split(","):
                if find_release(version) is None:
                    say(f"no EMQX {version}: skipped")
                    continue
                for store in stores:
                    for attempt in range(3):  # a port taken meanwhile by another program: again
                        try:
                            where = Path(tmp) / f"{version}-{store}-{attempt}"
                            where.mkdir()
                            pg = cluster if store == "postgresql" else None
                            results.append(one(version, store, args, where, pg))
                            break
                        except EmqxError as exc:
                            say(f"{version} {store}: broker failed ({str(exc).splitlines()[0]}), again")
                        except AssertionError as exc:  # our port taken between choosing and binding it
                            if "address already in use" not in str(exc):
                                raise
                            say(f"{version} {store}: the server's port was taken meanwhile, again")
    finally:
        if cluster is not None:
            cluster.stop()
    summary = {
        "published": sum(r["published"] for r in results),
        "stored": sum(r["stored"] for r in results),
        "stored_twice": sum(r["stored_twice"] for r in results),
        "pairs": sum(r["pairs"] for r in results),
        "delivered_once": sum(r["delivered_once"] for r in results),
        "runs": len(results),
        "expected_runs": len(args.versions.split(",")) * len(stores),
    }
    if args.json:
        meta = {k: getattr(args, k) for k in ("versions", "stores", "outage_s", "rate", "vehicles", "how")}
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": results, "summary": summary}, indent=2))
    print(
        f"Outage of every instance ({args.how}) for {args.outage_s:.0f} s at {args.rate:g} batches/s, "
        f"{args.vehicles} vehicles per batch\n"
    )
    print(
        "| EMQX | store | published | PUBACK 0x00 | stored | stored twice | pairs delivered once "
        "| more than once | never | restart -> all stored | -> all delivered |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['version']} | {r['store']} | {r['published']} | {r['puback_ok']} | {r['stored']} "
            f"| {r['stored_twice']} "
            f"| {r['delivered_once']} / {r['pairs']} | {r['delivered_more']} | {r['never']} "
            f"| {r['all_stored_s']} s | {r['all_delivered_s']} s |"
        )


if __name__ == "__main__":
    main()
