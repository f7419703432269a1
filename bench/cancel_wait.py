"""How long a batch waits for its answer while a cancel of every vehicle ends 200,000 rows.

    .venv/bin/python -m bench.cancel_wait [--rounds 2] [--rows 200000] [--clients 4] [--json F]

How it measures and what each flag does: bench/README.md (`bench/cancel_wait.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from testkit.harness import ExHookClient, SubprocessServer, fill_rows, poll
from testkit.plumbing import Run, alternate, pct, stop_server
from testkit.reports.cancel_wait import SIDES, markdown

BIG = "task_big_1"
FILL_VINS = 1_000


def fill(port: int, rows: int, clients: int) -> None:
    """`rows` pending rows of BIG, in batches of FILL_VINS VINs from `clients` channels."""
    fill_rows(port, rows, BIG, "BIG", clients, FILL_VINS)


class Trickle:
    """Closed-loop small batches from several channels, each answer's (sent at, seconds) kept."""

    def __init__(self, port: int, clients: int, vins: int, gap_s: float, request: str | None = None) -> None:
        self._request = request
        self._chans = [ExHookClient(port) for _ in range(clients)]
        self._vins = vins
        self._gap_s = gap_s
        self._stop = threading.Event()
        self.answers: list[tuple[float, float]] = []
        self.errors = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        chan = self._chans[i]
        for n in range(10**7):  # bounded; stopped by stop()
            if self._stop.is_set():
                return
            vins = [f"T{i:02d}{(n * self._vins + k) % 100_000:012d}" for k in range(self._vins)]
            sent = time.monotonic()
            try:
                chan.batch(vins, self._request or f"task_small_{i}_{n}", "x")
                ok = True
            except Exception:
                ok = False
            took = time.monotonic() - sent
            with self._lock:
                if ok:
                    self.answers.append((sent, took))
                else:
                    self.errors += 1
            self._stop.wait(self._gap_s)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        for c in self._chans:
            c.close()


def waits(answers: list[tuple[float, float]], start: float, end: float) -> dict[str, float]:
    inside = [took for sent, took in answers if start <= sent < end]
    if not inside:
        return {"n": 0, "max_s": 0.0, "p99_s": 0.0, "median_s": 0.0}
    return {
        "n": len(inside),
        "max_s": max(inside),
        "p99_s": pct(inside, 0.99),
        "median_s": statistics.median(inside),
    }


def run_side(side: str, tmp: Path, args: argparse.Namespace, say: Any, store_url: str = "") -> dict[str, Any]:
    data = tmp / f"{side}-lmdb"
    env = {"SDV_FANOUT_CANCEL_CHUNK_ROWS": str(SIDES[side]), "SDV_FANOUT_STORE_URL": store_url}
    server = SubprocessServer(data, env=env)
    try:
        t0 = time.monotonic()
        fill(server.port, args.rows, args.clients)
        say(f"  {side}: {args.rows} rows stored in {time.monotonic() - t0:.1f} s")
        trickle = Trickle(
            server.port, args.clients, args.vins, args.gap_ms / 1000, BIG if args.trickle_request == "big" else None
        )
        trickle.start()
        before = time.monotonic()
        time.sleep(args.quiet_s)  # the bench's own pacing: batches without a cancel
        client = ExHookClient(server.port)
        try:
            started = time.monotonic()
            client.publish("$SDV-FANOUT/cancel", json.dumps({"request_id": BIG}).encode())
            poll(lambda: server.logged("request_cancelled"), timeout_s=600, interval_s=0.02)
            ended = time.monotonic()
        finally:
            client.close()
        trickle.stop()
        cancelled = next(e for e in server.events() if e.get("event") == "request_cancelled")
        if args.trickle_request == "own":  # else rows the trickle stored before the cut count too
            assert cancelled["cancelled"] == args.rows, cancelled
        out = {
            "side": side,
            "cancel_chunk_rows": SIDES[side],
            "cancel_s": ended - started,
            "during": waits(trickle.answers, started, ended),
            "before": waits(trickle.answers, before, started),
            "errors": trickle.errors,
        }
        d = out["during"]
        say(
            f"  {side}: cancel {out['cancel_s']:.1f} s, {d['n']} batches during it, worst {d['max_s'] * 1000:.0f} ms,"
            f" {trickle.errors} failed"
        )
        return out
    finally:
        stop_server(server)
        shutil.rmtree(data, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--vins", type=int, default=20, help="VINs per trickle batch")
    p.add_argument("--gap-ms", type=float, default=10.0, help="pause of each channel after an answer")
    p.add_argument("--quiet-s", type=float, default=2.0, help="trickle without a cancel first")
    p.add_argument("--store", choices=("lmdb", "postgresql"), default="lmdb")
    p.add_argument("--trickle-request", choices=("own", "big"), default="own")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if min(args.rounds, args.rows, args.clients, args.vins) < 1:
        p.error("--rounds, --rows, --clients and --vins must be positive")
    ctx = Run("cancel")
    tmp, say = ctx.tmp, ctx.say

    rounds: list[dict[str, Any]] = []
    cluster: Any = None
    try:
        if args.store == "postgresql":
            from testkit.pg_cluster import PgCluster

            cluster = PgCluster.create(name="cancelwait")
        for r in range(args.rounds):
            order = alternate(SIDES, r)
            say(f"round {r + 1}: {' then '.join(order)}")
            done = {}
            for side in order:
                url = cluster.new_database(f"cw_{r}_{side}") if cluster is not None else ""
                done[side] = run_side(side, tmp, args, say, url)
            rounds.append(done)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    meta = {
        "rounds": args.rounds,
        "rows": args.rows,
        "clients": args.clients,
        "vins": args.vins,
        "gap_ms": args.gap_ms,
        "store": "LMDB" if args.store == "lmdb" else "PostgreSQL",
        "trickle_request": args.trickle_request,
        **ctx.meta(),
    }
    print(markdown(rounds, meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
