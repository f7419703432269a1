"""Heartbeat and ack hook load for the benches: the servers under test (ours, a reference), the
work (serialised OnMessagePublish heartbeats and OnMessageAcked acks over a VIN set), a closed-loop
and an open-loop (Poisson arrivals) driver over C gRPC channels, the prefill that makes the VINs
known, and a py-spy profile of the server under load."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc

from exhook_server._proto import admin_pb2
from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.harness import ROOT
from testkit.noop_server import NoopServer, wait_ready
from testkit.plumbing import (
    descendants,
    machine_busy_s,
    make_vins,
    own_cpu_s,
    pct,
    rss_bytes,
    run_ns,
    say,
    tree_cpu_s,
)

HEARTBEAT, ACK = 0, 1
SERVICE = "/emqx.exhook.v3.HookProvider/"
METHODS = (SERVICE + "OnMessagePublish", SERVICE + "OnMessageAcked")  # index = kind
KINDS = ("heartbeat", "ack")
DELIVERY_CLIENTID = "sdv-fanout-bench-1"  # starts with mqtt_clientid_prefix: acks count as ours
_VIN_SLOT = "~" * 17  # placeholders in the templates; same length as what replaces them
_TASK_SLOT = "^" * 6
MAX_OUTSTANDING = 5000  # open loop: calls in flight before arrivals are counted as skipped
META = pb.RequestMeta(node="emqx@127.0.0.1", version="5.8.9", cluster_name="emqxcl")


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
    """A testkit/noop_server.py flavour (grpc_flavour.NoopServer) with the same interface as OursServer."""

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


#: Fewest rows stored for the acks, so that a small fleet's run does not run out of rows to ack.
MIN_ACK_ROWS = 6_000


def make_work(n_vins: int, seed: int, ack_share: float, payload_bytes: int, rows_per_vin: int = 4) -> Work:
    rng = random.Random(seed)
    vins = make_vins(seed, n_vins)
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


def _channels(port: int, n: int) -> list[grpc.aio.Channel]:
    # A local subchannel pool: one TCP connection per channel, as EMQX's pool has (else gRPC shares one).
    opts = [("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(n)]


async def _drain(pids: list[int], timeout_s: float = 10.0, step_s: float = 0.05, idle: float = 0.1) -> float:
    """Seconds until the server used under `idle` of a core over `step_s`: the work left behind the answers."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        a, ta = run_ns(pids), time.perf_counter()
        await asyncio.sleep(step_s)
        if (run_ns(pids) - a) / 1e9 / (time.perf_counter() - ta) < idle:
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
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
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
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p90_ms": pct(latencies, 0.9) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "max_ms": (latencies[-1] if latencies else float("nan")) * 1000,
        "send_lag_p99_ms": pct(lags, 0.99) * 1000,
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
    out["rss_bytes"] = rss_bytes(server.pids())
    return out


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
    say(f"profiled {res['rpc_per_s']:,.0f} RPC/s under py-spy (sampling slows the server)")
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
