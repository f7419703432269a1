"""Heartbeat and ack hook RPC/s of our server against a no-op server and the EMQX example shape.

Three servers, each its own subprocess on 127.0.0.1:

* ours: `sdv-fanout serve` with delivery off (SDV_FANOUT_MQTT_URL=""), metrics off, a fresh tmp data
  dir: the hook handlers and the dispatch work behind them are measured, not MQTT;
* noop: bench/noop_server.py --flavour aio, the same proto answered at once by grpc.aio;
* example: bench/noop_server.py --flavour sync, which has the shape of EMQX's official Python ExHook
  example (a sync grpc.server(ThreadPoolExecutor(max_workers=10)) whose servicer returns at once
  from every hook; the example's print of each request is left out).

Load: one grpc.aio generator in this process, C channels (default 8, EMQX's pool_size; one TCP
connection each), pre-serialised emqx.exhook.v3 requests, an even mix of the two hooks our server
does work for:

* heartbeat: OnMessagePublish of `ecp/<VIN>/online` from clientid <VIN> (headers: peerhost) ->
  presence update + an LMDB read for the VIN's oldest pending row;
* ack: OnMessageAcked of `agent/<VIN>/proxy/request/task_ota_<n>` published by
  `sdv-fanout-bench-1` (our delivery client prefix), clientinfo of the vehicle -> sha1 of the
  payload + a conditional row delete through the group committer + the follow-up send check.
  Each ack names a different (VIN, request) whose row the prefill stored with that very payload
  (`--rows-per-vin` 4 pending rows per vehicle, at least 6,000 rows), so each one really deletes a
  row and commits; the report says how many rows the acks deleted and whether any ack repeated.

Per round (order of the servers alternating round by round): closed-loop max RPC/s of each server,
one call in flight per channel, same requests, same duration -> paired ratios ours/noop and
ours/example; then open loop (Poisson arrivals, fixed seed) at half of ours' max of that round on
ours and on noop -> p50/p99 latency. Server CPU per RPC counts the server process and its children.
Scale: ours with 1k, 10k and 100k distinct VINs (presence map prefilled with one heartbeat per VIN),
closed loop, RPC/s and CPU per RPC per level, cost ratio vs the first level, paired per round.

    .venv/bin/python -m bench.hooks [--rounds 5 --duration 2 --clients 8 --vins 10000 --json F]
    .venv/bin/python -m bench.hooks --smoke          # ~15 s
    .venv/bin/python -m bench.hooks --profile /tmp/hooks.txt   # py-spy on ours under load, top functions

Markdown to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc

from bench.grpc_flavour import NoopServer, own_cpu_s, proc_cpu_s, wait_ready
from exhook_server._proto import admin_pb2
from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.plumbing import descendants

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVICE = "/emqx.exhook.v3.HookProvider/"
METHODS = (SERVICE + "OnMessagePublish", SERVICE + "OnMessageAcked")  # index = kind
HEARTBEAT, ACK = 0, 1
KINDS = ("heartbeat", "ack")
TARGETS = ("ours", "noop", "example")
DELIVERY_CLIENTID = "sdv-fanout-bench-1"  # starts with mqtt_clientid_prefix: acks count as ours
SEED = 20240607
VIN_CHARS = "0123456789ABCDEFGHJKLMNPRSTUVWXYZ"  # no I, O, Q, as in real VINs
_VIN_SLOT = "~" * 17  # placeholders in the templates; same length as what replaces them
_TASK_SLOT = "^" * 6
MAX_OUTSTANDING = 5000  # open loop: calls in flight before arrivals are counted as skipped
CLK_TCK = os.sysconf("SC_CLK_TCK")
META = pb.RequestMeta(node="emqx@127.0.0.1", version="5.8.9", cluster_name="emqxcl")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- processes and CPU ----------------------------------------------------------------------------


def tree_cpu_s(pids: Iterable[int]) -> float:
    """utime + stime of these processes (all threads); a process gone counts 0."""
    total = 0.0
    for p in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += proc_cpu_s(p)
    return total


def tree_run_ns(pids: Iterable[int]) -> int:
    """Nanoseconds on CPU of every thread of these processes (schedstat: finer than clock ticks)."""
    total = 0
    for p in pids:
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    total += int((task / "schedstat").read_text().split()[0])
        except OSError:
            pass
    return total


def machine_busy_s() -> float:
    """CPU seconds every CPU spent neither idle nor in iowait since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def tree_rss_bytes(pids: Iterable[int]) -> int:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class OursServer:
    """`sdv-fanout serve` as a child process; CPU counts the ready-file pid and its children."""

    def __init__(self, name: str, tmp: Path, processes: int | None) -> None:
        self.name = name
        base = tmp / name
        (base / "lmdb").mkdir(parents=True)
        ready = base / "ready.json"
        self.log_path = base / "server.log"
        self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        exe = Path(sys.executable).parent / "sdv-fanout"
        if not exe.exists():
            exe = ROOT / ".venv" / "bin" / "sdv-fanout"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SDV_FANOUT_")}
        env.update(SDV_FANOUT_MQTT_URL="", SDV_FANOUT_METRICS_LISTEN="", SDV_FANOUT_ADMIN_LISTEN="127.0.0.1:0")
        if processes is not None:  # unknown settings are refused, so only when asked for
            env["SDV_FANOUT_PROCESSES"] = str(processes)
        argv = [str(exe), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(base / "lmdb")]
        argv += ["--ready-file", str(ready), "--log-level", "warning"]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        info = wait_ready(self.proc, ready, self.log_path, self._log, name, self.stop)
        self.port: int = info["port"]
        self.admin_port: int = info["admin_port"]  # GetStats: the Admin API has its own listener
        self.pid: int = info["pid"]
        #: Server processes answering hooks: the children when the ready-file pid supervises a group.
        self.processes = len(info.get("pids") or [self.pid])

    def pids(self) -> list[int]:
        found = descendants(self.pid)
        return found if self.proc.pid in found else [self.proc.pid, *found]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)  # shutdown_timeout_s is 20 s
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Reference:
    """A bench/noop_server.py flavour (grpc_flavour.NoopServer) with the same interface as OursServer."""

    def __init__(self, name: str, flavour: str, tmp: Path) -> None:
        self.name = name
        self._server = NoopServer(flavour, tmp)
        self.port = self._server.port
        self.pid = self._server.pid

    def pids(self) -> list[int]:
        return descendants(self.pid)

    def stop(self) -> None:
        self._server.stop()


