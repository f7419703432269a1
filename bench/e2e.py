"""End-to-end delivery: sdv-fanout + mosquitto + a real paho fleet, against raw paho QoS 1, same run.

    .venv/bin/python -m bench.e2e [--vehicles 1000] [--batches 20] [--rounds 3] [--json F]

How it measures and what each flag does: bench/README.md (`bench/e2e.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import paho.mqtt

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.harness import SubprocessServer
from testkit.plumbing import (
    Run,
    cycle_stats,
    descendants,
    make_vins,
    mib,
    pct,
    proc_cpu_s,
    quiesce,
    rss_bytes,
    stop_server,
)
from testkit.reports.e2e import levels_markdown, markdown, rss_markdown, summarise
from testkit.rig import MAX_PER_PROC, Rig, add_rig_options, rpc_error, run_ours, server_env

SUBSCRIBED = "/emqx.exhook.v3.HookProvider/OnSessionSubscribed"


# -- phases -------------------------------------------------------------------------------------


def run_raw(rig: Rig, mode: str, tag: str, payload_bytes: int, seed: int) -> dict[str, Any]:
    assert rig.pub is not None
    n, b = len(rig.vins), rig.args.batches
    rids = [f"task_{tag}_{k}" for k in range(b)]
    rig.arm(rig.raws, b, signal=mode == "b")
    meter = rig.cpu(["raw"])
    rig.pub.send(
        {"cmd": "run", "mode": mode, "rids": rids, "payload_bytes": payload_bytes, "seed": seed,
         "deadline_s": rig.args.deadline_s}
    )  # fmt: skip
    res = rig.pub.recv(rig.args.deadline_s + 30)["done"]
    cpu = meter.shares()
    if not res["ok"]:
        raise RuntimeError(f"raw ({mode}) publisher did not finish: {res}")
    done = rig.collect(rig.raws, n * b)
    end = max(res["last_puback"], res["last_signal"], *(d["last"] for d in done))
    seconds = end - res["first"]
    return {
        "seconds": seconds,
        "msgs_per_s": n * b / seconds,
        **cycle_stats(done),
        "duplicates": sum(d["count"] - d["distinct"] for d in done),
        "cpu": cpu,
        "cpu_us_per_msg": {g: v * seconds / (n * b) * 1e6 for g, v in cpu.items()},
    }


def run_latency(rig: Rig, msgs_per_s: float, batches: int, payload_bytes: int, seed: int) -> dict[str, Any]:
    """Batches paced at about half of the measured throughput; per-message publish→receive latency."""
    assert rig.emqx is not None
    n = len(rig.vins)
    offered = msgs_per_s / 2
    interval = n / offered
    rng = random.Random(seed)
    rids = [f"task_lat_{k}" for k in range(batches)]
    payloads = [rng.randbytes(payload_bytes) for _ in rids]
    rig.arm(rig.sims, batches, times=True)
    meter = rig.cpu(["sim"])
    called: dict[str, float] = {}
    returned: dict[str, float] = {}
    t0 = time.time()
    for k, (rid, payload) in enumerate(zip(rids, payloads, strict=True)):
        delay = t0 + k * interval - time.time()
        if delay > 0:
            time.sleep(delay)  # pacing
        called[rid] = time.time()
        resp = rig.emqx.publish_batch(rig.vins, rid, payload)
        returned[rid] = time.time()
        if resp is None or resp.type != pb.ValuedResponse.STOP_AND_RETURN:
            raise RuntimeError(f"batch {rid} not stored: {resp or rpc_error(rig)}")
    end = rig.wait_rows_zero()
    cpu = meter.shares()
    done = rig.collect(rig.sims, n * batches)
    lat = [t - returned[rid] for d in done for rid, t in d["times"]]
    lat_call = [t - called[rid] for d in done for rid, t in d["times"]]
    return {
        "batches": batches,
        "interval_s": interval,
        "offered_msgs_per_s": offered,
        "achieved_msgs_per_s": n * batches / (end - t0),
        "samples": len(lat),
        "p50_ms": pct(lat, 0.50) * 1000,
        "p90_ms": pct(lat, 0.90) * 1000,
        "p99_ms": pct(lat, 0.99) * 1000,
        "max_ms": max(lat) * 1000,
        "min_ms": min(lat) * 1000,
        "before_return": sum(x < 0 for x in lat),
        "call_p50_ms": pct(lat_call, 0.50) * 1000,
        "call_p99_ms": pct(lat_call, 0.99) * 1000,
        "publish_p50_ms": statistics.median(returned[r] - called[r] for r in rids) * 1000,
        "cpu": cpu,
    }


# -- synthetic presence: S OnSessionSubscribed, delivery off --------------------------------------


def _subscribed_request(i: int) -> bytes:
    vin = f"SYN{i:014d}"
    info = pb.ClientInfo(
        node="emqx@127.0.0.1",
        clientid=vin,
        username=vin,
        peerhost=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",  # one address per vehicle, as in a fleet
        sockport=1883,
        protocol="mqtt",
        mountpoint="",
        anonymous=True,
        peerport=1024 + i % 60000,
    )
    req = pb.SessionSubscribedRequest(
        clientinfo=info,
        topic=f"agent/{vin}/proxy/request/+",
        subopts=pb.SubOpts(qos=1),
        meta=pb.RequestMeta(node="emqx@127.0.0.1", version="5.9.1", sysdescr="EMQX", cluster_name="emqxcl"),
    )
    return bytes(req.SerializeToString())


async def _drive(port: int, requests: list[bytes], clients: int) -> float:
    """Send every request from `clients` channels (one connection each), closed loop; returns seconds."""
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(clients)
    ]
    try:
        stubs = [ch.unary_unary(SUBSCRIBED) for ch in channels]
        it = iter(requests)

        async def client(stub: Any) -> None:
            for req in it:
                await stub(req, timeout=30)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for s in stubs))
        return time.perf_counter() - t0
    finally:
        for ch in channels:
            await ch.close()


def run_presence(
    tmp: Path, sessions: int, warm: int, clients: int, log_level: str, env: dict[str, str]
) -> dict[str, Any]:
    requests = [_subscribed_request(i) for i in range(sessions + warm)]
    # SubprocessServer sets SDV_FANOUT_MQTT_URL="": no delivery, presence is still tracked.
    server = SubprocessServer(tmp / "lmdb", "--log-level", log_level, env=env)
    pids = descendants(server.proc.pid)
    try:
        asyncio.run(_drive(server.port, requests[:warm], clients))  # channels, pools, first allocations
        quiesce(pids)
        base = rss_bytes(pids)
        points = []
        done = warm
        rpc_s = 0.0
        cpu_s = 0.0
        for share in (0.25, 0.5, 1.0):
            upto = warm + round(sessions * share)
            c0 = sum(map(proc_cpu_s, pids))
            rpc_s += asyncio.run(_drive(server.port, requests[done:upto], clients))
            cpu_s += sum(map(proc_cpu_s, pids)) - c0
            done = upto
            quiesce(pids)
            rss = rss_bytes(pids)
            points.append({"sessions": upto - warm, "rss": rss, "bytes_per_vin": (rss - base) / (upto - warm)})
        if server.proc.poll() is not None:
            raise RuntimeError(f"presence server died:\n{server.log()[-3000:]}")
    finally:
        stop_server(server)
    return {
        "sessions": sessions,
        "warm": warm,
        "server_processes": max(1, len(pids) - 1),  # a parent with children only runs several
        "rss_base": base,
        "points": points,
        "bytes_per_vin": points[-1]["bytes_per_vin"],
        "rpc_per_s": sessions / rpc_s,
        "server_cpu_us_per_rpc": cpu_s / sessions * 1e6,
    }


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="sdv-fanout end-to-end delivery vs raw paho QoS 1 (same run).")
    p.add_argument("--batches", type=int, default=20, help="batches per measurement, each naming all (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds of ours / raw (a) / raw (b) (default 3)")
    p.add_argument("--latency-batches", type=int, default=0, help="paced batches for latency (default --batches)")
    p.add_argument("--presence-sessions", type=int, default=100_000, help="synthetic sessions (default 100000)")
    p.add_argument("--presence-clients", type=int, default=8, help="gRPC channels for the synthetic run")
    p.add_argument("--max-inflight", type=int, default=50, help="raw publisher window (server default: 50)")
    add_rig_options(p, vehicles=1000, procs=4, deadline_s=180, seed=20240611)
    p.add_argument("--presence-only", action="store_true", help="only the synthetic RSS-per-VIN measurement")
    p.add_argument("--levels", default="", help="also ours alone at these multiples of --level-batches, e.g. 1,10,100")
    p.add_argument("--level-batches", type=int, default=1, help="batches at level 1x (default 1)")
    p.add_argument("--store-url", default="",
                   help="run the servers on this PostgreSQL database (default: LMDB in a tmp dir)")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.vehicles, args.batches, args.rounds, args.procs, args.presence_sessions) < 1:
        p.error("--vehicles, --batches, --rounds, --procs and --presence-sessions must be positive")
    args.procs = max(args.procs, -(-args.vehicles // MAX_PER_PROC))
    latency_batches = args.latency_batches or args.batches

    ctx = Run("e2e")
    tmp_root, say = ctx.tmp, ctx.say
    vins = make_vins(args.seed, args.vehicles)
    rounds: list[dict[str, Any]] = []

    rss: dict[str, Any] = {}
    lat: dict[str, Any] = {}
    levels: list[dict[str, Any]] = []
    with ctx.keeping(args.keep_tmp):
        if not args.presence_only:
            rss, lat = run_e2e(args, tmp_root, vins, rounds, latency_batches, say, levels)
        (tmp_root / "presence").mkdir()
        warm = min(1000, args.presence_sessions)
        say(f"synthetic presence: {args.presence_sessions:,} OnSessionSubscribed on a server without delivery")
        rss["presence"] = run_presence(
            tmp_root / "presence", args.presence_sessions, warm, args.presence_clients, args.log_level, server_env(args)
        )
        say(f"presence: {rss['presence']['bytes_per_vin']:,.0f} bytes per VIN")

    meta = {
        "vehicles": args.vehicles,
        "batches": args.batches,
        "rounds": args.rounds,
        "procs": args.procs,
        "server_processes": rss["presence"]["server_processes"],
        "latency_batches": latency_batches,
        "presence_sessions": args.presence_sessions,
        "presence_clients": args.presence_clients,
        "payload_bytes": args.payload_bytes,
        "max_inflight": args.max_inflight,
        "seed": args.seed,
        "log_level": args.log_level,
        "store_url": args.store_url,
        **ctx.meta(),
        "grpc": grpc.__version__,
        "paho": paho.mqtt.__version__,
    }
    if args.presence_only:
        print(rss_markdown(rss, meta))
        out: dict[str, Any] = {"meta": meta, "rss": rss}
    else:
        print(markdown(rounds, lat, rss, meta))
        if levels:
            print(levels_markdown(levels, args.vehicles))
        out = {"meta": meta, "summary": summarise(rounds), "rounds": rounds, "latency": lat, "rss": rss}
        out["levels"] = levels
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def _level_runs(level: int) -> int:
    """Runs of a work level: 5 at 1x, 2 at 10x, 1 from 100x on (about the same time each)."""
    return 5 if level < 10 else 2 if level < 100 else 1


def run_levels(rig: Rig, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Ours alone at 1x, 10x, 100x... the batches (same fleet): does the cost per message stay flat?"""
    args = rig.args
    base, out = args.batches, []
    try:
        for level in (int(x) for x in args.levels.split(",") if x.strip()):
            args.batches = args.level_batches * level  # run_ours reads the batch count from here
            # Small levels are short (1x: one batch, well under a second), so one run of them is
            # mostly noise: run them more often and keep the medians, as bench/ingest.py does.
            runs = [
                run_ours(rig, f"lv{level}r{r}", args.payload_bytes, args.seed + 5000 + 10 * level + r)
                for r in range(_level_runs(level))
            ]
            out.append(
                {
                    "level": level,
                    "runs": len(runs),
                    "messages": args.batches * len(rig.vins),
                    "msgs_per_s": statistics.median(r["msgs_per_s"] for r in runs),
                    "server_us_per_msg": statistics.median(r["cpu_us_per_msg"]["server"] for r in runs),
                    "total_us_per_msg": statistics.median(r["cpu_us_per_msg"]["total"] for r in runs),
                    "other_processes": statistics.median(r["cpu"]["other processes"] for r in runs),
                }
            )
            say(f"level {level}x: {out[-1]['messages']:,} messages, {out[-1]['msgs_per_s']:,.0f} msgs/s, "
                f"server {out[-1]['server_us_per_msg']:,.0f} us/msg")  # fmt: skip
    finally:
        args.batches = base
    for lv in out:
        lv["server_cost_vs_first"] = lv["server_us_per_msg"] / out[0]["server_us_per_msg"]
        lv["msgs_per_s_vs_first"] = lv["msgs_per_s"] / out[0]["msgs_per_s"]
    return out


