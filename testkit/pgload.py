"""PostgreSQL bench plumbing: the run's throwaway cluster (`Db`), CPU per process group and per CPU
over a measurement (`Meter`), pinned client/server layouts, the server's database round trips from
its /metrics, serialised hook calls (heartbeats, subscribes, acks, batches) and the drivers that
send them (a closed-loop mix, an open-loop rate)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.harness import SubprocessServer
from testkit.pg_cluster import PgCluster
from testkit.plumbing import (
    CLK_TCK,
    descendants,
    group_cpu_s,
    machine_busy_s,
    own_cpu_s,
    pct,
)

HEARTBEAT, SUBSCRIBE, ACK = "heartbeat", "subscribe", "ack"
NODE = "emqx@127.0.0.1"
META = pb.RequestMeta(node=NODE, version="5.8.9", cluster_name="emqxcl")
SERVICE = "/emqx.exhook.v3.HookProvider/"
METHODS = {HEARTBEAT: "OnMessagePublish", SUBSCRIBE: "OnSessionSubscribed", ACK: "OnMessageAcked"}
DELIVERY_CLIENTID = "sdv-fanout-bench-1"  # starts with mqtt_clientid_prefix: its PUBACKs count as ours
LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel, as EMQX's pool


class Db:
    """The run's throwaway PostgreSQL: a database per measurement, CPU of its processes, statement
    statistics when asked for (pg_stat_statements, loaded at start)."""

    def __init__(self, statements: bool) -> None:
        settings = {"max_connections": "300"}
        if statements:
            settings["shared_preload_libraries"] = "'pg_stat_statements'"
        self.statements = statements
        self.cluster = PgCluster.create(name="pgserve", settings=settings)
        found = self.cluster.psql("SHOW fsync", "SHOW synchronous_commit", "SHOW server_version").split()
        if found[:2] != ["on", "on"]:
            raise SystemExit(f"the cluster must be durable (fsync, synchronous_commit): {found}")
        self.version = found[2]
        if statements:
            self.cluster.psql("CREATE EXTENSION pg_stat_statements")

    def database(self, name: str) -> str:
        """A fresh empty database owned by the product's role; its DSN."""
        return str(self.cluster.new_database(name))

    def pids(self) -> list[int]:
        return descendants(self.cluster.pid)

    def checkpoint(self) -> None:
        """No checkpoint's writes inside the next measurement."""
        self.cluster.psql("CHECKPOINT")

    def reset_statements(self) -> None:
        if self.statements:
            self.cluster.psql("SELECT pg_stat_statements_reset()")

    def top_statements(self, n: int = 12) -> list[dict[str, Any]]:
        """The statements that took the most execution time since the last reset (every database)."""
        if not self.statements:
            return []
        out = self.cluster.psql(
            "SELECT d.datname, s.calls, round(s.total_exec_time::numeric, 1), round(s.mean_exec_time::numeric, 3),"
            " s.rows, regexp_replace(left(s.query, 160), '\\s+', ' ', 'g')"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            f" ORDER BY s.total_exec_time DESC LIMIT {n}"
        )
        rows = []
        for line in out.splitlines():
            db, calls, total, mean, nrows, query = line.split("|", 5)
            rows.append(
                {
                    "db": db,
                    "calls": int(calls),
                    "total_ms": float(total),
                    "mean_ms": float(mean),
                    "rows": int(nrows),
                    "query": query,
                }
            )
        return rows

    def stop(self) -> None:
        self.cluster.stop()