Server = OursServer | Reference


# -- workload -------------------------------------------------------------------------------------


@dataclass
class Work:
    vins: int
    calls: list[tuple[int, bytes]]  # (HEARTBEAT | ACK, serialised request), cycled by the load
    heartbeats: list[bytes]  # one per VIN: the presence prefill
    batches: list[bytes]  # OnMessagePublish requests storing the rows the acks delete
    ack_rows: int  # rows those batches store (= distinct acks before the calls cycle)
    #: Server name -> calls issued to it so far: each measurement goes on where the last one
    #: stopped, so an ack never names a row an earlier measurement already deleted.
    cursors: dict[str, int] = field(default_factory=dict)

    def resume(self, server: str) -> list[tuple[int, bytes]]:
        """The calls rotated to where `server`'s last measurement stopped."""
        c = self.cursors.get(server, 0) % len(self.calls)
        return self.calls[c:] + self.calls[:c]

    def advance(self, server: str, issued: int) -> None:
        self.cursors[server] = self.cursors.get(server, 0) + issued


def _message(topic: str, sender: str, payload: bytes, headers: dict[str, str]) -> pb.Message:
    msg = pb.Message(
        node="emqx@127.0.0.1",
        id="0006329D4B1C8F1E2B3C000000000001",
        qos=1,
        topic=topic,
        payload=payload,
        timestamp=1_700_000_000_000,
        headers=headers,
    )
    setattr(msg, "from", sender)
    return msg


def _templates(payload: bytes) -> tuple[bytes, bytes]:
    """Serialised heartbeat and ack with placeholders: replacing them with as many bytes keeps
    the protobuf valid, so 100k VINs cost a bytes.replace each instead of a protobuf build."""
    heartbeat = pb.MessagePublishRequest(
        message=_message(
            f"ecp/{_VIN_SLOT}/online",
            _VIN_SLOT,
            b'{"status":"online","ts":1700000000000}',
            {"username": "vehicle", "protocol": "mqtt", "peerhost": "10.42.7.19"},
        ),
        meta=META,
    )
    ack = pb.MessageAckedRequest(
        clientinfo=pb.ClientInfo(
            node="emqx@127.0.0.1",
            clientid=_VIN_SLOT,
            username="vehicle",
            peerhost="10.42.7.19",
            sockport=1883,
            protocol="mqtt",
            peerport=51234,
        ),
        message=_message(
            f"agent/{_VIN_SLOT}/proxy/request/task_ota_{_TASK_SLOT}",
            DELIVERY_CLIENTID,
            payload,
            {"protocol": "mqtt", "peerhost": "127.0.0.1"},
        ),
        meta=META,
    )
    return heartbeat.SerializeToString(), ack.SerializeToString()