def run_e2e(
    args: argparse.Namespace,
    tmp_root: Path,
    vins: list[str],
    rounds: list[dict[str, Any]],
    latency_batches: int,
    say: Callable[[str], None],
    levels: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The delivery measurements (rounds appended to `rounds`); returns (RSS of the e2e server, latency)."""
    (tmp_root / "e2e").mkdir()
    rig = Rig(args, tmp_root / "e2e", vins)
    try:
        rig.start_server()
        pids = rig.server_pids
        quiesce(pids)
        rss_before = rss_bytes(pids)
        say(f"server up (pids {pids}, RSS {mib(rss_before)} MiB); connecting {args.vehicles} sim vehicles")
        rig.start_sims()
        quiesce(pids)
        rss_after = rss_bytes(pids)
        say(f"sim fleet subscribed (server RSS {mib(rss_after)} MiB); connecting the raw fleet")
        rig.start_raws()
        for r in range(args.rounds):
            order = ("ours", "raw_a", "raw_b") if r % 2 == 0 else ("raw_b", "raw_a", "ours")
            result: dict[str, Any] = {"order": "->".join(order)}
            for side in order:
                seed = args.seed + 1000 * r + len(result)
                if side == "ours":
                    result[side] = run_ours(rig, f"r{r}", args.payload_bytes, seed)
                else:
                    result[side] = run_raw(rig, side[-1], f"r{r}{side[-1]}", args.payload_bytes, seed)
            result["ratio_a"] = result["ours"]["msgs_per_s"] / result["raw_a"]["msgs_per_s"]
            result["ratio_b"] = result["ours"]["msgs_per_s"] / result["raw_b"]["msgs_per_s"]
            rounds.append(result)
            say(
                f"round {r + 1}/{args.rounds}: ours {result['ours']['msgs_per_s']:,.0f} msgs/s, "
                f"raw (a) {result['raw_a']['msgs_per_s']:,.0f}, raw (b) {result['raw_b']['msgs_per_s']:,.0f}, "
                f"ours/(a) {result['ratio_a']:.2f}, ours/(b) {result['ratio_b']:.2f}"
            )
        median_ours = statistics.median(r["ours"]["msgs_per_s"] for r in rounds)
        lat = run_latency(rig, median_ours, latency_batches, args.payload_bytes, args.seed + 7)
        say(f"latency at {lat['offered_msgs_per_s']:,.0f} msgs/s offered: p50 {lat['p50_ms']:.0f} ms, "
            f"p99 {lat['p99_ms']:.0f} ms")  # fmt: skip
        if levels is not None:
            levels += run_levels(rig, say)
    finally:
        rig.close()
    return {"e2e_before": rss_before, "e2e_after": rss_after}, lat


if __name__ == "__main__":
    sys.exit(main())