def cpu_by_pid(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds of each process (all its threads, schedstat: ns resolution)."""
    return {pid: group_cpu_s([pid]) for pid in pids}


def cpu_busy_s() -> dict[int, float]:
    """CPU seconds each CPU spent busy (not idle or iowait) since boot, from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                v = [int(x) for x in fields[:8]]
                out[int(name[3:])] = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK
    return out


class Meter:
    """CPU over one measurement: the sdv-fanout server processes, PostgreSQL's processes (those that
    start meanwhile count from zero, as new backends do), this process (the load generator or the
    raw loop), the rest of the machine, and how busy each CPU was while the load ran (`cpu_busy`,
    share of each CPU from the start until `loaded()`, else until `read()`)."""

    def __init__(self, server_pids: Sequence[int], db: Db) -> None:
        self.server_pids, self.db = list(server_pids), db
        self.t0 = time.monotonic()
        self.server0 = cpu_by_pid(self.server_pids)
        self.pg0 = cpu_by_pid(db.pids())
        self.own0 = own_cpu_s()
        self.machine0 = machine_busy_s()
        self.cpus0 = cpu_busy_s()
        self.busy: dict[str, float] = {}

    def loaded(self) -> None:
        """The load is over (what follows is the work behind its answers): how busy each CPU was."""
        wall = time.monotonic() - self.t0
        # /proc/stat counts 10 ms ticks: a short window can read a little over the whole CPU.
        self.busy = {str(c): min(1.0, (b - self.cpus0.get(c, 0.0)) / wall) for c, b in cpu_busy_s().items()}

    def read(self) -> dict[str, Any]:
        if not self.busy:
            self.loaded()
        wall = time.monotonic() - self.t0
        server = sum(c - self.server0.get(p, 0.0) for p, c in cpu_by_pid(self.server_pids).items())
        pg = sum(c - self.pg0.get(p, 0.0) for p, c in cpu_by_pid(self.db.pids()).items())
        own = own_cpu_s() - self.own0
        machine = machine_busy_s() - self.machine0
        return {
            "wall_s": wall,
            "server_s": server,
            "pg_s": pg,
            "client_s": own,
            "other_share": max(0.0, machine - server - pg - own) / wall,
            "cpu_busy": self.busy,
        }


def _threads(pids: Sequence[int]) -> list[int]:
    """Every thread id of these processes; processes gone meanwhile are skipped."""
    tids: list[int] = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            tids += [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    return tids


def set_affinity(pids: Sequence[int], cpus: set[int]) -> None:
    """Every thread of these processes onto `cpus`. sched_setaffinity acts on one thread: a
    process's other threads (gRPC's, asyncio's executor) keep their own mask unless each is set;
    threads started later inherit their creator's. Processes or threads gone meanwhile are skipped."""
    for tid in _threads(pids):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)


def masks(pids: Sequence[int]) -> set[frozenset[int]]:
    """The distinct CPU masks of every thread of these processes."""
    out = set()
    for tid in _threads(pids):
        with contextlib.suppress(ProcessLookupError):
            out.add(frozenset(os.sched_getaffinity(tid)))
    return out


def pinned_cpus() -> tuple[int, int, str]:
    """(PostgreSQL's CPU, the client side's CPU, "") for the pinned layout: the first two CPUs this
    process may use; (-1, -1, why not) when it may use fewer than 2."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return -1, -1, f"skipped: this process may use {len(cpus)} CPU(s), the layout needs 2"
    return cpus[0], cpus[1], ""


class Pinned:
    """One cell of the pinned layout, as a context: PostgreSQL (the postmaster and every process it
    has now; the backends it forks later inherit its mask) on `db_cpu`, this process (every thread;
    the servers it starts inherit the mask, and see one CPU) and the `server()` processes on
    `client_cpu`. Leaving sets every one of them (and whatever PostgreSQL forked meanwhile) back to
    all the CPUs this process could use before."""

    def __init__(self, db: Db, db_cpu: int, client_cpu: int) -> None:
        self.db, self.db_cpu, self.client_cpu = db, db_cpu, client_cpu
        self.all_cpus = set(os.sched_getaffinity(0))
        self.server_pids: list[int] = []

    def __enter__(self) -> Pinned:
        set_affinity(self.db.pids(), {self.db_cpu})
        set_affinity([os.getpid()], {self.client_cpu})
        return self

    def server(self, pids: Sequence[int]) -> None:
        """The server's processes (parent and children) onto the client side's CPU."""
        self.server_pids += pids
        set_affinity(pids, {self.client_cpu})

    def check(self) -> dict[str, list[list[int]]]:
        """The masks now (after a measurement): raises unless every PostgreSQL process is on
        `db_cpu` alone and this process and the servers on `client_cpu` alone."""
        found = {
            "postgresql": masks(self.db.pids()),
            "client": masks([os.getpid(), *self.server_pids]),
        }
        want = {"postgresql": {frozenset({self.db_cpu})}, "client": {frozenset({self.client_cpu})}}
        if found != want:
            raise SystemExit(f"pinned layout: CPU masks {found}, expected {want}")
        return {k: [sorted(m) for m in v] for k, v in found.items()}

    def __exit__(self, *exc: object) -> None:
        try:
            set_affinity([os.getpid()], self.all_cpus)
        finally:
            try:
                set_affinity(self.db.pids(), self.all_cpus)
            finally:
                set_affinity(self.server_pids, self.all_cpus)


def start_server(tmp: Path, args: argparse.Namespace, env: dict[str, str]) -> SubprocessServer:
    """`sdv-fanout serve` on 127.0.0.1 with the run's log level; `env` adds settings (the store,
    the broker, the process count)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return SubprocessServer(tmp / "lmdb", "--log-level", args.log_level, env=env)


