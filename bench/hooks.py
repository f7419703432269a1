"""Heartbeat and ack hook RPC/s of our server against a no-op server and the EMQX example shape.

    .venv/bin/python -m bench.hooks [--rounds 5 --duration 2 --clients 8 --vins 10000 --json F]

How it measures and what each flag does: bench/README.md (`bench/hooks.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from testkit.hookload import (
    MIN_ACK_ROWS,
    OursServer,
    Reference,
    Server,
    Work,
    closed,
    make_work,
    open_loop,
    pending_rows,
    prefill,
    profile,
)
from testkit.plumbing import mmm, say
from testkit.reports.hooks import TARGETS, group_markdown, markdown, summarise

HERE = Path(__file__).resolve().parent
SEED = 20240607
VIN_CHARS = "0123456789ABCDEFGHJKLMNPRSTUVWXYZ"  # no I, O, Q, as in real VINs
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="paired rounds of the three servers (default 5)")
    p.add_argument("--duration", type=float, default=2.0, help="seconds measured per server and round (default 2)")
    p.add_argument("--warmup", type=float, default=0.4, help="unrecorded load before each measurement (default 0.4)")
    p.add_argument("--clients", type=int, default=8, help="channels, like EMQX pool_size (default 8)")
    p.add_argument("--vins", type=int, default=10_000, help="distinct VINs in the main comparison (default 10000)")
    p.add_argument("--ack-share", type=float, default=0.5, help="share of acks in the mix (default 0.5)")
    p.add_argument(
        "--rows-per-vin",
        type=int,
        default=4,
        help=f"pending rows per VIN stored for the acks to delete (at least {MIN_ACK_ROWS:,} in all; default 4)",
    )
    p.add_argument("--payload-bytes", type=int, default=1024, help="payload of the acked delivery (default 1024)")
    p.add_argument(
        "--scale-vins",
        default="1000,10000,100000",
        help="VIN counts of the scale levels; '' = skip (default 1000,10000,100000)",
    )
    p.add_argument("--scale-rounds", type=int, default=3, help="rounds over the scale levels (default 3)")
    p.add_argument("--scale-duration", type=float, default=1.5, help="seconds per scale measurement (default 1.5)")
    p.add_argument("--processes", type=int, default=None, help="pass SDV_FANOUT_PROCESSES=N to our server")
    p.add_argument(
        "--group-rounds",
        type=int,
        default=3,
        help="paired rounds of ours with 1 process vs one per CPU (0 = skip; default 3)",
    )
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--smoke", action="store_true", help="1 round of 0.5 s, scale 100/1k/10k VINs (~15 s)")
    p.add_argument("--profile", metavar="PATH", help="only profile ours with py-spy (raw stacks to PATH)")
    p.add_argument("--profile-seconds", type=float, default=20.0, help="length of the profile (default 20)")
    p.add_argument("--profile-top", type=int, default=15, help="functions listed (default 15)")
    p.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second (default 100)")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native: C frames too (slows more)")
    p.add_argument("--profile-gil", action="store_true", help="py-spy --gil: only samples holding the GIL")
    p.add_argument("--json", metavar="PATH", help="also write every number as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.duration, args.warmup, args.vins = 1, 0.5, 0.2, 1000
        args.scale_vins, args.scale_rounds, args.scale_duration = "100,1000,10000", 1, 0.5
        args.group_rounds = 1
    levels = [int(x) for x in args.scale_vins.split(",") if x.strip()]
    if args.rounds < 1 or args.clients < 1 or args.duration <= 0 or args.warmup < 0 or args.vins < 1:
        p.error("--rounds, --clients, --vins and --duration must be positive")
    if not 0 <= args.ack_share <= 1 or any(n < 1 for n in levels) or args.scale_rounds < 1:
        p.error("--ack-share must be in [0, 1], scale levels and --scale-rounds positive")
    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop every server this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    work = make_work(args.vins, args.seed, args.ack_share, args.payload_bytes, args.rows_per_vin)
    servers: list[Server] = []

    def start(make: Callable[[], Server]) -> Any:
        server = make()
        servers.append(server)
        return server

    rounds: list[dict[str, Any]] = []
    deleted: dict[str, Any] = {}
    group: dict[str, Any] | None = None
    scale: dict[str, Any] | None = None
    ours_processes = 0
    with tempfile.TemporaryDirectory(prefix="sdv-bench-hooks-") as tmp_s:
        tmp = Path(tmp_s)
        try:
            if args.profile:
                ours = start(lambda: OursServer("ours", tmp, args.processes))
                prefill(ours, work, args)
                print(
                    f"## py-spy profile of ours ({ours.processes} server process(es)), heartbeat + ack closed loop, "
                    f"{args.clients} channels, {args.vins:,} VINs\n"
                )
                print(profile(ours, work, args, Path(args.profile)))
                return 0
            say(f"starting servers; {args.vins:,} VINs")
            ours = start(lambda: OursServer("ours", tmp, args.processes))
            refs: dict[str, Server] = {
                "noop": start(lambda: Reference("noop", "aio", tmp)),
                "example": start(lambda: Reference("example", "sync", tmp)),
            }
            targets: dict[str, Server] = {"ours": ours, **refs}
            ours_processes = ours.processes
            pre = prefill(ours, work, args)
            say(f"prefill: {pre['heartbeats']:,} heartbeats in {pre['s']:.1f} s, {pre['online_vehicles']:,} online")
            for r in range(args.rounds):
                order = TARGETS if r % 2 == 0 else TARGETS[::-1]
                res: dict[str, Any] = {"order": "->".join(order), "closed": {}, "open": {}}
                for t in order:
                    res["closed"][t] = closed(targets[t], work, args, args.duration)
                res["ratio_ours_over_noop"] = res["closed"]["ours"]["rpc_per_s"] / res["closed"]["noop"]["rpc_per_s"]
                res["ratio_ours_over_example"] = (
                    res["closed"]["ours"]["rpc_per_s"] / res["closed"]["example"]["rpc_per_s"]
                )
                res["half_rate"] = res["closed"]["ours"]["rpc_per_s"] / 2
                for t in ("ours", "noop") if r % 2 == 0 else ("noop", "ours"):
                    res["open"][t] = open_loop(targets[t], work, args, res["half_rate"], args.seed + r)
                rounds.append(res)
                c, o = res["closed"], res["open"]
                say(
                    f"round {r + 1}/{args.rounds}: ours {c['ours']['rpc_per_s']:,.0f}, noop "
                    f"{c['noop']['rpc_per_s']:,.0f}, example {c['example']['rpc_per_s']:,.0f} RPC/s "
                    f"(ours/noop {res['ratio_ours_over_noop']:.2f}, ours/example "
                    f"{res['ratio_ours_over_example']:.2f}); at {res['half_rate']:,.0f}/s p99 ours "
                    f"{o['ours']['p99_ms']:.2f} ms, noop {o['noop']['p99_ms']:.2f} ms"
                )
            remaining = asyncio.run(pending_rows(ours.admin_port))
            deleted = {
                "rows_stored": pre["rows"],
                "rows_deleted_by_acks": pre["rows"] - remaining,
                "calls_issued_to_ours": work.cursors.get("ours", 0),
                "calls_before_repeating": len(work.calls),
            }
            say(f"acks deleted {deleted['rows_deleted_by_acks']:,} of {pre['rows']:,} stored rows")
            for server in servers:
                server.stop()
            servers.clear()
            if levels:
                scale = run_scale(levels, args, tmp, start)
                for server in servers:
                    server.stop()
                servers.clear()
            if args.group_rounds:
                group = run_group(args, tmp, start)
        finally:
            for server in servers:
                server.stop()

    meta = {
        "rounds": args.rounds,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "clients": args.clients,
        "vins": args.vins,
        "ack_share": args.ack_share,
        "payload_bytes": args.payload_bytes,
        "processes": args.processes,
        "ours_processes": ours_processes,
        "ack_rows": deleted,
        "seed": args.seed,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "wall_s": time.monotonic() - t0,
        "python": platform.python_version(),
        "grpc": grpc.__version__,
    }
    print(markdown(rounds, scale, meta))
    if group:
        print(group_markdown(group))
    if args.json:
        summary = summarise(rounds, scale)
        if group:
            summary["group"] = group["summary"]
        Path(args.json).write_text(
            json.dumps({"meta": meta, "summary": summary, "rounds": rounds, "scale": scale, "group": group})
        )
    return 0


def run_group(args: argparse.Namespace, tmp: Path, start: Callable[[Callable[[], Server]], Any]) -> dict[str, Any]:
    """Ours with one server process against ours with one per CPU: same load, paired rounds."""
    n = len(os.sched_getaffinity(0))
    sides = {"one": 1, "group": n}
    servers: dict[str, OursServer] = {}
    works: dict[str, Work] = {}
    for side, processes in sides.items():
        works[side] = make_work(args.vins, args.seed, args.ack_share, args.payload_bytes, args.rows_per_vin)
        servers[side] = start(functools.partial(OursServer, f"group-{side}", tmp, processes))
        prefill(servers[side], works[side], args)
    rounds = []
    for r in range(args.group_rounds):
        order = ("one", "group") if r % 2 == 0 else ("group", "one")
        res: dict[str, Any] = {"order": "->".join(order)}
        for side in order:
            res[side] = closed(servers[side], works[side], args, args.duration)
        res["ratio"] = res["group"]["rpc_per_s"] / res["one"]["rpc_per_s"]
        rounds.append(res)
        say(
            f"group round {r + 1}/{args.group_rounds}: 1 process {res['one']['rpc_per_s']:,.0f} RPC/s, "
            f"{n} processes {res['group']['rpc_per_s']:,.0f} RPC/s ({res['ratio']:.2f}x)"
        )
    summary = {
        "processes": n,
        "ratio_group_over_one": mmm([r["ratio"] for r in rounds]),
        # What the group could answer with the cores to itself (EMQX on other machines, as in
        # production), estimated from CPU per RPC: n cores / its cost, over one core / one's cost.
        "capacity_estimate_group_over_one": mmm(
            [n * r["one"]["server_cpu_us_per_rpc"] / r["group"]["server_cpu_us_per_rpc"] for r in rounds]
        ),
        **{
            f"{side}_{key}": mmm([r[side][key] for r in rounds])
            for side in sides
            for key in ("rpc_per_s", "server_cpu", "server_cpu_us_per_rpc", "client_cpu", "other_cpu")
        },
    }
    return {"processes": n, "rounds": rounds, "summary": summary}


def run_scale(
    levels: list[int], args: argparse.Namespace, tmp: Path, start: Callable[[Callable[[], Server]], Any]
) -> dict[str, Any]:
    """One fresh server per level, prefilled, then rounds over the levels in alternating order."""
    works = {n: make_work(n, args.seed, args.ack_share, args.payload_bytes, args.rows_per_vin) for n in levels}
    servers: dict[int, OursServer] = {}
    prefills: dict[str, Any] = {}
    for n in levels:
        servers[n] = start(functools.partial(OursServer, f"scale-{n}", tmp, args.processes))
        prefills[str(n)] = prefill(servers[n], works[n], args)
        say(f"scale {n:,} VINs: prefilled in {prefills[str(n)]['s']:.1f} s")
    rounds = []
    for r in range(args.scale_rounds):
        order = levels if r % 2 == 0 else levels[::-1]
        res: dict[str, Any] = {"order": "->".join(str(n) for n in order)}
        for n in order:
            res[str(n)] = closed(servers[n], works[n], args, args.scale_duration)
        base = res[str(levels[0])]
        res["cost_ratio"] = [res[str(n)]["server_cpu_us_per_rpc"] / base["server_cpu_us_per_rpc"] for n in levels]
        res["rps_ratio"] = [res[str(n)]["rpc_per_s"] / base["rpc_per_s"] for n in levels]
        rounds.append(res)
        say(
            f"scale round {r + 1}/{args.scale_rounds}: "
            + ", ".join(
                f"{n:,} VINs {res[str(n)]['rpc_per_s']:,.0f} RPC/s {res[str(n)]['server_cpu_us_per_rpc']:.0f} us/RPC"
                for n in levels
            )
        )
    return {
        "levels": levels,
        "rounds_n": args.scale_rounds,
        "duration_s": args.scale_duration,
        "prefill": prefills,
        "rounds": rounds,
    }


if __name__ == "__main__":
    sys.exit(main())
