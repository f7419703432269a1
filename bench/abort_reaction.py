"""Abort reaction: from the commit of the outcome that crosses a campaign's abort criterion to its
abort recorded and to the last of its pending rows cancelled, against a plain cancel of the same rows.

    .venv/bin/python -m bench.abort_reaction [--rounds 2] [--rows 100000] [--stores lmdb,postgresql] [--json F]

How it measures and what each flag does: bench/README.md (`bench/abort_reaction.py`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exhook_server._proto import admin_pb2
from testkit.harness import ExHookClient, SubprocessServer, admin_call, fill_rows, poll
from testkit.plumbing import Run, alternate, stop_server
from testkit.reports.abort_reaction import SIDES, markdown, summarize

RID = "task_abort_bench"
CRITERION = {"outcome": "expired", "ratio": 0.5, "min_finished": 10}
#: Rows per fill batch, and the rows that expire to cross the criterion.
FILL_VINS = 1_000
EXPIRING = 20
SERVER_ENV = {"SDV_FANOUT_EXPIRY_SWEEP_INTERVAL_S": "0.1", "SDV_FANOUT_GC_INTERVAL_S": "0"}


def fill(port: int, rows: int, clients: int = 4) -> None:
    """`rows` pending rows of RID, in batches of FILL_VINS VINs from `clients` channels."""
    fill_rows(port, rows, RID, "ABRT", clients, FILL_VINS)


def logged_at(server: SubprocessServer, event: str) -> float:
    """Epoch seconds of the server's first log line `event` (its ISO timestamp)."""
    found = next(e for e in server.events() if e.get("event") == event)
    return dt.datetime.fromisoformat(found["timestamp"]).timestamp()


def set_policy(port: int, doc: dict[str, Any]) -> None:
    admin_call(port, "SetPolicy", admin_pb2.SetPolicyRequest(request_id=RID, policy=json.dumps(doc)))


def run_side(side: str, store_url: str, tmp: Path, rows: int, say: Any) -> dict[str, Any]:
    data = tmp / f"{side}-lmdb"
    server = SubprocessServer(data, env={**SERVER_ENV, "SDV_FANOUT_STORE_URL": store_url})
    try:
        if side == "abort":
            set_policy(server.admin_port, {"abort": [CRITERION]})
        t0 = time.monotonic()
        fill(server.port, rows)
        say(f"  {side}: {rows:,} rows stored in {time.monotonic() - t0:.1f} s")
        hook = ExHookClient(server.port)
        try:
            if side == "abort":
                soon = int(time.time() * 1000) + 500
                hook.batch([f"ABRTEXP{i:010d}" for i in range(EXPIRING)], RID, "firmware-x", expires_at=soon)
                poll(lambda: server.logged("request_cancelled"), timeout_s=900, interval_s=0.05)
                start = logged_at(server, "rows_expired")  # after the crossing outcomes' commit
                recorded = logged_at(server, "campaign_aborted") - start
            else:
                start = time.time()
                hook.publish("$SDV-FANOUT/cancel", json.dumps({"request_id": RID}).encode())
                poll(lambda: server.logged("request_cancelled"), timeout_s=900, interval_s=0.05)
                recorded = logged_at(server, "cancel_started") - start
        finally:
            hook.close()
        done = next(e for e in server.events() if e.get("event") == "request_cancelled")
        assert done["cancelled"] >= rows, done
        out = {"recorded_s": recorded, "last_cancelled_s": logged_at(server, "request_cancelled") - start}
        say(f"  {side}: recorded after {out['recorded_s'] * 1000:.0f} ms, last row {out['last_cancelled_s']:.2f} s")
        return out
    finally:
        stop_server(server)
        shutil.rmtree(data, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--stores", default="lmdb,postgresql")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if args.rounds < 1 or args.rows < 1 or not set(stores) <= {"lmdb", "postgresql"} or not stores:
        p.error("--rounds and --rows must be positive, --stores a list of lmdb and postgresql")
    ctx = Run("abort")
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in stores}
    cluster: Any = None
    try:
        if "postgresql" in stores:
            from testkit.pg_cluster import PgCluster

            cluster = PgCluster.create(name="abortbench")
        for r in range(args.rounds):
            for store in stores:
                order = alternate(SIDES, r)
                ctx.say(f"round {r + 1}, {store}: {' then '.join(order)}")
                done = {}
                for side in order:
                    url = cluster.new_database(f"ab_{r}_{side}") if store == "postgresql" else ""
                    done[side] = run_side(side, url, ctx.tmp, args.rows, ctx.say)
                rounds[store].append(done)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(ctx.tmp, ignore_errors=True)
    meta = {
        "rounds": args.rounds,
        "rows": args.rows,
        "criterion": CRITERION,
        "expiring": EXPIRING,
        **ctx.meta(),
    }
    summary = summarize(rounds)
    print(markdown(rounds, summary, meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rounds": rounds, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
