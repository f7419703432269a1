"""End-to-end delivery: sdv-fanout + mosquitto + a real paho fleet, against raw paho QoS 1, same run.

One mosquitto 2 broker and one `sdv-fanout serve` subprocess (delivery to that
broker) live for the whole run. Fleets are helper processes (bench/e2e_fleet.py,
about 250 paho clients each):

* sim fleets: N vehicles of testkit/emqx_sim.py, connected and subscribed to
  `agent/<VIN>/proxy/request/+`; their driver calls our ExHook RPCs as EMQX would
  (presence hooks, then one `message.acked` per PUBACK);
* raw fleets: N plain paho subscribers on `refer/<VIN>/proxy/request/+`, PUBACK on
  arrival, plus a raw publisher process (one paho client, in-flight window 50 like
  our delivery client). Other topics and clientids, so neither side sees the other's
  traffic.

Measured, in R rounds (order alternating round by round):

1. ours: B batches, each naming all N VINs, through FakeEmqx.publish_batch
   (OnMessagePublish); time from the first publish to the store holding 0 rows,
   i.e. every delivery PUBACKed, its `message.acked` handled and its row deleted.
   → delivered+acked msgs/s = N x B / time.
2. raw (a): the publisher sends the same N x B QoS 1 messages (same payload size)
   batch-major, unconstrained; done when it has every PUBACK and every subscriber
   got every message. raw (b): one in flight per subscriber, as our rule: each
   subscriber PUBACKs and then publishes a QoS 0 ack signal; the publisher sends a
   VIN's next message only on its signal (the signal stands in for message.acked).
   ours/raw ratios are paired per round.
3. latency at about half load: batches paced at half of ours' median msgs/s; per
   (VIN, request) the time from publish_batch returning to the vehicle's paho
   on_message (time.time() in both processes, one machine clock).
4. RSS per online VIN: the server's VmRSS before the fleet connects vs with N
   vehicles subscribed; then a fresh server with delivery disabled (it still tracks
   presence) gets S synthetic OnSessionSubscribed RPCs (default 100,000 sessions,
   clientid = VIN, one peer address each), RSS delta / S. `--presence-only` runs just this.

The server may run several processes (SDV_FANOUT_PROCESSES, `--server-processes`):
its RSS and CPU are summed over the parent and its children. `--store-url` runs every
server on that PostgreSQL database instead of LMDB (pending rows are then counted there;
bench/pg_serve.py uses this rig on a throwaway cluster). CPU use of every
process is sampled per phase (/proc), to tell what limited the throughput.
Markdown tables to stdout, progress to stderr, --json for the numbers.

    .venv/bin/python -m bench.e2e [--vehicles 1000] [--batches 20] [--rounds 3] [--json F]
    .venv/bin/python -m bench.e2e --presence-only [--presence-sessions 1000000]
    .venv/bin/python -m bench.e2e --store-url postgresql://sdv@127.0.0.1:5432/sdv   # on PostgreSQL
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import paho.mqtt

from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb.store import Store
from testkit.emqx_sim import FakeEmqx, Mosquitto
from testkit.harness import ExHookClient, SubprocessServer
from testkit.plumbing import (
    Child,
    CpuMeter,
    arm_fleets,
    collect_fleets,
    cycle_stats,
    dec,
    descendants,
    machine_meta,
    make_vins,
    mib,
    num,
    pct,
    pending_rows,
    proc_cpu_s,
    quiesce,
    rss_bytes,
    share,
    stop_server,
)
from testkit.plumbing import min_med_max as _mmm

FLEET = [sys.executable, "-m", "bench.e2e_fleet"]
MAX_PER_PROC = 300  # paho's select() loop: about 330 clients per process
SUBSCRIBED = "/emqx.exhook.v3.HookProvider/OnSessionSubscribed"
#: Loopback only, and no clash with another server on the default metrics port.
SERVER_ENV = {"SDV_FANOUT_METRICS_LISTEN": "127.0.0.1:0"}


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The servers' environment: SERVER_ENV, and --server-processes and --store-url when given (else
    the defaults: one process per CPU, LMDB)."""
    env = dict(SERVER_ENV)
    if args.server_processes:
        env["SDV_FANOUT_PROCESSES"] = str(args.server_processes)
    if getattr(args, "store_url", ""):  # other scripts build their own args for this rig
        env["SDV_FANOUT_STORE_URL"] = args.store_url
    return env