def scrape(server: SubprocessServer) -> dict[str, float]:
    """The server's counters that say what hooks cost the database (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("sdv_fanout_db_round_trips_total", "sdv_fanout_heartbeat")):
            name, value = line.rsplit(" ", 1)
            out[name.replace('sdv_fanout_db_round_trips_total{purpose="', "trips:").rstrip('"}')] = float(value)
    return out


PURPOSES = ("heartbeat_filter", "batch_filter", "event")


def trips(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two scrapes: database round trips by purpose and in all (`trips`), heartbeats and
    the events they caused."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out = {
        "heartbeats": d.get("sdv_fanout_heartbeats_total", 0.0),
        "heartbeat_events": d.get("sdv_fanout_heartbeat_events_total", 0.0),
    }
    for p in PURPOSES:
        out[p] = d.get(f"trips:{p}", 0.0)
    out["trips"] = sum(out[p] for p in PURPOSES)
    return out


def drain(server_pids: Sequence[int], db: Db, idle_cores: float = 0.1, timeout_s: float = 60.0) -> None:
    """Until the servers and PostgreSQL together use under `idle_cores` over two 0.1 s windows running:
    the work hooks left behind their answers is done."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        pids = [*server_pids, *db.pids()]
        c0, t0 = group_cpu_s(pids), time.monotonic()
        time.sleep(0.1)
        quiet = quiet + 1 if (group_cpu_s(pids) - c0) / (time.monotonic() - t0) < idle_cores else 0


def _message(topic: str, sender: str, payload: bytes, peerhost: str) -> pb.Message:
    msg = pb.Message(
        node=NODE,
        id="0006329D4B1C8F1E2B3C000000000001",
        qos=1,
        topic=topic,
        payload=payload,
        timestamp=1_700_000_000_000,
        headers={"protocol": "mqtt", "peerhost": peerhost},
    )
    setattr(msg, "from", sender)
    return msg


def _client(vin: str, i: int) -> pb.ClientInfo:
    """The vehicle's connection: one address each, as in a fleet."""
    return pb.ClientInfo(
        node=NODE,
        clientid=vin,
        username=vin,
        peerhost=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
        sockport=1883,
        protocol="mqtt",
        peerport=1024 + i % 60000,
    )


def heartbeat_wire(vin: str, i: int) -> bytes:
    """message.publish of `ecp/<VIN>/online` by the vehicle (config heartbeat_topics)."""
    peer = _client(vin, i).peerhost
    msg = _message(f"ecp/{vin}/online", vin, b'{"status":"online"}', peer)
    return bytes(pb.MessagePublishRequest(message=msg, meta=META).SerializeToString())


