"""grpc.aio server vs sync grpc.server(ThreadPoolExecutor(10)) for a no-op HookProvider.

    .venv/bin/python -m bench.grpc_flavour [--rounds 5] [--duration 3] [--clients 8] [--client-procs 1] [--json F]

How it measures and what each flag does: bench/README.md (`bench/grpc_flavour.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import grpc

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.noop_server import NoopServer
from testkit.plumbing import own_cpu_s, proc_cpu_s
from testkit.reports.grpc_flavour import FLAVOURS, markdown, summarise

SERVICE = "/emqx.exhook.v3.HookProvider/"
CLK_TCK = os.sysconf("SC_CLK_TCK")
META = pb.RequestMeta(node="emqx@127.0.0.1", version="5.8.9", cluster_name="emqxcl")


def _requests() -> dict[str, tuple[bytes, Any, str]]:
    """hook -> (serialised request, response class, expected answer) as EMQX would send them."""
    msg = pb.Message(
        node="emqx@127.0.0.1",
        id="0006329D4B1C8F1E2B3C000000000001",
        qos=1,
        topic="vehicles/LSV0123456789ABCD/telemetry",
        payload=b'{"speed":42}',
        timestamp=1_700_000_000_000,
        headers={"username": "vehicle", "protocol": "mqtt", "peerhost": "127.0.0.1"},
    )
    setattr(msg, "from", "LSV0123456789ABCD")
    publish = pb.MessagePublishRequest(message=msg, meta=META)
    connected = pb.ClientConnectedRequest(
        clientinfo=pb.ClientInfo(
            node="emqx@127.0.0.1",
            clientid="LSV0123456789ABCD",
            username="vehicle",
            peerhost="127.0.0.1",
            sockport=1883,
            protocol="mqtt",
            mountpoint="",
        ),
        meta=META,
    )
    return {
        "OnMessagePublish": (publish.SerializeToString(), pb.ValuedResponse, "IGNORE"),
        "OnClientConnected": (connected.SerializeToString(), pb.EmptySuccess, "EmptySuccess"),
    }


# -- load generator -----------------------------------------------------------------


async def _load(
    port: int, method: str, wire: bytes, channels: int, start_at: float, duration_s: float, server_pid: int | None
) -> dict[str, Any]:
    """Closed loop on `channels` connections: warm up until start_at (wall clock), measure duration_s."""
    # A local subchannel pool: one TCP connection per channel, as EMQX's pool has (else gRPC shares one).
    opts = [("grpc.use_local_subchannel_pool", 1)]
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(channels)]
    try:
        stubs = [ch.unary_unary(SERVICE + method) for ch in chans]  # bytes in, bytes out
        for stub in stubs:
            await stub(wire, timeout=10)
        perf_start = time.perf_counter() + max(0.0, start_at - time.time())
        perf_end = perf_start + duration_s
        latencies: list[list[float]] = [[] for _ in stubs]
        last: list[bytes] = [b""]

        async def run(stub: Any, lat: list[float]) -> None:
            clock = time.perf_counter
            while clock() < perf_start:  # warm-up, not recorded
                await stub(wire, timeout=10)
            while (t := clock()) < perf_end:
                last[0] = await stub(wire, timeout=10)
                lat.append(clock() - t)

        async def window() -> tuple[float, float, float | None]:
            """CPU seconds of this process and of the server during the measured window, and its length."""
            await asyncio.sleep(max(0.0, perf_start - time.perf_counter()))
            t0, c0, s0 = time.perf_counter(), own_cpu_s(), None if server_pid is None else proc_cpu_s(server_pid)
            await asyncio.sleep(max(0.0, perf_end - time.perf_counter()))
            t1, c1, s1 = time.perf_counter(), own_cpu_s(), None if server_pid is None else proc_cpu_s(server_pid)
            return t1 - t0, c1 - c0, None if s0 is None or s1 is None else s1 - s0

        timing = asyncio.create_task(window())
        await asyncio.gather(*(run(s, lat) for s, lat in zip(stubs, latencies, strict=True)))
        elapsed = time.perf_counter() - perf_start
        window_s, client_cpu_s, server_cpu_s = await timing
        return {
            "calls": sum(len(lat) for lat in latencies),
            "elapsed": elapsed,
            "latencies": [x for lat in latencies for x in lat],
            "window_s": window_s,
            "client_cpu": client_cpu_s / window_s,
            "server_cpu": None if server_cpu_s is None else server_cpu_s / window_s,
            "last": last[0],
        }
    finally:
        for ch in chans:
            await ch.close()


def load_worker(
    port: int, method: str, wire: bytes, channels: int, start_at: float, duration_s: float, server_pid: int | None
) -> dict[str, Any]:
    """One load-generator process (or the in-process one)."""
    return asyncio.run(_load(port, method, wire, channels, start_at, duration_s, server_pid))


def measure(
    server: NoopServer,
    method: str,
    wire: bytes,
    clients: int,
    duration_s: float,
    warmup_s: float,
    pool: ProcessPoolExecutor | None,
    procs: int,
) -> dict[str, Any]:
    start_at = time.time() + warmup_s + (0.3 if pool else 0.0)
    if pool is None:
        parts = [load_worker(server.port, method, wire, clients, start_at, duration_s, server.pid)]
    else:
        split = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
        futures = [
            pool.submit(load_worker, server.port, method, wire, n, start_at, duration_s, server.pid if i == 0 else None)
            for i, n in enumerate(split)
            if n
        ]
        parts = [f.result(timeout=duration_s + warmup_s + 60) for f in futures]
    latencies = sorted(x for p in parts for x in p["latencies"])
    calls = sum(p["calls"] for p in parts)
    elapsed = max(p["elapsed"] for p in parts)
    rpc_per_s = calls / elapsed
    server_cpu = parts[0]["server_cpu"]
    return {
        "rpc_per_s": rpc_per_s,
        "calls": calls,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000,
        "server_cpu": server_cpu,
        "server_cpu_us_per_rpc": server_cpu / rpc_per_s * 1e6,
        "client_cpu": sum(p["client_cpu"] for p in parts),
        "last": parts[0]["last"],
    }


# -- main ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="grpc.aio vs sync gRPC server for a no-op ExHook HookProvider.")
    p.add_argument("--rounds", type=int, default=5, help="rounds; each measures both flavours and hooks (default 5)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds measured per flavour and hook (default 3)")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds of unrecorded load before each (default 0.5)")
    p.add_argument("--clients", type=int, default=8, help="concurrent channels, like EMQX pool_size (default 8)")
    p.add_argument("--client-procs", type=int, default=1, help="load-generator processes (default 1: this one)")
    p.add_argument(
        "--hooks",
        default="OnMessagePublish,OnClientConnected",
        help="comma-separated hooks to measure (default OnMessagePublish,OnClientConnected)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.clients < 1 or args.client_procs < 1 or args.duration <= 0 or args.warmup < 0:
        p.error("--rounds, --clients, --client-procs and --duration must be positive")
    requests = _requests()
    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop every server this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()[0]  # other work on the machine skews every number
    hooks = [h for h in args.hooks.split(",") if h]
    unknown = set(hooks) - set(requests)
    if unknown:
        p.error(f"unknown hooks {sorted(unknown)}; choose from {sorted(requests)}")

    rounds: list[dict[str, Any]] = []
    servers: dict[str, NoopServer] = {}
    pool: ProcessPoolExecutor | None = None
    with tempfile.TemporaryDirectory(prefix="sdv-bench-flavour-") as tmp:
        try:
            for flavour in FLAVOURS:
                servers[flavour] = NoopServer(flavour, Path(tmp))
            if args.client_procs > 1:
                pool = ProcessPoolExecutor(args.client_procs, mp_context=get_context("spawn"))
                # Start every worker now (spawn imports grpc), not inside the first measurement.
                for f in [pool.submit(time.sleep, 0.5) for _ in range(args.client_procs)]:
                    f.result(timeout=60)
            for r in range(args.rounds):
                result: dict[str, Any] = {}
                for h, hook in enumerate(hooks):
                    wire, response_cls, expected = requests[hook]
                    order = FLAVOURS if (r + h) % 2 == 0 else FLAVOURS[::-1]
                    entry: dict[str, Any] = {"order": "->".join(order)}
                    for flavour in order:
                        res = measure(
                            servers[flavour],
                            hook,
                            wire,
                            args.clients,
                            args.duration,
                            args.warmup,
                            pool,
                            args.client_procs,
                        )
                        answer = response_cls.FromString(res.pop("last"))
                        if expected == "IGNORE" and answer.type != pb.ValuedResponse.IGNORE:
                            raise SystemExit(f"{flavour} {hook}: unexpected answer {answer}")
                        entry[flavour] = res
                    entry["ratio"] = entry["aio"]["rpc_per_s"] / entry["sync"]["rpc_per_s"]
                    result[hook] = entry
                    print(
                        f"round {r + 1}/{args.rounds} {hook}: aio {entry['aio']['rpc_per_s']:,.0f} RPC/s, "
                        f"sync {entry['sync']['rpc_per_s']:,.0f} RPC/s, ratio {entry['ratio']:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
                rounds.append(result)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            for server in servers.values():
                server.stop()

    meta = {
        "rounds": args.rounds,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "clients": args.clients,
        "client_procs": args.client_procs,
        "hooks": hooks,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "python": platform.python_version(),
        "grpc": grpc.__version__,
    }
    print(markdown(rounds, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summarise(rounds, hooks), "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
