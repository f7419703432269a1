"""Memory under a flood of large batch calls: peak and settled RSS of a real `sdv-fanout serve`.

    .venv/bin/python -m bench.flood                          # 2 channels x 500 calls x 1 MB, 1 process

How it measures and what each flag does: bench/README.md (`bench/flood.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from testkit.flood import RssSampler, flood, hwm_bytes
from testkit.harness import SubprocessServer
from testkit.plumbing import descendants, mib, rss_bytes, stop_server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", type=int, default=2)
    ap.add_argument("--calls", type=int, default=500, help="concurrent calls per channel")
    ap.add_argument("--payload-bytes", type=int, default=1 << 20)
    ap.add_argument("--blobs", type=int, default=8, help="distinct payloads among the calls")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after the load to read RSS again")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server (repeatable)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="sdv-flood-"))
    srv = SubprocessServer(
        tmp / "lmdb", env={"SDV_FANOUT_PROCESSES": str(args.processes), **dict(e.split("=", 1) for e in args.env)}
    )
    try:
        pids = descendants(srv.proc.pid)
        before = rss_bytes(pids)
        with RssSampler(pids) as sampler:
            result = flood(
                srv.port,
                channels=args.channels,
                calls=args.calls,
                payload_bytes=args.payload_bytes,
                blobs=args.blobs,
            )
            ended = time.monotonic()
        after_load = rss_bytes(pids)
        time.sleep(max(0.0, args.settle - (time.monotonic() - ended)))  # a measurement window, not a sync
        settled = rss_bytes(pids)
        out = {
            "rss_before": before,
            "rss_peak_sampled": max(sampler.peak, after_load),
            "rss_hwm_sum": hwm_bytes(pids),
            "rss_at_end": after_load,
            "rss_settled": settled,
            "settle_s": args.settle,
            "codes": dict(result.codes),
            "details": result.details,
            "seconds": round(result.seconds, 2),
            "processes": args.processes,
            "trims": [
                {k: e[k] for k in ("rss_before", "rss_after", "took_ms")}
                for e in srv.events()
                if e.get("event") == "memory_trimmed"
            ],
        }
    finally:
        stop_server(srv)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"| {args.channels} x {args.calls} x {mib(args.payload_bytes)} MiB, {args.processes} process(es) | RSS MiB |")
    print("|---|---|")
    for key in ("rss_before", "rss_peak_sampled", "rss_hwm_sum", "rss_at_end", "rss_settled"):
        print(f"| {key} | {mib(out[key])} |")
    print(f"| answers | {out['codes']} in {out['seconds']} s |")
    for trim in out["trims"]:
        print(f"| malloc_trim | {mib(trim['rss_before'])} -> {mib(trim['rss_after'])} MiB in {trim['took_ms']} ms |")
    for code, detail in result.details.items():
        print(f"| {code} | {detail[:200]} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