def subscribe_wire(vin: str, i: int) -> bytes:
    """session.subscribed of the vehicle's request topic (what a (re)connecting vehicle does)."""
    req = pb.SessionSubscribedRequest(
        clientinfo=_client(vin, i), topic=f"agent/{vin}/proxy/request/+", subopts=pb.SubOpts(qos=1), meta=META
    )
    return bytes(req.SerializeToString())


def ack_wire(vin: str, i: int, request_id: str, payload: bytes) -> bytes:
    """message.acked: the vehicle's PUBACK of our delivery of (VIN, request_id)."""
    msg = _message(f"agent/{vin}/proxy/request/{request_id}", DELIVERY_CLIENTID, payload, "127.0.0.1")
    return bytes(pb.MessageAckedRequest(clientinfo=_client(vin, i), message=msg, meta=META).SerializeToString())


def batch_wire(vins: Sequence[str], request_id: str, payload: bytes) -> bytes:
    doc = {"ids": list(vins), "request_id": request_id, "data": payload.decode()}
    msg = _message("$SDV-FANOUT", "sdv-platform", json.dumps(doc).encode(), "127.0.0.1")
    return bytes(pb.MessagePublishRequest(message=msg, meta=META).SerializeToString())


class Mix:
    """Pre-serialised hook calls of a fleet drawn in a fixed pseudo-random order: heartbeats and
    subscribes of random vehicles, acks of the stored rows in turn (each names a row once until
    they run out). `shares` = (subscribe, ack); the rest are heartbeats."""

    def __init__(self, vins: list[str], request_id: str, payload: bytes, shares: tuple[float, float], seed: int):
        self.heartbeats = [heartbeat_wire(v, i) for i, v in enumerate(vins)]
        self.subscribes = [subscribe_wire(v, i) for i, v in enumerate(vins)]
        order = random.Random(seed).sample(range(len(vins)), len(vins))
        self.acks = [ack_wire(vins[i], i, request_id, payload) for i in order]
        self.sub_share, self.ack_share = shares
        self._rng = random.Random(seed + 1)
        self.acks_issued = 0

    def draw(self) -> tuple[str, bytes]:
        x = self._rng.random()
        if x < self.ack_share:
            self.acks_issued += 1
            return ACK, self.acks[(self.acks_issued - 1) % len(self.acks)]
        if x < self.ack_share + self.sub_share:
            return SUBSCRIBE, self.subscribes[self._rng.randrange(len(self.subscribes))]
        return HEARTBEAT, self.heartbeats[self._rng.randrange(len(self.heartbeats))]


async def send_all(ports: Sequence[int], method: str, wires: Sequence[bytes], clients: int) -> None:
    """Every request once, `clients` at a time, spread over the ports (set-up, not measured)."""
    chans = [
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[k % len(ports)]}", options=LOCAL_POOL) for k in range(clients)
    ]
    try:
        todo = iter(wires)

        async def loop(ch: grpc.aio.Channel) -> None:
            stub = ch.unary_unary(SERVICE + method)
            for wire in todo:
                await stub(wire, timeout=30)

        await asyncio.gather(*(loop(ch) for ch in chans))
    finally:
        for ch in chans:
            await ch.close()