def make_vins(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen["LSV" + "".join(rng.choice(VIN_CHARS) for _ in range(14))] = None
    return list(seen)


#: Fewest rows stored for the acks, so that a small fleet's run does not run out of rows to ack.
MIN_ACK_ROWS = 6_000


def make_work(n_vins: int, seed: int, ack_share: float, payload_bytes: int, rows_per_vin: int = 4) -> Work:
    rng = random.Random(seed)
    vins = make_vins(n_vins, seed)
    payload = bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(payload_bytes))
    hb_t, ack_t = _templates(payload)
    slot, task = _VIN_SLOT.encode(), _TASK_SLOT.encode()
    assert hb_t.count(slot) == 2 and ack_t.count(slot) == 2 and ack_t.count(task) == 1
    heartbeats = [hb_t.replace(slot, v.encode()) for v in vins]
    # Request numbers per VIN, so that the acks of the whole run name distinct rows.
    per_vin = max(rows_per_vin, -(-MIN_ACK_ROWS // n_vins))
    acks = [ack_t.replace(slot, v.encode()).replace(task, b"%06d" % n) for n in range(per_vin) for v in vins]
    text = payload.decode()
    batches = [
        pb.MessagePublishRequest(
            message=_message(
                "$SDV-FANOUT",
                "sdv-platform",
                json.dumps({"ids": vins[i : i + 5000], "request_id": f"task_ota_{n:06d}", "data": text}).encode(),
                {"username": "platform", "protocol": "mqtt", "peerhost": "127.0.0.1"},
            ),
            meta=META,
        ).SerializeToString()
        for n in range(per_vin)
        for i in range(0, n_vins, 5000)
    ]
    # Spot-check that the substituted requests parse to what EMQX would send.
    hb = pb.MessagePublishRequest.FromString(heartbeats[-1])
    assert hb.message.topic == f"ecp/{vins[-1]}/online" and getattr(hb.message, "from") == vins[-1]
    ak = pb.MessageAckedRequest.FromString(acks[-1])
    assert ak.clientinfo.clientid == vins[-1] and ak.message.topic.startswith(f"agent/{vins[-1]}/proxy/request/")
    # The mix: each slot is an ack with probability ack_share; each kind walks its own shuffled VIN order.
    hb_order = list(range(n_vins))
    rng.shuffle(hb_order)
    # Request number by request number, VINs in a shuffled order: every ack is for a new row.
    vin_order = list(range(n_vins))
    rng.shuffle(vin_order)
    ack_order = [n * n_vins + i for n in range(per_vin) for i in vin_order]
    calls: list[tuple[int, bytes]] = []
    nh = na = 0
    length = max(2 * n_vins, 4000, int(len(acks) / ack_share) if ack_share else 0)
    for _ in range(length):
        if rng.random() < ack_share:
            calls.append((ACK, acks[ack_order[na % len(acks)]]))
            na += 1
        else:
            calls.append((HEARTBEAT, heartbeats[hb_order[nh % n_vins]]))
            nh += 1
    return Work(n_vins, calls, heartbeats, batches if ack_share else [], per_vin * n_vins if ack_share else 0)


# -- load generator -------------------------------------------------------------------------------


def _channels(port: int, n: int) -> list[grpc.aio.Channel]:
    # A local subchannel pool: one TCP connection per channel, as EMQX's pool has (else gRPC shares one).
    opts = [("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(n)]


def _pct(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else float("nan")


async def _drain(pids: list[int], timeout_s: float = 10.0, step_s: float = 0.05, idle: float = 0.1) -> float:
    """Seconds until the server used under `idle` of a core over `step_s`: the work left behind the answers."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        a, ta = tree_run_ns(pids), time.perf_counter()
        await asyncio.sleep(step_s)
        if (tree_run_ns(pids) - a) / 1e9 / (time.perf_counter() - ta) < idle:
            return ta - t0
    return timeout_s


def _check(answers: list[bytes]) -> None:
    if answers[HEARTBEAT] and pb.ValuedResponse.FromString(answers[HEARTBEAT]).type != pb.ValuedResponse.IGNORE:
        raise SystemExit(f"heartbeat answered {pb.ValuedResponse.FromString(answers[HEARTBEAT])}, not IGNORE")
    pb.EmptySuccess.FromString(answers[ACK])


async def _closed(
    port: int, calls: list[tuple[int, bytes]], channels: int, warmup_s: float, duration_s: float, pids: list[int]
) -> dict[str, Any]:
    chans = _channels(port, channels)
    try:
        stubs = [tuple(ch.unary_unary(m) for m in METHODS) for ch in chans]  # bytes in, bytes out
        for pair in stubs:
            await pair[HEARTBEAT](calls[0][1] if calls[0][0] == HEARTBEAT else calls[1][1], timeout=10)
        n = len(calls)
        cursor = 0
        clock = time.perf_counter
        t_start = clock() + warmup_s
        t_end = t_start + duration_s
        latencies: list[float] = []
        counts = [0, 0]
        answers = [b"", b""]

        async def run(pair: tuple[Any, ...]) -> None:
            nonlocal cursor
            while (t := clock()) < t_end:
                kind, wire = calls[cursor % n]
                cursor += 1
                answers[kind] = await pair[kind](wire, timeout=10)
                if t >= t_start:  # started inside the window
                    latencies.append(clock() - t)
                    counts[kind] += 1

        async def window() -> tuple[float, float, float, float]:
            await asyncio.sleep(max(0.0, t_start - clock()))
            t0, c0, s0, m0 = clock(), own_cpu_s(), tree_cpu_s(pids), machine_busy_s()
            await asyncio.sleep(max(0.0, t_end - clock()))
            return clock() - t0, own_cpu_s() - c0, tree_cpu_s(pids) - s0, machine_busy_s() - m0

        timing = asyncio.create_task(window())
        await asyncio.gather(*(run(pair) for pair in stubs))
        elapsed = clock() - t_start
        window_s, client_cpu, server_cpu, machine_cpu = await timing
        s_before = tree_cpu_s(pids)
        drain_s = await _drain(pids)
        drain_cpu = tree_cpu_s(pids) - s_before
    finally:
        for ch in chans:
            await ch.close()
    _check(answers)
    calls_done = sum(counts)
    latencies.sort()
    rps = calls_done / elapsed
    return {
        "rpc_per_s": rps,
        "calls": calls_done,
        "issued": cursor,
        "acks": counts[ACK],
        "p50_ms": _pct(latencies, 0.5) * 1000,
        "p99_ms": _pct(latencies, 0.99) * 1000,
        "server_cpu": server_cpu / window_s,
        "server_cpu_us_per_rpc": server_cpu / window_s / rps * 1e6,
        "client_cpu": client_cpu / window_s,
        # the rest of the machine: anything but this load generator and the server disturbs the numbers
        "other_cpu": max(0.0, machine_cpu - client_cpu - server_cpu) / window_s,
        "drain_s": drain_s,
        "server_cpu_us_per_rpc_incl_drain": (server_cpu + drain_cpu) / calls_done * 1e6,
    }


async def _open(
    port: int,
    calls: list[tuple[int, bytes]],
    channels: int,
    rate: float,
    warmup_s: float,
    duration_s: float,
    seed: int,
    pids: list[int],
) -> dict[str, Any]:
    """Poisson arrivals at `rate`/s spread round-robin over the channels, each call its own task."""
    chans = _channels(port, channels)
    tasks: set[asyncio.Task[None]] = set()
    try:
        stubs = [tuple(ch.unary_unary(m) for m in METHODS) for ch in chans]
        for pair in stubs:
            await pair[HEARTBEAT](calls[0][1] if calls[0][0] == HEARTBEAT else calls[1][1], timeout=10)
        rng = random.Random(seed)
        n = len(calls)
        clock = time.perf_counter
        t_start = clock() + warmup_s
        t_end = t_start + duration_s
        latencies: list[float] = []
        lags: list[float] = []
        errors: Counter[str] = Counter()
        offered = skipped = 0

        async def one(stub: Any, wire: bytes, due: float) -> None:
            t0 = clock()
            try:
                await stub(wire, timeout=10)
            except grpc.RpcError as exc:
                errors[str(exc.code())] += 1
                return
            if due >= t_start:
                latencies.append(clock() - t0)
                lags.append(t0 - due)

        cpu: dict[str, float] = {}
        i = 0
        due = clock()
        while due < t_end:
            if not cpu and due >= t_start:
                cpu.update(t=clock(), client=own_cpu_s(), server=tree_cpu_s(pids), machine=machine_busy_s())
            now = clock()
            while due <= now and due < t_end:
                kind, wire = calls[i % n]
                stub = stubs[i % channels][kind]
                i += 1
                if due >= t_start:
                    offered += 1
                if len(tasks) >= MAX_OUTSTANDING:
                    skipped += due >= t_start
                else:
                    task = asyncio.create_task(one(stub, wire, due))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - clock()))
        if not cpu:  # a window too short for any arrival
            cpu.update(t=t_start, client=own_cpu_s(), server=tree_cpu_s(pids), machine=machine_busy_s())
        window_s = max(1e-6, clock() - cpu["t"])
        client_cpu, server_cpu = own_cpu_s() - cpu["client"], tree_cpu_s(pids) - cpu["server"]
        machine_cpu = machine_busy_s() - cpu["machine"]
        if tasks:
            await asyncio.wait(tasks, timeout=15)
    finally:
        for task in tasks:
            task.cancel()
        for ch in chans:
            await ch.close()
    latencies.sort()
    lags.sort()
    return {
        "offered_rpc_per_s": rate,
        "achieved_rpc_per_s": len(latencies) / duration_s,
        "calls": len(latencies),
        "issued": i,
        "skipped": skipped,
        "errors": dict(errors),
        "p50_ms": _pct(latencies, 0.5) * 1000,
        "p90_ms": _pct(latencies, 0.9) * 1000,
        "p99_ms": _pct(latencies, 0.99) * 1000,
        "max_ms": (latencies[-1] if latencies else float("nan")) * 1000,
        "send_lag_p99_ms": _pct(lags, 0.99) * 1000,
        "server_cpu": server_cpu / window_s,
        "server_cpu_us_per_rpc": server_cpu / max(1, offered) * 1e6,
        "client_cpu": client_cpu / window_s,
        "other_cpu": max(0.0, machine_cpu - client_cpu - server_cpu) / window_s,
    }


async def _prefill(port: int, wires: list[bytes], channels: int, depth: int, pids: list[int]) -> dict[str, Any]:
    """One heartbeat per VIN as fast as the server takes them (depth calls in flight per channel)."""
    chans = _channels(port, channels)
    try:
        stubs = [ch.unary_unary(METHODS[HEARTBEAT]) for ch in chans]
        cursor = 0
        t0 = time.perf_counter()

        async def run(stub: Any) -> None:
            nonlocal cursor
            while cursor < len(wires):
                wire = wires[cursor]
                cursor += 1
                await stub(wire, timeout=30)

        await asyncio.gather(*(run(stubs[i % channels]) for i in range(channels * depth)))
        sent_s = time.perf_counter() - t0
        await _drain(pids, timeout_s=60)
        return {"heartbeats": len(wires), "s": sent_s, "rpc_per_s": len(wires) / sent_s}
    finally:
        for ch in chans:
            await ch.close()


async def _store_rows(port: int, admin_port: int, batches: list[bytes]) -> int:
    """Store the rows the acks will delete (one batch per request number); returns the row count."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        publish = ch.unary_unary(METHODS[HEARTBEAT])
        for wire in batches:
            await publish(wire, timeout=30)
        return await pending_rows(admin_port)


async def pending_rows(admin_port: int) -> int:
    """Rows waiting in the server's store (Admin GetStats)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admin_port}") as ch:
        stub = ch.unary_unary("/sdv.fanout.v1.Admin/GetStats")
        reply = admin_pb2.Stats.FromString(await stub(admin_pb2.GetStatsRequest().SerializeToString(), timeout=30))
        return int(reply.rows)


async def _online_vehicles(admin_port: int) -> int:
    """The Admin API's count of VINs with a live session (of the process that takes this call)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admin_port}") as ch:
        stub = ch.unary_unary("/sdv.fanout.v1.Admin/GetStats")
        reply = admin_pb2.Stats.FromString(await stub(admin_pb2.GetStatsRequest().SerializeToString(), timeout=30))
        return int(reply.online_vehicles)


def closed(server: Server, work: Work, args: argparse.Namespace, duration_s: float) -> dict[str, Any]:
    calls = work.resume(server.name)
    out = asyncio.run(_closed(server.port, calls, args.clients, args.warmup, duration_s, server.pids()))
    work.advance(server.name, out["issued"])
    return out


def open_loop(server: Server, work: Work, args: argparse.Namespace, rate: float, seed: int) -> dict[str, Any]:
    calls = work.resume(server.name)
    out = asyncio.run(_open(server.port, calls, args.clients, rate, args.warmup, args.duration, seed, server.pids()))
    work.advance(server.name, out["issued"])
    return out


def prefill(server: OursServer, work: Work, args: argparse.Namespace) -> dict[str, Any]:
    out = asyncio.run(_prefill(server.port, work.heartbeats, args.clients, 8, server.pids()))
    out["online_vehicles"] = asyncio.run(_online_vehicles(server.admin_port))
    out["rows"] = asyncio.run(_store_rows(server.port, server.admin_port, work.batches))
    if out["rows"] != work.ack_rows:
        raise RuntimeError(f"prefill stored {out['rows']} rows, expected {work.ack_rows}")
    out["rss_bytes"] = tree_rss_bytes(server.pids())
    return out


# -- summary and report ---------------------------------------------------------------------------


def mmm(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _row(label: str, values: Sequence[float], fmt: str) -> str:
    return (
        f"| {label} | "
        + " | ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))
        + " |"
    )


def summarise(rounds: list[dict[str, Any]], scale: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in TARGETS:
        for key in (
            "rpc_per_s",
            "server_cpu_us_per_rpc",
            "server_cpu",
            "client_cpu",
            "other_cpu",
            "p50_ms",
            "p99_ms",
            "drain_s",
        ):
            out[f"{t}_{key}"] = mmm([r["closed"][t][key] for r in rounds])
    out["ratio_ours_over_noop"] = mmm([r["ratio_ours_over_noop"] for r in rounds])
    out["ratio_ours_over_example"] = mmm([r["ratio_ours_over_example"] for r in rounds])
    half: dict[str, Any] = {"offered_rpc_per_s": mmm([r["half_rate"] for r in rounds])}
    for t in ("ours", "noop"):
        for key in ("achieved_rpc_per_s", "p50_ms", "p99_ms", "send_lag_p99_ms", "server_cpu_us_per_rpc", "other_cpu"):
            half[f"{t}_{key}"] = mmm([r["open"][t][key] for r in rounds])
    out["half_load"] = half
    if scale:
        levels = scale["levels"]
        lv: list[dict[str, Any]] = []
        for i, n in enumerate(levels):
            rs = [r[str(n)] for r in scale["rounds"]]
            lv.append(
                {
                    "vins": n,
                    "factor": n / levels[0],
                    "rpc_per_s": mmm([x["rpc_per_s"] for x in rs]),
                    "server_cpu_us_per_rpc": mmm([x["server_cpu_us_per_rpc"] for x in rs]),
                    "server_cpu_us_per_rpc_incl_drain": mmm([x["server_cpu_us_per_rpc_incl_drain"] for x in rs]),
                    "cost_ratio_vs_first": mmm([r["cost_ratio"][i] for r in scale["rounds"]]),
                    "rps_ratio_vs_first": mmm([r["rps_ratio"][i] for r in scale["rounds"]]),
                    "online_vehicles": scale["prefill"][str(n)]["online_vehicles"],
                    "rss_bytes": scale["prefill"][str(n)]["rss_bytes"],
                }
            )
        out["scale"] = lv
    return out


def markdown(rounds: list[dict[str, Any]], scale: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    s = summarise(rounds, scale)
    names = {"ours": "ours", "noop": "no-op (aio)", "example": "EMQX example shape (sync, 10 threads)"}
    lines = [
        f"## Hook RPC path: heartbeat + ack, ours vs a no-op server vs the EMQX Python example shape "
        f"({meta['clients']} channels, {meta['vins']:,} VINs, {meta['ack_share']:.0%} acks, "
        f"{meta['rounds']} rounds)",
        "",
        f"Closed loop, one call in flight per channel, {meta['duration_s']:g} s measured after "
        f"{meta['warmup_s']:g} s of warm-up per server and round; server order alternating round by round.",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    for t in TARGETS:
        lines.append(_row(f"{names[t]} RPC/s", [r["closed"][t]["rpc_per_s"] for r in rounds], ",.0f"))
    lines.append(_row("**ratio ours / no-op** (paired)", [r["ratio_ours_over_noop"] for r in rounds], ".2f"))
    lines.append(_row("**ratio ours / EMQX example** (paired)", [r["ratio_ours_over_example"] for r in rounds], ".2f"))
    for t in TARGETS:
        lines.append(
            _row(f"{names[t]} server CPU µs/RPC", [r["closed"][t]["server_cpu_us_per_rpc"] for r in rounds], ".0f")
        )
    for t in TARGETS:
        lines.append(
            _row(f"{names[t]} server CPU (% of one core)", [100 * r["closed"][t]["server_cpu"] for r in rounds], ".0f")
        )
    for t in TARGETS:
        lines.append(_row(f"{names[t]} p99 ms (closed loop)", [r["closed"][t]["p99_ms"] for r in rounds], ".2f"))
    lines.append(
        _row(
            "ours: work left behind the answers (s until idle)", [r["closed"]["ours"]["drain_s"] for r in rounds], ".2f"
        )
    )
    lines.append(
        _row(
            "ours server CPU µs/RPC incl. that work",
            [r["closed"]["ours"]["server_cpu_us_per_rpc_incl_drain"] for r in rounds],
            ".0f",
        )
    )
    lines.append(
        _row("client CPU (% of one core), ours runs", [100 * r["closed"]["ours"]["client_cpu"] for r in rounds], ".0f")
    )
    lines.append(
        _row(
            "**other processes' CPU** (% of one core; should be ~0)",
            [100 * r["closed"][t]["other_cpu"] for r in rounds for t in TARGETS],
            ".0f",
        )
    )
    lines += [
        "",
        "### Latency at half load (open loop, Poisson arrivals at half of ours' closed-loop RPC/s of the round)",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        _row("offered RPC/s", [r["half_rate"] for r in rounds], ",.0f"),
    ]
    for t in ("ours", "noop"):
        o = [r["open"][t] for r in rounds]
        lines += [
            _row(f"{names[t]} achieved RPC/s", [x["achieved_rpc_per_s"] for x in o], ",.0f"),
            _row(f"{names[t]} p50 ms", [x["p50_ms"] for x in o], ".3f"),
            _row(f"**{names[t]} p99 ms**" if t == "ours" else f"{names[t]} p99 ms", [x["p99_ms"] for x in o], ".3f"),
            _row(f"{names[t]} server CPU µs/RPC", [x["server_cpu_us_per_rpc"] for x in o], ".0f"),
            _row(f"load generator send lag p99 ms, {t} runs", [x["send_lag_p99_ms"] for x in o], ".3f"),
            _row(f"other processes' CPU (% of one core), {t} runs", [100 * x["other_cpu"] for x in o], ".0f"),
        ]
    bad = sum(r["open"][t]["skipped"] + sum(r["open"][t]["errors"].values()) for r in rounds for t in ("ours", "noop"))
    lines += [
        "",
        "| round | order | ours RPC/s | no-op RPC/s | example RPC/s | ours/no-op | ours/example | half-load rate "
        "| ours p99 ms | no-op p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        c = r["closed"]
        lines.append(
            f"| {i} | {r['order']} | {c['ours']['rpc_per_s']:,.0f} | {c['noop']['rpc_per_s']:,.0f} "
            f"| {c['example']['rpc_per_s']:,.0f} | {r['ratio_ours_over_noop']:.2f} "
            f"| {r['ratio_ours_over_example']:.2f} "
            f"| {r['half_rate']:,.0f} | {r['open']['ours']['p99_ms']:.3f} | {r['open']['noop']['p99_ms']:.3f} |"
        )
    if scale:
        first = scale["levels"][0]
        lines += [
            "",
            f"### Scale: ours with more distinct VINs ({scale['rounds_n']} rounds, {scale['duration_s']:g} s each, "
            "order alternating; presence prefilled with one heartbeat per VIN)",
            "",
            f"| VINs | work | RPC/s (min / median / max) | server CPU µs/RPC (median) "
            f"| **cost ratio vs {first:,} VINs** (CPU/RPC, min / median / max) | RPC/s ratio (median) "
            "| online VINs | server RSS MiB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for lv in s["scale"]:
            r, c, rr = lv["rpc_per_s"], lv["cost_ratio_vs_first"], lv["rps_ratio_vs_first"]
            lines.append(
                f"| {lv['vins']:,} | {lv['factor']:g}x | {r['min']:,.0f} / {r['median']:,.0f} / {r['max']:,.0f} "
                f"| {lv['server_cpu_us_per_rpc']['median']:.0f} | {c['min']:.2f} / {c['median']:.2f} / {c['max']:.2f} "
                f"| {rr['median']:.2f} | {lv['online_vehicles']:,} | {lv['rss_bytes'] / 2**20:.0f} |"
            )
        pre = ", ".join(f"{int(n):,} in {p['s']:.1f} s ({p['rpc_per_s']:,.0f}/s)" for n, p in scale["prefill"].items())
        others = [100 * r[str(n)]["other_cpu"] for r in scale["rounds"] for n in scale["levels"]]
        lines += [
            "",
            f"Prefill (heartbeats, 8 in flight per channel): {pre}. Other processes' CPU during the scale "
            f"measurements: {min(others):.0f} / {statistics.median(others):.0f} / {max(others):.0f} % of one core "
            "(min / median / max).",
        ]
    procs = meta["processes"]
    setting = f"SDV_FANOUT_PROCESSES={procs}" if procs is not None else "processes setting left at its default"
    acked = meta.get("ack_rows") or {}
    if acked:
        cycled = acked["calls_issued_to_ours"] > acked["calls_before_repeating"]
        lines += [
            "",
            f"Acks are real: the prefill stored {acked['rows_stored']:,} rows with the acked payload and the "
            f"acks deleted {acked['rows_deleted_by_acks']:,} of them (each delete a group-committed write)"
            + (", but the calls cycled: later acks repeated earlier ones." if cycled else "; no ack repeated."),
        ]
    lines += [
        "",
        f"Ours: `sdv-fanout serve`, delivery and metrics off, {setting} ({meta['ours_processes']} server "
        "process(es)); its CPU counts the ready-file pid and its children. No-op: bench/noop_server.py --flavour "
        f"aio. EMQX example shape: bench/noop_server.py --flavour sync. Ack payload {meta['payload_bytes']} B. "
        f"{meta['cpus']} CPUs shared by the load generator and the servers (one loaded at a time); 1-min load "
        f"average {meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after; "
        f"{meta['wall_s']:.0f} s in all. Python {meta['python']}, grpcio {meta['grpc']}. Seed {meta['seed']}."
        + (f" **{bad} open-loop calls skipped or failed.**" if bad else ""),
    ]
    return "\n".join(lines)


# -- py-spy ---------------------------------------------------------------------------------------


def profile(server: OursServer, work: Work, args: argparse.Namespace, out: Path) -> str:
    """py-spy record (raw collapsed stacks) on ours under the closed-loop load; top functions as markdown."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    seconds = args.profile_seconds
    cmd = [str(spy), "record", "--rate", str(args.profile_rate), "--format", "raw", "--duration", str(int(seconds))]
    cmd += ["-o", str(out), "--pid", str(server.pid), "--subprocesses"]  # processes > 1: the pid only supervises
    # --nonblocking: read the stacks without pausing the server (not possible with --native)
    cmd.append("--native" if args.profile_native else "--nonblocking")
    if args.profile_gil:
        cmd.append("--gil")  # only the thread holding the GIL: Python CPU, not I/O waits
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)
        res = closed(server, work, args, seconds - 1.0 - args.warmup)
        spy_proc.wait(60)
    finally:
        if spy_proc.poll() is None:
            spy_proc.terminate()
            spy_proc.wait(10)
    log(f"profiled {res['rpc_per_s']:,.0f} RPC/s under py-spy (sampling slows the server)")
    if not out.exists():
        err = spy_proc.stderr.read().decode(errors="replace") if spy_proc.stderr else ""
        raise SystemExit(f"py-spy wrote nothing:\n{err}")
    return f"{res['rpc_per_s']:,.0f} RPC/s while sampled. " + top_functions(out.read_text(), args.profile_top)


_PY_FRAME = re.compile(r"^(?P<func>.+) \((?P<file>[^()]+\.py|<frozen [^>]+>):\d+\)$")
#: Leaf frames of a thread that waits rather than works (py-spy's own idle filter misses some).
_IDLE_LEAVES = (
    "epoll_wait",
    "poll (",
    "select (",
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "sem_wait",
    "sem_timedwait",
    "nanosleep",
    "EpollSelector.select",
)


def _py_name(frame: str) -> str | None:
    m = _PY_FRAME.match(frame)
    return f"{m['file']}:{m['func']}" if m else None


def top_functions(raw: str, top: int) -> str:
    """From py-spy's collapsed stacks: per Python function, the samples whose innermost Python frame
    it is (native callees such as sendmsg or an LMDB call count for their Python caller) and the
    samples it is anywhere on the stack of; with --native also the native leaf functions."""
    py_self: Counter[str] = Counter()
    py_incl: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames or any(m in frames[-1] for m in _IDLE_LEAVES):
            continue
        count = int(n)
        total += count
        leaves[re.sub(r"0x[0-9a-f]+", "?", frames[-1])] += count
        names = [x for x in map(_py_name, frames) if x]
        if names:
            py_self[names[-1]] += count
            for name in set(names):
                py_incl[name] += count
    if not total:
        return "(no busy samples)"
    lines = [
        f"Busy samples: {total:,} (threads waiting in epoll/poll/condition variables left out).",
        "",
        "| # | innermost Python function (file:function) | share of busy samples | inclusive |",
        "|---:|---|---:|---:|",
    ]
    for i, (f, c) in enumerate(py_self.most_common(top), 1):
        lines.append(f"| {i} | `{f}` | {100 * c / total:.1f} % | {100 * py_incl[f] / total:.1f} % |")
    entry = ("exhook_server/cli.py:", "exhook_server/procs.py:", "exhook_server/server.py:serve")
    ours = [(f, c) for f, c in py_incl.most_common() if f.startswith(("exhook_server/", "storage/"))]
    ours = [(f, c) for f, c in ours if not f.startswith(entry)]  # the entry points hold every sample
    lines += [
        "",
        "| # | project function (exhook_server/, storage/), inclusive | inclusive | self |",
        "|---:|---|---:|---:|",
    ]
    for i, (f, c) in enumerate(ours[:top], 1):
        lines.append(f"| {i} | `{f}` | {100 * c / total:.1f} % | {100 * py_self[f] / total:.1f} % |")
    if any(".so" in k for k in leaves):  # --native
        lines += ["", "| # | leaf frame (native or Python) | share |", "|---:|---|---:|"]
        for i, (f, c) in enumerate(leaves.most_common(top), 1):
            lines.append(f"| {i} | `{f}` | {100 * c / total:.1f} % |")
    return "\n".join(lines)


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
            log(f"starting servers; {args.vins:,} VINs")
            ours = start(lambda: OursServer("ours", tmp, args.processes))
            refs: dict[str, Server] = {
                "noop": start(lambda: Reference("noop", "aio", tmp)),
                "example": start(lambda: Reference("example", "sync", tmp)),
            }
            targets: dict[str, Server] = {"ours": ours, **refs}
            ours_processes = ours.processes
            pre = prefill(ours, work, args)
            log(f"prefill: {pre['heartbeats']:,} heartbeats in {pre['s']:.1f} s, {pre['online_vehicles']:,} online")
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
                log(
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
            log(f"acks deleted {deleted['rows_deleted_by_acks']:,} of {pre['rows']:,} stored rows")
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
        log(
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


def group_markdown(group: dict[str, Any]) -> str:
    s, n = group["summary"], group["processes"]

    def row(label: str, key: str, scale: float = 1.0, fmt: str = ",.0f") -> str:
        v = s[key]
        return f"| {label} | " + " | ".join(format(v[k] * scale, fmt) for k in ("min", "median", "max")) + " |"

    return "\n".join(
        [
            "",
            f"### One server process vs {n} (one per CPU), same load, {len(group['rounds'])} paired rounds",
            "",
            "| metric | min | median | max |",
            "|---|---:|---:|---:|",
            row("1 process RPC/s", "one_rpc_per_s"),
            row(f"{n} processes RPC/s", "group_rpc_per_s"),
            row(f"**ratio {n} processes / 1** (paired)", "ratio_group_over_one", fmt=".2f"),
            row(
                f"capacity with {n} cores to itself, {n} processes / 1 (estimate: {n} x 1-process CPU/RPC "
                f"over {n}-process CPU/RPC)",
                "capacity_estimate_group_over_one",
                fmt=".2f",
            ),
            row("1 process: server CPU (% of one core)", "one_server_cpu", 100),
            row(f"{n} processes: server CPU (% of one core)", "group_server_cpu", 100),
            row("1 process: server CPU µs/RPC", "one_server_cpu_us_per_rpc"),
            row(f"{n} processes: server CPU µs/RPC", "group_server_cpu_us_per_rpc"),
            row("load generator CPU (% of one core), 1-process runs", "one_client_cpu", 100),
            row(f"load generator CPU (% of one core), {n}-process runs", "group_client_cpu", 100),
            "",
            f"The load generator shares the {n} CPUs with the server, so the group can use at most what the "
            "generator leaves over; the server CPU rows show how much each side got.",
        ]
    )


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
        log(f"scale {n:,} VINs: prefilled in {prefills[str(n)]['s']:.1f} s")
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
        log(
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
