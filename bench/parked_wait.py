"""How long a batch waits behind a late data message that completes many parked triggers.

    .venv/bin/python -m bench.parked_wait [--triggers 50 --vins 10000 --rounds 3 --json F]

How it measures and what each flag does: bench/README.md (`bench/parked_wait.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from storage.lmdb.store import Store
from testkit.harness import ExHookClient, SubprocessServer
from testkit.plumbing import dec, num


def one_side(max_rows: int, triggers: int, vins: int) -> dict[str, Any]:
    """Park, send the data under a stream of small batches; their latencies while completing."""
    total = triggers * vins
    with tempfile.TemporaryDirectory(prefix="sdv-bench-parked-") as tmp:
        env = {
            "SDV_FANOUT_PROCESSES": "1",
            "SDV_FANOUT_MAX_IDS_PER_BATCH": str(vins),
            "SDV_FANOUT_MAX_ROWS_PER_COMMIT": str(max_rows),
            "SDV_FANOUT_EARLY_MAX_ROWS": str(total),
            "SDV_FANOUT_MAX_PAYLOAD_BYTES": str(64 << 20),
            "SDV_FANOUT_MAX_INGEST_INFLIGHT_BYTES": str(256 << 20),
            "SDV_FANOUT_LOG_LEVEL": "warning",
        }
        server = SubprocessServer(Path(tmp) / "lmdb", env=env)
        client = ExHookClient(server.port)
        try:
            for t in range(triggers):
                doc = {
                    "ids": [f"P{t:03d}V{i:07d}" for i in range(vins)],
                    "request_id": f"task_ota_{t}",
                    "data_id": "d1",
                }
                client.publish("$SDV-FANOUT/trigger", json.dumps(doc).encode())
            waits: list[float] = []
            stop = threading.Event()

            def platform() -> None:
                n = 0
                while not stop.is_set():
                    started = time.perf_counter()
                    client.batch([f"SMALL{n:07d}"], f"task_small_{n}", "x")
                    waits.append(time.perf_counter() - started)
                    n += 1

            sender = threading.Thread(target=platform, name="platform")
            sender.start()
            started = time.perf_counter()
            client.publish("$SDV-FANOUT/data/d1", b"firmware")
            data_answer_s = time.perf_counter() - started
            with Store(Path(tmp) / "lmdb", readonly=True) as store:
                deadline = time.monotonic() + 300
                while store.early_count() and time.monotonic() < deadline:
                    time.sleep(0.01)  # a benchmark's poll of the store, not a test's synchronisation
            completion_s = time.perf_counter() - started
            stop.set()
            sender.join(60)
        finally:
            client.close()
            server.terminate()
    return {
        "max_rows_per_commit": max_rows,
        "parked_rows": total,
        "data_answer_ms": data_answer_s * 1000,
        "completion_s": completion_s,
        "batches": len(waits),
        "worst_wait_ms": max(waits) * 1000,
    }


def _spread(values: list[float], fmt: Any) -> str:
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triggers", type=int, default=50)
    ap.add_argument("--vins", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    total = args.triggers * args.vins
    rounds = []
    for r in range(args.rounds):
        sides = [("chunked", 10_000), ("one txn", total)]
        if r % 2:
            sides.reverse()
        result = {name: one_side(max_rows, args.triggers, args.vins) for name, max_rows in sides}
        result["ratio"] = result["one txn"]["worst_wait_ms"] / result["chunked"]["worst_wait_ms"]
        rounds.append(result)
    print(f"## A batch behind a late data message completing {total:,} parked rows\n")
    print("Median (min-max) over the rounds.\n")
    print("| side | worst batch wait ms | data answered ms | completion s | batches during it |")
    print("|---|---|---|---|---|")
    for name in ("chunked", "one txn"):
        rs = [r[name] for r in rounds]
        print(
            f"| {name} | {_spread([x['worst_wait_ms'] for x in rs], num)} "
            f"| {_spread([x['data_answer_ms'] for x in rs], num)} "
            f"| {_spread([x['completion_s'] for x in rs], dec)} "
            f"| {_spread([x['batches'] for x in rs], num)} |"
        )
    ratios = [r["ratio"] for r in rounds]
    print(f"\n**worst wait, one txn / chunked** (paired): {_spread(ratios, lambda v: f'{v:.1f}x')}")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