async def drive_mix(ports: Sequence[int], mix: Mix, clients: int, warmup_s: float, duration_s: float) -> dict[str, Any]:
    """Closed loop: `clients` calls in flight, each client sending its calls to the instances in
    turn (call i of client k to instance (k + i) mod n); calls/s over `duration_s` after `warmup_s`."""
    chans = [[grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=LOCAL_POOL) for p in ports] for _ in range(clients)]
    try:
        stubs = [[{k: ch.unary_unary(SERVICE + m) for k, m in METHODS.items()} for ch in row] for row in chans]
        for per_client in stubs:
            for stub in per_client:
                await stub[HEARTBEAT](mix.heartbeats[0], timeout=10)
        clock = time.perf_counter
        t_start = clock() + warmup_s
        t_end = t_start + duration_s
        counts: Counter[str] = Counter()
        latencies: list[float] = []
        issued = 0

        async def client(k: int) -> None:
            nonlocal issued
            for i in itertools.count(k):
                if (t := clock()) >= t_end:
                    return
                kind, wire = mix.draw()
                await stubs[k][i % len(ports)][kind](wire, timeout=10)
                issued += 1
                if t >= t_start:
                    counts[kind] += 1
                    latencies.append(clock() - t)

        await asyncio.gather(*(client(k) for k in range(clients)))
    finally:
        for row in chans:
            for ch in row:
                await ch.close()
    return {
        "calls_per_s": sum(counts.values()) / duration_s,
        "issued": issued,
        "by_kind": dict(counts),
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
    }


async def drive_rate(
    ports: Sequence[int],
    mix: Mix,
    clients: int,
    rate: float,
    warmup_s: float,
    duration_s: float,
    seed: int,
    start: Callable[[], None],
) -> dict[str, Any]:
    """Open loop: the mix at `rate` calls/s in all (Poisson arrivals, each call its own task), call
    i to instance i mod n over the channels in turn, at most `clients` x 4 calls in flight. An
    arrival that finds them all busy is not sent and counts as late: nothing queues, so what the
    instances see is the offered rate or less, never a catch-up burst. `start()` runs once every
    channel is open and has made a call, before the first arrival. Rates and latencies over
    `duration_s` after `warmup_s`."""
    n = len(ports)
    chans = [[grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=LOCAL_POOL) for p in ports] for _ in range(clients)]
    tasks: set[asyncio.Task[None]] = set()
    try:
        stubs = [[{k: ch.unary_unary(SERVICE + m) for k, m in METHODS.items()} for ch in row] for row in chans]
        for per_client in stubs:
            for stub in per_client:
                await stub[HEARTBEAT](mix.heartbeats[0], timeout=10)
        await asyncio.sleep(0.2)  # what the warm calls left behind (their heartbeat filter) first
        start()
        limit = clients * 4
        rng = random.Random(seed)
        clock = time.perf_counter
        t_start = clock() + warmup_s
        t_end = t_start + duration_s
        counts: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        latencies: list[float] = []
        lags: list[float] = []
        issued = late = offered = 0

        async def one(stub: Any, kind: str, wire: bytes, measured: bool) -> None:
            t0 = clock()
            try:
                await stub(wire, timeout=10)
            except grpc.RpcError as exc:
                errors[str(exc.code())] += 1
                return
            if measured:
                counts[kind] += 1
                latencies.append(clock() - t0)

        due = clock()
        while due < t_end:
            now = clock()
            while due <= now and due < t_end:
                measured = due >= t_start
                offered += measured
                if len(tasks) >= limit:
                    late += measured
                else:
                    kind, wire = mix.draw()
                    task = asyncio.create_task(
                        one(stubs[issued // n % clients][issued % n][kind], kind, wire, measured)
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    issued += 1
                    if measured:
                        lags.append(now - due)
                due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - clock()))
        if tasks:
            await asyncio.wait(tasks, timeout=15)
    finally:
        for task in tasks:
            task.cancel()
        for row in chans:
            for ch in row:
                await ch.close()
    if errors:
        raise SystemExit(f"instances at {rate:g} calls/s: calls failed {dict(errors)}")
    return {
        "offered_per_s": rate,
        "calls_per_s": sum(counts.values()) / duration_s,
        "issued": issued,
        "offered": offered,
        "late": late,
        "by_kind": dict(counts),
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "send_lag_p99_ms": pct(lags, 0.99) * 1000,
    }


async def pg_count(dsn: str, sql: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()