class PgRows:
    """The rig's view of a PostgreSQL store: one connection on a private event loop, asked
    synchronously as the LMDB Store is."""

    def __init__(self, url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._conn = self._loop.run_until_complete(asyncpg.connect(url))

    def fetchval(self, sql: str, *args: Any) -> Any:
        return self._loop.run_until_complete(self._conn.fetchval(sql, *args))

    def rows(self) -> int:
        return int(self.fetchval("SELECT count(*) FROM rows"))

    def write_txns(self) -> int:
        """Transaction ids assigned so far (cluster-wide): one per transaction that wrote."""
        return int(self.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"))

    def pending(self, vin: str) -> list[str]:
        return list(
            self.fetchval(
                "SELECT coalesce(array_agg(request_id ORDER BY request_id), '{}') FROM rows WHERE vin = $1", vin
            )
        )

    def close(self) -> None:
        self._loop.run_until_complete(self._conn.close())
        self._loop.close()


class Rig:
    """Broker, server (delivery on), the bench's FakeEmqx (the platform's publishes), fleets."""

    def __init__(self, args: argparse.Namespace, tmp: Path, vins: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.tmp = tmp
        self.vins = vins
        #: More server settings (bench/status_cost.py: the status topic's).
        self.env = env or {}
        self.children: list[Child] = []
        self.broker = Mosquitto(tmp, verbose=False).start()  # no per-packet debug log
        self.server: SubprocessServer | None = None
        self.emqx: FakeEmqx | None = None
        self.store: Store | None = None
        #: The PostgreSQL store when args.store_url is set (then `store` stays None).
        self.pg: PgRows | None = None
        #: The database's processes, when they run on this machine: their CPU is a group of its own.
        self.db_pids: Callable[[], list[int]] | None = None
        #: With `stall_s` > 0: called when the pending rows have not gone down for that long while
        #: waiting for 0 (a caller's rescue, say the heartbeats vehicles would send); `stalls` counts them.
        self.stall_s = 0.0
        self.on_stall: Callable[[], None] | None = None
        self.stalls = 0
        self.sims: list[Child] = []
        self.raws: list[Child] = []
        self.pub: Child | None = None

    def start_server(self) -> None:
        env = {**server_env(self.args), "SDV_FANOUT_MQTT_URL": self.broker.url, **self.env}
        self.server = SubprocessServer(self.tmp / "lmdb", "--log-level", self.args.log_level, env=env)
        server = self.server
        #: The server's processes: the parent and, when it runs several, its children.
        self.server_pids = descendants(server.proc.pid)
        deadline = time.monotonic() + 30
        clientid = None
        while clientid is None:
            clientid = next((e["clientid"] for e in server.events() if e.get("event") == "mqtt_connected"), None)
            if clientid is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"delivery client did not connect:\n{server.log()[-3000:]}")
                time.sleep(0.05)  # bounded wait for the server's own log line
        self.delivery_clientid = clientid
        self.emqx = FakeEmqx(server.port, self.broker.port, delivery_clientid=clientid)
        self.emqx.load()
        if getattr(self.args, "store_url", ""):
            self.pg = PgRows(self.args.store_url)
        else:
            self.store = Store(self.tmp / "lmdb", readonly=True)

    def _spawn(self, role: str, k: int, vins: list[str], *extra: str) -> Child:
        argv = [*FLEET, "--role", role, "--mqtt-port", str(self.broker.port)]
        argv += ["--vins", ",".join(vins), "--timeout-s", str(self.args.deadline_s), *extra]
        child = Child(f"{role}{k}", argv, self.tmp / f"{role}{k}.log")
        self.children.append(child)
        return child

    def slices(self) -> list[list[str]]:
        return [self.vins[k :: self.args.procs] for k in range(self.args.procs)]

    def start_sims(self) -> None:
        assert self.server is not None
        extra = ["--exhook-port", str(self.server.port), "--delivery-clientid", self.delivery_clientid]
        self.sims = [self._spawn("sim", k, s, *extra) for k, s in enumerate(self.slices())]
        for c in self.sims:
            c.recv(self.args.deadline_s)  # {"ready": n}

    def start_raws(self) -> None:
        self.raws = [self._spawn("raw", k, s) for k, s in enumerate(self.slices())]
        self.pub = self._spawn("pub", 0, self.vins, "--max-inflight", str(self.args.max_inflight))
        for c in [*self.raws, self.pub]:
            c.recv(self.args.deadline_s)

    def rows(self) -> int:
        if self.pg is not None:
            return self.pg.rows()
        assert self.store is not None
        return pending_rows(self.store)

    def pending(self, vin: str) -> list[str]:
        if self.pg is not None:
            return self.pg.pending(vin)
        assert self.store is not None
        return [r.request_id for r in self.store.pending(vin)]

    def last_txnid(self) -> int:
        """LMDB's last committed write transaction: one per group commit (one fsync each); on
        PostgreSQL the transaction ids assigned (one per transaction that wrote)."""
        if self.pg is not None:
            return self.pg.write_txns()
        assert self.store is not None
        return int(self.store.env.info()["last_txnid"])

    def wait_rows_zero(self) -> float:
        deadline = time.monotonic() + self.args.deadline_s
        # A progress poll with a deadline: one LMDB stat is cheap; a count on PostgreSQL costs the
        # database CPU the measurement shares, so it is asked less often (25 ms: under 1 % of a run).
        poll_s = 0.025 if self.pg is not None else 0.005
        least, since = self.rows(), time.monotonic()
        while rows := self.rows():
            now = time.monotonic()
            if rows < least:
                least, since = rows, now
            elif self.stall_s and self.on_stall is not None and now - since >= self.stall_s:
                self.stalls += 1
                self.on_stall()
                since = now
            if now > deadline:
                stuck = [(v, self.pending(v)) for v in self.vins]
                stuck = [s for s in stuck if s[1]]
                raise RuntimeError(
                    f"{self.rows()} rows still pending after {self.args.deadline_s} s on {len(stuck)} VINs, "
                    f"e.g. {stuck[:3]}"
                )
            time.sleep(poll_s)
        return time.time()

    def cpu(self, sides: Sequence[str]) -> CpuMeter:
        assert self.server is not None and self.broker.proc is not None
        groups = {"server": self.server_pids, "mosquitto": [self.broker.proc.pid]}
        if self.db_pids is not None:
            groups["postgresql"] = self.db_pids()
        if "sim" in sides:
            groups["sim fleet"] = [c.proc.pid for c in self.sims]
        if "raw" in sides:
            assert self.pub is not None
            groups["raw fleet"] = [c.proc.pid for c in self.raws]
            groups["raw publisher"] = [self.pub.proc.pid]
        return CpuMeter(groups)

    def arm(self, fleets: list[Child], expect: int, **extra: Any) -> None:
        arm_fleets(fleets, expect, self.args.deadline_s, **extra)

    def collect(self, fleets: list[Child], expect_total: int) -> list[dict[str, Any]]:
        return collect_fleets(fleets, expect_total, self.args.deadline_s)

    def close(self) -> None:
        for c in self.children:
            c.stop()
        if self.emqx is not None:
            self.emqx.close(check=False)
        if self.store is not None:
            self.store.close()
        if self.pg is not None:
            self.pg.close()
        if self.server is not None:
            stop_server(self.server)
        self.broker.stop()


# -- phases -------------------------------------------------------------------------------------


def rpc_error(rig: Rig) -> str:
    """The last failed hook RPC of the bench's FakeEmqx (e.g. DEADLINE_EXCEEDED: EMQX's 5 s timeout)."""
    errors = rig.emqx.rpc_errors if rig.emqx is not None else []
    return f"{errors[-1][0]}: {errors[-1][1]!r}" if errors else "no answer"


class Probe:
    """A no-op hook RPC (OnMessagePublish on a topic we do not handle: IGNORE, no storage) every
    0.1 s on its own channel: how long any hook call waits in the server while deliveries run."""

    def __init__(self, port: int) -> None:
        self.client = ExHookClient(port)
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            t = time.perf_counter()
            try:
                self.client.publish("bench/probe", b"")
            except grpc.RpcError:
                continue
            self.times.append(time.perf_counter() - t)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(30)
        self.client.close()
        return self.times


def run_ours(rig: Rig, tag: str, payload_bytes: int, seed: int) -> dict[str, Any]:
    assert rig.emqx is not None
    n, b = len(rig.vins), rig.args.batches
    rng = random.Random(seed)
    rids = [f"task_{tag}_{k}" for k in range(b)]
    payloads = [rng.randbytes(payload_bytes) for _ in rids]
    rig.arm(rig.sims, b)
    txn0 = rig.last_txnid()
    assert rig.server is not None
    probe = Probe(rig.server.port)
    meter = rig.cpu(["sim"])
    calls = []
    t0 = time.time()
    for rid, payload in zip(rids, payloads, strict=True):
        t = time.perf_counter()
        resp = rig.emqx.publish_batch(rig.vins, rid, payload)
        calls.append(time.perf_counter() - t)
        if resp is None or resp.type != pb.ValuedResponse.STOP_AND_RETURN:
            raise RuntimeError(f"batch {rid} not stored: {resp or rpc_error(rig)}")
    published = time.time()
    try:
        end = rig.wait_rows_zero()
    finally:
        probes = probe.stop()
    cpu = meter.shares()
    commits = rig.last_txnid() - txn0
    done = rig.collect(rig.sims, n * b)
    seconds = end - t0
    return {
        "seconds": seconds,
        "msgs_per_s": n * b / seconds,
        "publish_s": published - t0,
        "publish_p50_ms": statistics.median(calls) * 1000,
        "publish_max_ms": max(calls) * 1000,
        "probe_p50_ms": pct(probes, 0.5) * 1000 if probes else 0.0,
        "probe_p99_ms": pct(probes, 0.99) * 1000 if probes else 0.0,
        "last_receive_s": max(d["last"] for d in done) - t0,
        **cycle_stats(done),
        "duplicates": sum(d["count"] - d["distinct"] for d in done),
        "hook_rpcs_per_s": (n * b + b) / seconds,  # one message.acked per delivery + the batches
        "commits_per_s": commits / seconds,
        "ops_per_commit": (n * b + b) / commits if commits else 0.0,  # row deletes + batch ingests
        "cpu": cpu,
        "cpu_us_per_msg": {g: v * seconds / (n * b) * 1e6 for g, v in cpu.items()},
    }


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


# -- report ---------------------------------------------------------------------------------------


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    series: dict[str, list[float]] = {
        "ours_msgs_per_s": [r["ours"]["msgs_per_s"] for r in rounds],
        "raw_a_msgs_per_s": [r["raw_a"]["msgs_per_s"] for r in rounds],
        "raw_b_msgs_per_s": [r["raw_b"]["msgs_per_s"] for r in rounds],
        "ratio_ours_over_raw_a": [r["ratio_a"] for r in rounds],
        "ratio_ours_over_raw_b": [r["ratio_b"] for r in rounds],
    }
    return {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in series.items()}


def markdown(rounds: list[dict[str, Any]], lat: dict[str, Any], rss: dict[str, Any], meta: dict[str, Any]) -> str:
    n, b = meta["vehicles"], meta["batches"]
    if meta.get("store_url"):
        commits = "PostgreSQL write transactions/s (xids assigned)"
    else:
        commits = "LMDB commits/s (group commits, 1 fsync each)"

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    def cpu(side: str, group: str) -> list[float]:
        return [r[side]["cpu"].get(group, 0.0) for r in rounds]

    lines = [
        f"### End to end: {n:,} vehicles x {b} batches = {n * b:,} QoS 1 deliveries per measurement, "
        f"{meta['rounds']} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f"| ours (batch → LMDB → MQTT → PUBACK → acked hook → row deleted) msgs/s | {_mmm(col('ours', 'msgs_per_s'), num)} |",  # noqa: E501
        f"| raw (a) paho QoS 1, unconstrained, msgs/s | {_mmm(col('raw_a', 'msgs_per_s'), num)} |",
        f"| raw (b) paho QoS 1, one in flight per subscriber, msgs/s | {_mmm(col('raw_b', 'msgs_per_s'), num)} |",
        f"| **ratio ours/raw (a)** (paired per round) | {_mmm([r['ratio_a'] for r in rounds], dec)} |",
        f"| **ratio ours/raw (b)** (paired per round) | {_mmm([r['ratio_b'] for r in rounds], dec)} |",
        f"| ours seconds (first publish → 0 rows) | {_mmm(col('ours', 'seconds'), dec)} |",
        f"| ours: the {b} publish_batch calls took s | {_mmm(col('ours', 'publish_s'), dec)} |",
        f"| ours: one publish_batch ({n:,} VINs) p50 ms | {_mmm(col('ours', 'publish_p50_ms'), dec)} |",
        f"| ours: one publish_batch max ms | {_mmm(col('ours', 'publish_max_ms'), dec)} |",
        f"| ours: a no-op hook RPC meanwhile (IGNOREd publish, every 0.1 s) p50 ms | "
        f"{_mmm(col('ours', 'probe_p50_ms'), dec)} |",
        f"| ours: no-op hook RPC p99 ms | {_mmm(col('ours', 'probe_p99_ms'), dec)} |",
        f"| ours: last vehicle receive at s | {_mmm(col('ours', 'last_receive_s'), dec)} |",
        f"| ours: per-vehicle cycle (receive → next receive) p50 ms | {_mmm(col('ours', 'cycle_p50_ms'), dec)} |",
        f"| ours: per-vehicle cycle p99 ms | {_mmm(col('ours', 'cycle_p99_ms'), dec)} |",
        f"| ours: fleet part (receive → PUBACK + acked RPC answered) p50 ms | "
        f"{_mmm(col('ours', 'fleet_p50_ms'), dec)} |",
        f"| ours: of which the message.acked RPC round trip p50 ms | {_mmm(col('ours', 'rpc_p50_ms'), dec)} |",
        f"| ours: server part (acked RPC answered → next receive) p50 ms | {_mmm(col('ours', 'turn_p50_ms'), dec)} |",
        f"| raw (b): per-vehicle cycle p50 ms | {_mmm(col('raw_b', 'cycle_p50_ms'), dec)} |",
        f"| ours hook RPCs/s handled (acked + batches) | {_mmm(col('ours', 'hook_rpcs_per_s'), num)} |",
        f"| ours {commits} | {_mmm(col('ours', 'commits_per_s'), num)} |",
        f"| ours write ops per commit (row deletes + batches) | {_mmm(col('ours', 'ops_per_commit'), dec)} |",
        "",
        "| round | order | ours msgs/s | raw (a) msgs/s | raw (b) msgs/s | ours/(a) | ours/(b) | ours s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {r['order']} | {r['ours']['msgs_per_s']:,.0f} | {r['raw_a']['msgs_per_s']:,.0f} | "
            f"{r['raw_b']['msgs_per_s']:,.0f} | {r['ratio_a']:.2f} | {r['ratio_b']:.2f} | "
            f"{r['ours']['seconds']:.2f} |"
        )

    def med(side: str, key: str, group: str) -> float:
        return float(statistics.median(r[side][key].get(group, 0.0) for r in rounds))

    lines += [
        "",
        "#### Where the CPU went (median over rounds): µs of CPU per delivered message, and share of one core",
        "",
        "| process | ours µs/msg | ours core | raw (a) µs/msg | raw (a) core | raw (b) µs/msg | raw (b) core |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, ours_group, raw_group in (
        ("sdv-fanout server / raw publisher", "server", "raw publisher"),
        ("mosquitto", "mosquitto", "mosquitto"),
        ("fleet: sim (vehicles + EMQX hook driver) / raw subscribers", "sim fleet", "raw fleet"),
        ("this bench process", "bench", "bench"),
        ("**all of the above**", "total", "total"),
        ("other processes on the machine (not this bench)", "other processes", "other processes"),
    ):
        cells = [f"{med('ours', 'cpu_us_per_msg', ours_group):,.0f}", share(med("ours", "cpu", ours_group))]
        for side in ("raw_a", "raw_b"):
            cells += [f"{med(side, 'cpu_us_per_msg', raw_group):,.0f}", share(med(side, "cpu", raw_group))]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines.append(
        f"| server's busiest thread | {med('ours', 'cpu_us_per_msg', 'server busiest thread'):,.0f} | "
        f"{share(med('ours', 'cpu', 'server busiest thread'))} | | | | |"
    )
    dups = sum(r[s]["duplicates"] for r in rounds for s in ("ours", "raw_a", "raw_b"))
    lines += [
        "",
        f"### Batch → vehicle latency at about half load: {lat['batches']} batches of {n:,} VINs, "
        f"one every {lat['interval_s']:.2f} s",
        "",
        "| metric | value |",
        "|---|---:|",
        f"| offered (half of ours' median) msgs/s | {lat['offered_msgs_per_s']:,.0f} |",
        f"| achieved (first publish → 0 rows) msgs/s | {lat['achieved_msgs_per_s']:,.0f} |",
        f"| samples (VIN, request) | {lat['samples']:,} |",
        f"| latency from publish_batch returning: p50 ms | {lat['p50_ms']:.1f} |",
        f"| p90 ms | {lat['p90_ms']:.1f} |",
        f"| p99 ms | {lat['p99_ms']:.1f} |",
        f"| max ms | {lat['max_ms']:.1f} |",
        f"| min ms (negative: received before the hook's answer was back) | {lat['min_ms']:.1f} |",
        f"| received before publish_batch returned | {lat['before_return']:,} |",
        f"| latency from publish_batch called: p50 / p99 ms | {lat['call_p50_ms']:.1f} / {lat['call_p99_ms']:.1f} |",
        f"| publish_batch call ({n:,} VINs, durable) p50 ms | {lat['publish_p50_ms']:.1f} |",
        f"| CPU server / mosquitto / sim fleet / other processes (of one core) | {share(lat['cpu']['server'])} / "
        f"{share(lat['cpu']['mosquitto'])} / {share(lat['cpu']['sim fleet'])} / "
        f"{share(lat['cpu']['other processes'])} |",
        "",
        rss_markdown(rss, meta),
        "",
        f"Duplicate deliveries over all rounds: {dups}. Payload {meta['payload_bytes']} B, mosquitto "
        f"max_inflight_messages 32, publisher window {meta['max_inflight']}, server workers = CPUs.",
    ]
    return "\n".join(lines)


def rss_markdown(rss: dict[str, Any], meta: dict[str, Any]) -> str:
    """The RSS-per-VIN table (RSS summed over the server's processes) and the run's conditions."""
    lines = [
        f"### Server RSS per online VIN ({meta['server_processes']} server process(es) after the parent; "
        "RSS summed over all)",
        "",
        "| measure | VINs | RSS before MiB | RSS after MiB | bytes per VIN |",
        "|---|---:|---:|---:|---:|",
    ]
    if "e2e_before" in rss:
        n = meta["vehicles"]
        lines.append(
            f"| e2e: {n:,} vehicles connected + subscribed (delivery on; includes fleet gRPC channels) | {n:,} | "
            f"{mib(rss['e2e_before'])} | {mib(rss['e2e_after'])} | {(rss['e2e_after'] - rss['e2e_before']) / n:,.0f} |"
        )
    pres = rss["presence"]
    for p in pres["points"]:
        lines.append(
            f"| synthetic OnSessionSubscribed, delivery off (after {pres['warm']:,} warm-up sessions) | "
            f"{p['sessions']:,} | {mib(pres['rss_base'])} | {mib(p['rss'])} | {p['bytes_per_vin']:,.0f} |"
        )
    lines += [
        "",
        f"Synthetic presence: {pres['rpc_per_s']:,.0f} OnSessionSubscribed RPC/s from {meta['presence_clients']} "
        f"channels, {pres['server_cpu_us_per_rpc']:.0f} µs server CPU per RPC. "
        f"{meta['cpus']} CPUs shared by broker, server, fleets and bench; 1-min load average "
        f"{meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after; {meta['wall_s']:.0f} s "
        f"wall. Seed {meta['seed']}.",
    ]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="sdv-fanout end-to-end delivery vs raw paho QoS 1 (same run).")
    p.add_argument("--vehicles", type=int, default=1000, help="online vehicles (default 1000)")
    p.add_argument("--batches", type=int, default=20, help="batches per measurement, each naming all (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds of ours / raw (a) / raw (b) (default 3)")
    p.add_argument("--procs", type=int, default=4, help="processes per fleet (default 4; <= 300 vehicles each)")
    p.add_argument("--latency-batches", type=int, default=0, help="paced batches for latency (default --batches)")
    p.add_argument("--presence-sessions", type=int, default=100_000, help="synthetic sessions (default 100000)")
    p.add_argument("--presence-clients", type=int, default=8, help="gRPC channels for the synthetic run")
    p.add_argument("--payload-bytes", type=int, default=256, help="delivered payload size (default 256)")
    p.add_argument("--max-inflight", type=int, default=50, help="raw publisher window (server default: 50)")
    p.add_argument("--deadline-s", type=float, default=180, help="give up on a phase after this (default 180)")
    p.add_argument("--seed", type=int, default=20240611)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level (default info, as in production)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--keep-tmp", action="store_true", help="keep the tmp dir (logs, LMDB) even after a successful run")
    p.add_argument("--presence-only", action="store_true", help="only the synthetic RSS-per-VIN measurement")
    p.add_argument("--levels", default="", help="also ours alone at these multiples of --level-batches, e.g. 1,10,100")
    p.add_argument("--level-batches", type=int, default=1, help="batches at level 1x (default 1)")
    p.add_argument("--server-processes", type=int, default=0,
                   help="SDV_FANOUT_PROCESSES for the servers (default: theirs, one per CPU)")  # fmt: skip
    p.add_argument("--store-url", default="",
                   help="run the servers on this PostgreSQL database (default: LMDB in a tmp dir)")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.vehicles, args.batches, args.rounds, args.procs, args.presence_sessions) < 1:
        p.error("--vehicles, --batches, --rounds, --procs and --presence-sessions must be positive")
    args.procs = max(args.procs, -(-args.vehicles // MAX_PER_PROC))
    latency_batches = args.latency_batches or args.batches

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks
    wall0 = time.monotonic()
    load_before = os.getloadavg()[0]
    vins = make_vins(args.seed, args.vehicles)
    tmp_root = Path(tempfile.mkdtemp(prefix="sdv-bench-e2e-"))
    rounds: list[dict[str, Any]] = []
    completed = False  # a failed run keeps its tmp dir for the post-mortem

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - wall0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    rss: dict[str, Any] = {}
    lat: dict[str, Any] = {}
    levels: list[dict[str, Any]] = []
    try:
        if not args.presence_only:
            rss, lat = run_e2e(args, tmp_root, vins, rounds, latency_batches, say, levels)
        (tmp_root / "presence").mkdir()
        warm = min(1000, args.presence_sessions)
        say(f"synthetic presence: {args.presence_sessions:,} OnSessionSubscribed on a server without delivery")
        rss["presence"] = run_presence(
            tmp_root / "presence", args.presence_sessions, warm, args.presence_clients, args.log_level, server_env(args)
        )
        say(f"presence: {rss['presence']['bytes_per_vin']:,.0f} bytes per VIN")
        completed = True
    finally:
        if args.keep_tmp or not completed:
            print(f"kept {tmp_root} (server, broker and fleet logs, LMDB)", file=sys.stderr)
        else:
            shutil.rmtree(tmp_root, ignore_errors=True)

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
        **machine_meta(load_before, wall0),
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


def levels_markdown(levels: list[dict[str, Any]], vehicles: int) -> str:
    lines = [
        "",
        f"### Ours alone at growing work ({vehicles:,} vehicles; medians of 5 runs at 1x, 2 at 10x, 1 at 100x)",
        "",
        "| level | messages | msgs/s | server CPU µs/msg | **server cost vs 1x** | all processes µs/msg | other CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        lines.append(
            f"| {lv['level']}x | {lv['messages']:,} | {lv['msgs_per_s']:,.0f} | {lv['server_us_per_msg']:,.0f} | "
            f"{lv['server_cost_vs_first']:.2f} | {lv['total_us_per_msg']:,.0f} | {lv['other_processes']:.0%} |"
        )
    return "\n".join(lines)


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
