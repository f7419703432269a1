"""Draining a vehicle's queue: CPU per delivery as the queue grows, with and without queue heads.

    .venv/bin/python -m bench.drain [--lengths 1,4,100,1000] [--rows 2000] [--repeats 3] [--json F]

How it measures and what each flag does: bench/README.md (`bench/drain.py`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import exhook_server.backends.lmdb.rows as rows_mod
from storage.lmdb import batches
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter


def drain_once(length: int, total_rows: int, keep_heads: bool) -> dict[str, float]:
    """Fill `total_rows` rows as queues of `length` per VIN, then drain them all; µs per delivery."""
    saved = rows_mod._HEADS_MAX
    rows_mod._HEADS_MAX = saved if keep_heads else 0
    try:
        with tempfile.TemporaryDirectory(prefix="sdv-bench-drain-") as tmp:
            store = Store(Path(tmp) / "lmdb")
            writer = GroupCommitter(store)
            vins = [f"LSV{i:014d}" for i in range(max(1, total_rows // length))]
            for r in range(length):
                op = functools.partial(
                    batches.store_batch,
                    t=store.tables,
                    vins=vins,
                    request_id=f"task_ota_{(r * 7919) % 100_000}",  # request ids not in time order
                    blob=r.to_bytes(4, "big") * 16,
                    now_ms=1_000 + r,
                )
                writer.submit(op).result(30)
            source = rows_mod.StoreRows(store, writer)
            deliveries = 0
            cpu0, t0 = time.process_time(), time.perf_counter()
            for vin in vins:
                while (found := source.oldest(vin)) is not None:
                    row, payload = found
                    source.ack(vin, row.request_id, hashlib.sha1(payload).digest())
                    deliveries += 1
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            writer.close()
            left = store.row_count()
            store.close()
    finally:
        rows_mod._HEADS_MAX = saved
    if left:
        raise SystemExit(f"{left} rows left after the drain (queue length {length})")
    return {
        "deliveries": deliveries,
        "cpu_us_per_delivery": cpu / deliveries * 1e6,
        "wall_us_per_delivery": wall / deliveries * 1e6,
        "rows_scanned_per_delivery": source.rows_scanned / deliveries,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="CPU per delivery while draining queues of growing length.")
    p.add_argument("--lengths", default="1,4,100,1000", help="pending rows per vehicle (default 1,4,100,1000)")
    p.add_argument("--rows", type=int, default=2000, help="rows drained per measurement (default 2000)")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the best counts (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    results: list[dict[str, Any]] = []
    drain_once(4, args.rows, True)  # warm-up (imports, first LMDB env), not counted
    for length in (int(x) for x in args.lengths.split(",") if x.strip()):
        cell: dict[str, Any] = {"length": length}
        runs: dict[str, list[dict[str, float]]] = {"heads": [], "no_heads": []}
        for r in range(args.repeats):  # alternating, so drift hits both sides alike
            for side in ("heads", "no_heads") if r % 2 == 0 else ("no_heads", "heads"):
                runs[side].append(drain_once(length, args.rows, side == "heads"))
        for side, measured in runs.items():
            cell[side] = min(measured, key=lambda m: m["cpu_us_per_delivery"])
        cell["ratio"] = cell["no_heads"]["cpu_us_per_delivery"] / cell["heads"]["cpu_us_per_delivery"]
        results.append(cell)
        print(f"queue length {length}: {cell['heads']['cpu_us_per_delivery']:.0f} vs "
              f"{cell['no_heads']['cpu_us_per_delivery']:.0f} us/delivery", file=sys.stderr)  # fmt: skip
    first = results[0]["heads"]["cpu_us_per_delivery"]
    print(f"## Draining queues: oldest + ack per delivery, {args.rows:,} rows per measurement, best of {args.repeats}")
    print()
    print("| rows per vehicle | ours (queue heads) µs/delivery | vs shortest | rows read per delivery "
          "| no heads (a pass per delivery) µs/delivery | rows read per delivery | no heads / ours |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in results:
        h, n = c["heads"], c["no_heads"]
        print(f"| {c['length']:,} | {h['cpu_us_per_delivery']:.1f} | {h['cpu_us_per_delivery'] / first:.2f} | "
              f"{h['rows_scanned_per_delivery']:.1f} | {n['cpu_us_per_delivery']:.1f} | "
              f"{n['rows_scanned_per_delivery']:.1f} | {c['ratio']:.1f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
