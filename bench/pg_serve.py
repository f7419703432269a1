"""`sdv-fanout serve` on PostgreSQL (issue 14's closing numbers), side by side in one run.

Four parts on one throwaway cluster (testkit/pg_cluster.py: 127.0.0.1, fsync and synchronous_commit
on, run as an unprivileged user), each in paired rounds whose order changes round by round
(`--rounds` 3; the ingest part `--ingest-rounds` 5):

1. ingest: VIN-rows/s of bench/ingest.py's 200-VIN OnMessagePublish batches from `--ingest-clients`
   (32) channels into a real `serve --store-url` (a fresh database per run), against a raw asyncpg
   loop writing the same rows into the same schema (the blob once + one row per VIN, one
   transaction per batch, as many connections) and against the same server on LMDB. 32 is the
   EMQX `pool_size` the PostgreSQL mode is run with (docs/operations.md): a hook call waits for a
   commit, so it takes more calls in flight than EMQX's default 8 to keep a database busy. Server
   and PostgreSQL CPU per row. A fourth side (unless `--no-unbounded`), the PostgreSQL server with
   `max_pending_per_vehicle = 0` (no backlog bound, a setting an operator may choose, not the
   default), shows what the bound's sampled per-VIN counts cost, which the raw loop does not do;
   the bounded side stays the product's number.
   In two layouts (`--layouts`), their 8 cells rotating together round by round:
   - shared: the server, PostgreSQL and the load generator all share every core, as they fall.
     On the 2-core VM that compares (server + PostgreSQL + load generator) with (PostgreSQL + a
     tiny raw client) for the same two cores: the oversubscription, more than our code, sets it.
   - pinned, "PostgreSQL on its own core": in production PostgreSQL has a machine of its own. The
     postmaster and every process it has (new backends inherit its mask) run on CPU 0 alone; the
     client side on CPU 1: the server (it starts with that one CPU visible, so one process unless
     --server-processes) with this load generator (every thread), or the raw loop alone. On LMDB
     the server and load generator get CPU 1, CPU 0 is left idle: a one-core server. Every mask
     is checked after the measurement and set back to all CPUs after each cell. Skipped (with a
     note) on a machine with fewer than 2 CPUs.
2. instances: hook calls/s and CPU per call with 1, 2 and 3 `serve` instances (one process each,
   own port) on one database, a mix of heartbeats, subscribes and acks that the driver spreads
   call by call over them, two ways:
   - closed loop, 8 calls in flight: saturation. On 2 shared cores more processes then mostly add
     scheduler overhead to each call, so CPU per call there mixes our cost with the machine's.
   - fixed rate (`--inst-rate`, open loop, Poisson arrivals): the same mix offered at a rate under
     saturation, at most `--clients` x 4 calls in flight (an arrival that finds them all busy is
     not sent, and counted late; nothing queues). CPU per call measured there is a cost, free of
     the saturated machine's scheduling; what still grows with n is each instance's: it gets
     1/n of the calls, so fewer of them share each wake-up and each batched statement.
   - equal load per instance (`--inst-rate-per-instance` R, the same open loop at n x R calls/s in
     all): scaling out, each instance added carrying its share of a growing fleet, on cores of its
     own in production. Flat CPU per call here is what "throughput scales with cores" means; the
     total (3 x 400 = 1,200 calls/s by default) stays under the 2-core VM's saturation.
3. heartbeats: database round trips per heartbeat (the server's own counters) at steady rates,
   for vehicles with nothing pending and for vehicles with a delivery out and more queued, per
   `heartbeat_window_ms`.
4. e2e: deliveries/s through bench/e2e.py's rig (mosquitto, sim fleet calling our hooks as EMQX
   would), one rig on PostgreSQL and one on LMDB.

    .venv/bin/python -m bench.pg_serve [--rounds 3 --only ingest,instances,heartbeat,e2e --json F]
    .venv/bin/python -m bench.pg_serve --layouts shared --inst-rate 0 --inst-rate-per-instance 0  # closed loops only
    .venv/bin/python -m bench.pg_serve --quick          # about a minute
    .venv/bin/python -m bench.pg_serve --statements     # + each part's busiest statements

Markdown to stdout, progress to stderr. About 7 minutes with the defaults on the 2-core VM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from bench import e2e
from bench.hooks import _open as open_loop
from bench.ingest import Batch, _batch, _drive, _vin, group_cpu_s, make_workload, own_cpu_s
from exhook_server._proto import exhook_v3_pb2 as pb
from exhook_server.config import Config
from storage.lmdb.store import Store
from storage.postgres import migrate
from testkit.emqx_sim import Mosquitto
from testkit.harness import ExHookClient, SubprocessServer
from testkit.pg_cluster import PgCluster
from testkit.plumbing import (
    CLK_TCK,
    dec,
    descendants,
    machine_busy_s,
    machine_meta,
    make_vins,
    min_med_max,
    num,
    pct,
    quiesce,
    share,
    stop_server,
)

BATCH_VINS = 200
NODE = "emqx@127.0.0.1"
META = pb.RequestMeta(node=NODE, version="5.8.9", cluster_name="emqxcl")
SERVICE = "/emqx.exhook.v3.HookProvider/"
HEARTBEAT, SUBSCRIBE, ACK = "heartbeat", "subscribe", "ack"
METHODS = {HEARTBEAT: "OnMessagePublish", SUBSCRIBE: "OnSessionSubscribed", ACK: "OnMessageAcked"}
DELIVERY_CLIENTID = "sdv-fanout-bench-1"  # starts with mqtt_clientid_prefix: its PUBACKs count as ours
#: No vehicle of these rigs PUBACKs a delivery the server sends (nobody subscribes on the broker):
#: an hour of in-flight timeout keeps re-sends out of the measurements.
QUIET_INFLIGHT_S = "3600"
LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel, as EMQX's pool
RAW_BLOB = (
    "INSERT INTO blobs (sha1, data, created_ms, touched_ms) VALUES ($1, $2, $3, $3) ON CONFLICT (sha1) DO NOTHING"
)
RAW_ROWS = """
INSERT INTO rows (vin, request_id, ts_ms, sha1, size)
SELECT v, $2::text, $3::int8, $4::bytea, $5::int4 FROM unnest($1::text[]) AS v
ON CONFLICT (vin, request_id) DO UPDATE SET ts_ms = EXCLUDED.ts_ms, sha1 = EXCLUDED.sha1, size = EXCLUDED.size
"""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rotated(sides: Sequence[Any], r: int) -> list[Any]:
    """Round r's order: the sides rotated by r, reversed every other round."""
    k = r % len(sides)
    order = list(sides[k:]) + list(sides[:k])
    return order[::-1] if r % 2 else order


def mmm(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# -- the cluster and CPU ------------------------------------------------------------------------


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


# -- the pinned layout: PostgreSQL on a core of its own -----------------------------------------


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


# -- 1. ingest ----------------------------------------------------------------------------------

INGEST_SIDES = ("pg", "pg_unbounded", "raw", "lmdb")
#: The server sides on PostgreSQL, each with the settings it adds to the server's environment:
#: "pg" as deployed (the default backlog bound, max_pending_per_vehicle 1000), "pg_unbounded"
#: without the bound (0 = none), to show the backlog counts' price beside the raw loop.
PG_SIDES: dict[str, dict[str, str]] = {"pg": {}, "pg_unbounded": {"SDV_FANOUT_MAX_PENDING_PER_VEHICLE": "0"}}


def ingest_sides(args: argparse.Namespace) -> list[str]:
    """The ingest sides this run measures: all, or all but "pg_unbounded" with --no-unbounded."""
    return [s for s in INGEST_SIDES if not (s == "pg_unbounded" and args.no_unbounded)]


def sides_of(res: dict[str, Any]) -> list[str]:
    """The ingest sides a round's results (one layout's) hold, in INGEST_SIDES order."""
    return [s for s in INGEST_SIDES if s in res]


def ingest_server(
    db: Db, side: str, batches: list[Batch], args: argparse.Namespace, tmp: Path, pin: Pinned | None = None
) -> dict[str, Any]:
    """The batches through `serve` on PostgreSQL (a fresh database; PG_SIDES' settings) or LMDB (a
    fresh data dir); with `pin`, in the pinned layout (the server starts inside it, on the client
    side's CPU)."""
    env = {"SDV_FANOUT_PROCESSES": str(args.server_processes)} if args.server_processes else {}
    dsn = ""
    if side in PG_SIDES:
        dsn = db.database(tmp.name)
        env["SDV_FANOUT_STORE_URL"] = dsn
        env.update(PG_SIDES[side])
    server = start_server(tmp, args, env)
    try:
        pids = descendants(server.proc.pid)
        if pin:
            pin.server(pids)
        warm = warm_up(server.port, args)
        db.checkpoint()
        meter = Meter(pids, db)
        seconds, latencies, answers = asyncio.run(_drive(server.port, batches, args.clients))
        meter.loaded()
        drain(pids, db)  # a batch's dispatch check runs behind its answer
        cpu = meter.read()
        if pin:
            cpu["masks"] = pin.check()
    finally:
        stop_server(server)
    refused = [a for a in answers if pb.ValuedResponse.FromString(a).type != pb.ValuedResponse.STOP_AND_RETURN]
    if refused:
        raise SystemExit(f"ingest {side}: {len(refused)} batches not stored:\n{server.log()[-2000:]}")
    stored = asyncio.run(count_rows(dsn)) if dsn else lmdb_rows(tmp / "lmdb")
    return ingest_result(batches, seconds, latencies, cpu, stored - warm, len(pids))


#: Warm-up batches per client channel before a server side is measured.
WARM_BATCHES_PER_CLIENT = 4


def warm_up(port: int, args: argparse.Namespace) -> int:
    """A long-running server's state before the measurement, as the raw loop has its connections
    open and statements prepared: `--clients` channels send a few 200-VIN batches of their own
    request ids and VINs at once, so the server's database pool has grown to what the load needs
    (each new PostgreSQL backend costs a fork, catalog reads and plan caching, PostgreSQL CPU that
    the raw loop pays outside its measurement) and every statement is prepared. The rows it
    stored (not counted in the results)."""
    rng = random.Random(args.seed + 7)
    warm = [
        _batch(rng, [_vin(rng) for _ in range(BATCH_VINS)], f"task_warmup_{n}", rng.randbytes(1024))
        for n in range(WARM_BATCHES_PER_CLIENT * args.clients)
    ]
    _, _, answers = asyncio.run(_drive(port, warm, args.clients))
    if any(pb.ValuedResponse.FromString(a).type != pb.ValuedResponse.STOP_AND_RETURN for a in answers):
        raise SystemExit("ingest warm-up: a batch was not stored")
    return len(warm) * BATCH_VINS


def lmdb_rows(data_dir: Path) -> int:
    store = Store(data_dir, readonly=True)
    try:
        with store.read() as txn:
            return int(txn.stat(store.tables.ids)["entries"])
    finally:
        store.close()


async def count_rows(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM rows"))
    finally:
        await conn.close()


def ingest_raw(
    db: Db, batches: list[Batch], args: argparse.Namespace, tmp: Path, pin: Pinned | None = None
) -> dict[str, Any]:
    """The same rows by bare asyncpg into the product's schema: per batch one transaction with the
    blob (if absent) and one unnest upsert of its rows, `--clients` connections at once; with `pin`,
    in the pinned layout (the loop alone on the client side's CPU)."""
    dsn = db.database(tmp.name)
    work = [(sorted(b.vins), b.request_id, hashlib.sha1(b.blob).digest(), b.blob) for b in batches]

    async def run() -> tuple[float, list[float], dict[str, Any]]:
        settings = {"synchronous_commit": "on", "application_name": "pg_serve-raw"}
        conns = [await asyncpg.connect(dsn, server_settings=settings) for _ in range(args.clients)]
        try:
            await migrate.migrate(conns[0])
            for c in conns:  # prepared outside the measurement, as the server's pool has them
                await c.prepare(RAW_BLOB)
                await c.prepare(RAW_ROWS)
            db.checkpoint()
            meter = Meter([], db)
            latencies: list[float] = []
            todo = iter(work)

            async def loop(conn: asyncpg.Connection) -> None:
                for vins, rid, sha1, blob in todo:
                    t = time.perf_counter()
                    now_ms = int(time.time() * 1000)
                    async with conn.transaction():
                        await conn.execute(RAW_BLOB, sha1, blob, now_ms)
                        await conn.execute(RAW_ROWS, vins, rid, now_ms, sha1, len(blob))
                    latencies.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            await asyncio.gather(*(loop(c) for c in conns))
            seconds = time.perf_counter() - t0
            meter.loaded()
            drain([], db)
            cpu = meter.read()
            if pin:
                cpu["masks"] = pin.check()
            return seconds, latencies, cpu
        finally:
            for c in conns:
                await c.close()

    seconds, latencies, cpu = asyncio.run(run())
    return ingest_result(batches, seconds, latencies, cpu, asyncio.run(count_rows(dsn)), 0)


def ingest_result(
    batches: list[Batch], seconds: float, latencies: list[float], cpu: dict[str, Any], stored: int, procs: int
) -> dict[str, Any]:
    rows = sum(len(b.vins) for b in batches)
    if stored != rows:
        raise SystemExit(f"ingest: {stored} rows stored of {rows}")
    return {
        "seconds": seconds,
        "rows": rows,
        "rows_per_s": rows / seconds,
        "batches_per_s": len(batches) / seconds,
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "server_us_per_row": cpu["server_s"] / rows * 1e6,
        "pg_us_per_row": cpu["pg_s"] / rows * 1e6,
        "client_us_per_row": cpu["client_s"] / rows * 1e6,
        "other_share": cpu["other_share"],
        "cpu_busy": cpu["cpu_busy"],  # share of each CPU (by number) while the batches went in
        **({"masks": cpu["masks"]} if "masks" in cpu else {}),
        "server_processes": max(1, procs - 1) if procs else 0,  # a group's parent only supervises
    }


LAYOUTS = ("shared", "pinned")


def ingest_cell(
    db: Db, layout: str, side: str, batches: list[Batch], args: argparse.Namespace, tmp: Path, cpus: tuple[int, int]
) -> dict[str, Any]:
    """One side in one layout; the pinned layout's masks are set back to all CPUs however it ends."""
    with Pinned(db, *cpus) if layout == "pinned" else contextlib.nullcontext() as pin:
        if side == "raw":
            return ingest_raw(db, batches, args, tmp, pin)
        return ingest_server(db, side, batches, args, tmp, pin)


def ratios(res: dict[str, Any]) -> dict[str, float]:
    out = {
        "pg_over_raw": res["pg"]["rows_per_s"] / res["raw"]["rows_per_s"],
        "pg_over_lmdb": res["pg"]["rows_per_s"] / res["lmdb"]["rows_per_s"],
    }
    if "pg_unbounded" in res:
        out["pg_unbounded_over_raw"] = res["pg_unbounded"]["rows_per_s"] / res["raw"]["rows_per_s"]
    return out


def part_ingest(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Per round every side in every layout, the cells' order rotating. A round's shared-layout
    results keep their old keys (pg, raw, lmdb, pg_over_raw, pg_over_lmdb) plus pg_unbounded and
    pg_unbounded_over_raw unless --no-unbounded; the pinned layout's are the same keys under
    "pinned"."""
    batches = make_workload(args.seed, args.batches, BATCH_VINS, args.fleet, 1024, 4)
    # Every side's concurrency, and more rounds than the other parts: a cell is about a second,
    # so a moment of another program's load moves one round's ratio by 0.1.
    args = argparse.Namespace(**{**vars(args), "clients": args.ingest_clients, "rounds": args.ingest_rounds})
    layouts = list(args.layouts)
    db_cpu, client_cpu, note = pinned_cpus()
    if "pinned" in layouts and note:
        layouts.remove("pinned")
        say(f"ingest: pinned layout {note}")
    sides = ingest_sides(args)
    cells = [(layout, side) for layout in layouts for side in sides]
    rounds = []
    for r in range(args.rounds):
        res: dict[str, Any] = {}
        order = rotated(cells, r)
        for layout, side in order:
            where = tmp / f"ingest_{r}_{layout}_{side}"
            got = ingest_cell(db, layout, side, batches, args, where, (db_cpu, client_cpu))
            (res.setdefault("pinned", {}) if layout == "pinned" else res)[side] = got
        res["order"] = "->".join(side if layout == "shared" else f"{side}@pinned" for layout, side in order)
        if "shared" in layouts:
            res.update(ratios(res))
        if "pinned" in layouts:
            res["pinned"].update(ratios(res["pinned"]))
        rounds.append(res)
        say(
            f"ingest round {r + 1}/{args.rounds}: "
            + "; ".join(
                f"{layout}: "
                + ", ".join(f"{s} {at[s]['rows_per_s']:,.0f}" for s in sides)
                + f" rows/s, pg/raw {at['pg_over_raw']:.2f}"
                + (f", pg_unbounded/raw {at['pg_unbounded_over_raw']:.2f}" if "pg_unbounded" in at else "")
                + f", pg/lmdb {at['pg_over_lmdb']:.2f}"
                for layout in layouts
                for at in [res if layout == "shared" else res["pinned"]]
            )
        )
    return {
        "rounds": rounds,
        "batches": len(batches),
        "clients": args.clients,
        "layouts": layouts,
        "pinned_cpus": {"postgresql": db_cpu, "client": client_cpu} if "pinned" in layouts else {},
        "pinned_note": note if "pinned" in args.layouts else "",
    }


# -- workload of the hook parts -------------------------------------------------------------------


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


def instance_env(dsn: str, broker: Mosquitto, extra: dict[str, str] | None = None) -> dict[str, str]:
    """One `serve` instance: one process on the shared database, delivering to the run's broker."""
    return {
        "SDV_FANOUT_STORE_URL": dsn,
        "SDV_FANOUT_MQTT_URL": broker.url,
        "SDV_FANOUT_PROCESSES": "1",
        "SDV_FANOUT_INFLIGHT_TIMEOUT_S": QUIET_INFLIGHT_S,
        **(extra or {}),
    }


async def pg_count(dsn: str, sql: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()


def prefill(
    servers: list[SubprocessServer],
    db: Db,
    dsn: str,
    vins: list[str],
    pending: list[str],
    request_ids: list[str],
    payload: bytes,
    clients: int,
) -> None:
    """Every vehicle connects (a subscribe each, spread over the instances: its presence is
    recorded), then the batches store one row per request id for each of `pending`; whatever the
    instances send in return goes out to the broker and stays in flight."""
    ports = [s.port for s in servers]
    pids = [p for s in servers for p in descendants(s.proc.pid)]
    asyncio.run(send_all(ports, METHODS[SUBSCRIBE], [subscribe_wire(v, i) for i, v in enumerate(vins)], clients))
    drain(pids, db)
    batches = [
        batch_wire(pending[k : k + 2000], rid, payload) for rid in request_ids for k in range(0, len(pending), 2000)
    ]
    asyncio.run(send_all(ports[:1], METHODS[HEARTBEAT], batches, 1))
    drain(pids, db)
    online = asyncio.run(pg_count(dsn, "SELECT count(*) FROM presence"))
    rows = asyncio.run(pg_count(dsn, "SELECT count(*) FROM rows"))
    if online < len(vins) or rows < len(pending) * len(request_ids):
        raise SystemExit(f"prefill: {online} of {len(vins)} vehicles online, {rows} rows stored")


# -- 2. instances -------------------------------------------------------------------------------


def part_instances(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    levels = [int(x) for x in args.instances.split(",")]
    dsn = db.database("instances")
    broker = Mosquitto(tmp, verbose=False).start()
    servers: list[SubprocessServer] = []
    try:
        for i in range(max(levels)):
            servers.append(start_server(tmp / f"instance{i}", args, instance_env(dsn, broker)))
        vins = make_vins(args.seed + 2, args.inst_vins)
        payload = random.Random(args.seed).randbytes(512).hex().encode()
        request_id = "task_ota_000001"
        t0 = time.monotonic()
        prefill(servers, db, dsn, vins, vins, [request_id], payload, args.clients)
        say(f"instances: {len(vins):,} vehicles online with a delivery out each, in {time.monotonic() - t0:.1f} s")
        mix = Mix(vins, request_id, payload, (args.subscribe_share, args.ack_share), args.seed)
        warm = instances_cell(servers, [], db, mix, args)  # every instance's pool and prepared statements
        say(f"instances: warm-up over all {len(servers)}: {warm['calls_per_s']:,.0f} calls/s")
        # Closed-loop cells, then the open-loop tables' cells (each n at its table's total rate; a cell
        # two tables share, such as 1 instance at 400 calls/s in both, is measured once and shown in
        # both), one order rotating over them all.
        tables = open_tables(args)
        cells = [(n, 0.0) for n in levels]
        cells += list(dict.fromkeys((n, rate_of(n)) for rate_of in tables.values() for n in levels))
        rounds = []
        for r in range(args.rounds):
            order = rotated(cells, r)
            res: dict[str, Any] = {"order": "->".join(f"{n}@{rate:g}/s" if rate else str(n) for n, rate in order)}
            got = {
                (n, rate): instances_cell(servers[:n], servers[n:], db, mix, args, rate, seed=args.seed + 100 * r + k)
                for k, (n, rate) in enumerate(order)
            }
            res.update({str(n): got[n, 0.0] for n in levels})
            for t, offered in tables.items():
                res[t] = {str(n): dict(got[n, offered(n)]) for n in levels}  # copies: the ratios are the table's
            for at in (res, *(res[t] for t in tables)):
                base = at[str(levels[0])]
                for n in levels:
                    at[str(n)]["cost_vs_first"] = at[str(n)]["us_per_call"] / base["us_per_call"]
                    at[str(n)]["rate_vs_first"] = at[str(n)]["calls_per_s"] / base["calls_per_s"]
            rounds.append(res)
            say(
                f"instances round {r + 1}/{args.rounds}: closed loop "
                + ", ".join(
                    f"{n}: {res[str(n)]['calls_per_s']:,.0f} calls/s {res[str(n)]['us_per_call']:,.0f} µs/call "
                    f"{res[str(n)]['trips_per_call']:.2f} trips/call"
                    for n in levels
                )
                + "".join(
                    f"; {OPEN_TABLES[t]} "
                    + ", ".join(
                        f"{n}: {res[t][str(n)]['calls_per_s']:,.0f} of {offered(n):,.0f} calls/s "
                        f"{res[t][str(n)]['us_per_call']:,.0f} µs/call {res[t][str(n)]['trips_per_call']:.2f} "
                        f"trips/call, {res[t][str(n)]['late']} late"
                        for n in levels
                    )
                    for t, offered in tables.items()
                )
            )
        left = asyncio.run(pg_count(dsn, "SELECT count(*) FROM rows"))
    finally:
        for s in servers:
            stop_server(s)
        broker.stop()
    return {
        "levels": levels,
        "vins": len(vins),
        "rounds": rounds,
        "fixed_rate": args.inst_rate if args.inst_rate > 0 else 0.0,
        "per_instance_rate": args.inst_rate_per_instance if args.inst_rate_per_instance > 0 else 0.0,
        "max_in_flight": args.clients * 4,
        "acks_issued": mix.acks_issued,
        "rows_stored": len(vins),
        "rows_left": left,
    }


#: The instances part's open-loop tables: key in each round (and in its summary, after
#: "instances_"), and what the progress line calls it.
OPEN_TABLES = {"fixed_rate": "fixed total rate", "per_instance_rate": "equal load per instance"}


def open_tables(args: argparse.Namespace) -> dict[str, Callable[[int], float]]:
    """The open-loop tables this run measures, each as its total offered calls/s for n instances:
    `--inst-rate` whatever n (the instances share a fixed load), or n x `--inst-rate-per-instance`
    (each instance added brings its own)."""
    rates: dict[str, Callable[[int], float]] = {
        "fixed_rate": lambda n: args.inst_rate,
        "per_instance_rate": lambda n: n * args.inst_rate_per_instance,
    }
    on = {"fixed_rate": args.inst_rate > 0, "per_instance_rate": args.inst_rate_per_instance > 0}
    return {t: rates[t] for t in OPEN_TABLES if on[t]}


def instances_cell(
    driven: list[SubprocessServer],
    idle: list[SubprocessServer],
    db: Db,
    mix: Mix,
    args: argparse.Namespace,
    rate: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The mix over `driven` instances, closed loop or (`rate` > 0) open loop at `rate` calls/s;
    CPU and round trips counted until the work the calls left behind is done. The `idle` instances
    keep running (their CPU is reported apart). Closed loop: counted from before the channels
    open (as it always was: their set-up is small next to thousands of calls); fixed rate: from
    once they are open and warm, since `clients` x n connections' set-up would weigh on a few
    hundred calls per cell, and more the more instances."""
    pids = [p for s in driven for p in descendants(s.proc.pid)]
    idle_pids = [p for s in idle for p in descendants(s.proc.pid)]
    at: dict[str, Any] = {}

    def start() -> None:
        at.update(before=[scrape(s) for s in driven], idle0=sum(cpu_by_pid(idle_pids).values()))
        at["meter"] = Meter(pids, db)

    ports = [s.port for s in driven]
    if rate > 0:
        out = asyncio.run(drive_rate(ports, mix, args.clients, rate, args.warmup, args.duration, seed, start))
    else:
        start()
        out = asyncio.run(drive_mix(ports, mix, args.clients, args.warmup, args.duration))
    drain(pids, db)
    cpu = at["meter"].read()
    idle0 = at["idle0"]
    t: Counter[str] = Counter()
    for b, s in zip(at["before"], driven, strict=True):
        t.update(trips(b, scrape(s)))
    calls = out["issued"]
    return {
        **out,
        "server_us_per_call": cpu["server_s"] / calls * 1e6,
        "pg_us_per_call": cpu["pg_s"] / calls * 1e6,
        "us_per_call": (cpu["server_s"] + cpu["pg_s"]) / calls * 1e6,
        "client_us_per_call": cpu["client_s"] / calls * 1e6,
        "server_share": cpu["server_s"] / cpu["wall_s"],
        "pg_share": cpu["pg_s"] / cpu["wall_s"],
        "idle_instances_share": (sum(cpu_by_pid(idle_pids).values()) - idle0) / cpu["wall_s"],
        "other_share": max(0.0, cpu["other_share"] - (sum(cpu_by_pid(idle_pids).values()) - idle0) / cpu["wall_s"]),
        "trips_per_call": t["trips"] / calls,
        **{f"{p}_per_call": t[p] / calls for p in PURPOSES},
        "wall_s": cpu["wall_s"],
    }


# -- 3. heartbeat round trips -------------------------------------------------------------------

HB_PHASES = ("idle", "work")


def part_heartbeat(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    windows = [float(x) for x in args.hb_windows.split(",")]
    rates = [float(x) for x in args.hb_rates.split(",")]
    dsn = db.database("heartbeat")
    broker = Mosquitto(tmp, verbose=False).start()
    servers: dict[float, SubprocessServer] = {}
    try:
        for w in windows:
            env = instance_env(dsn, broker, {"SDV_FANOUT_HEARTBEAT_WINDOW_MS": f"{w:g}"})
            servers[w] = start_server(tmp / f"window{w:g}", args, env)
        both = make_vins(args.seed + 3, 2 * args.hb_vins)
        fleets = {"idle": both[: args.hb_vins], "work": both[args.hb_vins :]}
        busy = fleets["work"][: round(args.work_share * args.hb_vins)]
        payload = b"work for the vehicle"
        t0 = time.monotonic()
        prefill(list(servers.values()), db, dsn, both, busy, ["task_hb_1", "task_hb_2"], payload, args.clients)
        out_now = asyncio.run(pg_count(dsn, "SELECT count(*) FROM vin_state WHERE request_id IS NOT NULL"))
        say(
            f"heartbeat: {len(both):,} vehicles online, {len(busy):,} with 2 rows and {out_now:,} deliveries out, "
            f"in {time.monotonic() - t0:.1f} s"
        )
        offset = len(fleets["idle"])
        wires = {
            "idle": [heartbeat_wire(v, i) for i, v in enumerate(fleets["idle"])],
            "work": [heartbeat_wire(v, offset + i) for i, v in enumerate(fleets["work"])],
        }
        cells = [(w, phase, rate) for w in windows for phase in HB_PHASES for rate in rates]
        rounds = []
        for r in range(args.rounds):
            res: dict[str, Any] = {}
            for k, (w, phase, rate) in enumerate(rotated(cells, r)):
                calls = [(0, wire) for wire in random.Random(r * 100 + k).sample(wires[phase], len(wires[phase]))]
                res[f"{w:g}/{phase}/{rate:g}"] = heartbeat_cell(servers[w], db, calls, rate, args, seed=r * 100 + k)
            rounds.append(res)
            say(
                f"heartbeat round {r + 1}/{args.rounds}: "
                + ", ".join(f"{key} {v['trips_per_heartbeat']:.3f}" for key, v in res.items())
                + " round trips per heartbeat"
            )
        still_out = asyncio.run(pg_count(dsn, "SELECT count(*) FROM vin_state WHERE request_id IS NOT NULL"))
    finally:
        for s in servers.values():
            stop_server(s)
        broker.stop()
    return {
        "windows": windows,
        "rates": rates,
        "vins_per_fleet": args.hb_vins,
        "busy": len(busy),
        "out_before": out_now,
        "out_after": still_out,
        "rounds": rounds,
    }


def heartbeat_cell(
    server: SubprocessServer, db: Db, calls: list[tuple[int, bytes]], rate: float, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """Heartbeats at `rate`/s (Poisson arrivals, open loop, bench/hooks.py's sender) for
    `--hb-duration` s; the server's counters before and after the work behind them is done."""
    pids = descendants(server.proc.pid)
    before = scrape(server)
    meter = Meter(pids, db)
    sent = asyncio.run(open_loop(server.port, calls, args.clients, rate, args.warmup, args.hb_duration, seed, pids))
    drain(pids, db)
    cpu = meter.read()
    t = trips(before, scrape(server))
    hb = t["heartbeats"]
    return {
        "offered_per_s": rate,
        "achieved_per_s": sent["achieved_rpc_per_s"],
        "errors": sum(sent["errors"].values()) + sent["skipped"],
        "p50_ms": sent["p50_ms"],
        "p99_ms": sent["p99_ms"],
        **t,
        "filter_per_heartbeat": t["heartbeat_filter"] / hb,
        "trips_per_heartbeat": t["trips"] / hb,
        "events_per_heartbeat": t["heartbeat_events"] / hb,
        "heartbeats_per_statement": hb / max(1.0, t["heartbeat_filter"]),
        "server_us_per_heartbeat": cpu["server_s"] / hb * 1e6,
        "pg_us_per_heartbeat": cpu["pg_s"] / hb * 1e6,
        "other_share": cpu["other_share"],
    }


# -- 4. end to end ------------------------------------------------------------------------------

E2E_SIDES = ("pg", "lmdb")


#: Vehicles holding rows with nothing out for them: after a stall, a wake-up was lost (PostgreSQL).
IDLE_WITH_WORK = """
SELECT count(DISTINCT r.vin) FROM rows r LEFT JOIN vin_state s ON s.vin = r.vin WHERE s.request_id IS NULL
"""


class Nudge:
    """A rig's rescue when its deliveries stall (rows left, none ended for `--stall-s`): a heartbeat
    from each vehicle still holding rows, as its next periodic one would come (EMQX-shaped, from the
    vehicle's clientid and address). Counts those vehicles and, on PostgreSQL, those of them with no
    delivery out at all (a lost wake-up, not a slow one)."""

    def __init__(self, rig: e2e.Rig) -> None:
        assert rig.server is not None
        self.rig = rig
        self.client = ExHookClient(rig.server.port)
        self.vins = 0
        self.idle = 0

    def __call__(self) -> None:
        idle = int(self.rig.pg.fetchval(IDLE_WITH_WORK)) if self.rig.pg is not None else 0
        stuck = [v for v in self.rig.vins if self.rig.pending(v)]
        for vin in stuck:
            self.client.publish(f"ecp/{vin}/online", b"{}", sender=vin, username=vin)
        self.vins += len(stuck)
        self.idle += idle
        say(f"stall: {len(stuck)} vehicles still hold rows ({idle} with nothing out); one heartbeat each")


def part_e2e(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    vins = make_vins(args.seed + 4, args.vehicles)
    procs = max(args.procs, -(-args.vehicles // e2e.MAX_PER_PROC))
    rigs: dict[str, e2e.Rig] = {}
    nudges: dict[str, Nudge] = {}
    try:
        for side in E2E_SIDES:
            ns = argparse.Namespace(
                procs=procs,
                deadline_s=180.0,
                log_level=args.log_level,
                server_processes=args.server_processes,
                batches=args.e2e_batches,
                max_inflight=50,
                store_url=db.database("e2e") if side == "pg" else "",
            )
            (tmp / side).mkdir(parents=True)
            rig = rigs[side] = e2e.Rig(ns, tmp / side, vins)
            if side == "pg":
                rig.db_pids = db.pids
            rig.start_server()
            rig.start_sims()
            rig.stall_s, rig.on_stall = args.stall_s, nudges.setdefault(side, Nudge(rig))
            rig.args = argparse.Namespace(**{**vars(ns), "batches": 2})  # e2e.run_ours reads the count here
            e2e.run_ours(rig, "warm", args.payload_bytes, args.seed)  # pools, channels, first allocations
            rig.args = ns
            quiesce(rig.server_pids)
            say(f"e2e {side}: {args.vehicles} vehicles connected, warm-up done")
        rounds = []
        for r in range(args.rounds):
            res: dict[str, Any] = {"order": "->".join(rotated(E2E_SIDES, r))}
            for side in rotated(E2E_SIDES, r):
                rig, nudge = rigs[side], nudges[side]
                stalls, nudged, idle = rig.stalls, nudge.vins, nudge.idle
                assert rig.server is not None
                before = scrape(rig.server)
                res[side] = e2e.run_ours(rig, f"r{r}", args.payload_bytes, args.seed + 10 * r)
                spent = trips(before, scrape(rig.server))
                res[side]["trips_per_delivery"] = spent["trips"] / (args.vehicles * args.e2e_batches)
                res[side].update(
                    stalls=rig.stalls - stalls, nudged_vins=nudge.vins - nudged, idle_vins=nudge.idle - idle
                )
                quiesce(rig.server_pids, timeout_s=10)
            res["pg_over_lmdb"] = res["pg"]["msgs_per_s"] / res["lmdb"]["msgs_per_s"]
            rounds.append(res)
            say(
                f"e2e round {r + 1}/{args.rounds}: pg {res['pg']['msgs_per_s']:,.0f}, lmdb "
                f"{res['lmdb']['msgs_per_s']:,.0f} deliveries/s ({res['pg_over_lmdb']:.2f}x), "
                f"pg db round trips per delivery {res['pg']['trips_per_delivery']:.3f}"
            )
    finally:
        for nudge in nudges.values():
            nudge.client.close()
        for rig in rigs.values():
            rig.close()
    return {
        "vehicles": args.vehicles,
        "batches": args.e2e_batches,
        "procs": procs,
        "rounds": rounds,
        "stall_s": args.stall_s,
        "stalls_total": {side: rig.stalls for side, rig in rigs.items()},
        "idle_total": {side: nudge.idle for side, nudge in nudges.items()},
    }


# -- report -------------------------------------------------------------------------------------


def summarise(out: dict[str, Any]) -> dict[str, Any]:
    """The medians and ratios bench/run_all.py reads (min / median / max over the rounds)."""
    s: dict[str, Any] = {}
    if ing := out.get("ingest"):
        # "ingest": the shared layout (the keys bench/run_all.py reads); "ingest_pinned": PostgreSQL
        # on its own core, the same keys plus how busy each of the two CPUs was.
        for key, rs in (
            ("ingest", [r for r in ing["rounds"] if "pg" in r]),
            ("ingest_pinned", [r["pinned"] for r in ing["rounds"] if "pinned" in r]),
        ):
            if not rs:
                continue
            sides = sides_of(rs[0])
            s[key] = {
                "ratio_pg_over_raw": mmm([r["pg_over_raw"] for r in rs]),
                "ratio_pg_over_lmdb": mmm([r["pg_over_lmdb"] for r in rs]),
            "pg_trips_per_delivery": mmm([r["pg"]["trips_per_delivery"] for r in rs]),
                # Without the backlog bound (max_pending_per_vehicle = 0): the bound's price, not the product.
                **(
                    {"ratio_pg_unbounded_over_raw": mmm([r["pg_unbounded_over_raw"] for r in rs])}
                    if "pg_unbounded" in sides
                    else {}
                ),
                **{
                    f"{side}_{k}": mmm([r[side][k] for r in rs])
                    for side in sides
                    for k in ("rows_per_s", "server_us_per_row", "pg_us_per_row", "client_us_per_row")
                },
            }
            if key == "ingest_pinned":
                cpus = ing["pinned_cpus"]
                s[key]["cpus"] = cpus
                s[key].update(
                    {
                        f"{side}_{role}_cpu_busy": mmm([r[side]["cpu_busy"][str(c)] for r in rs])
                        for side in sides
                        for role, c in cpus.items()
                    }
                )
    if inst := out.get("instances"):
        rs = inst["rounds"]
        keys = (
            "calls_per_s",
            "us_per_call",
            "server_us_per_call",
            "pg_us_per_call",
            "cost_vs_first",
            "rate_vs_first",
            "trips_per_call",
        )
        s["instances"] = {str(n): {k: mmm([r[str(n)][k] for r in rs]) for k in keys} for n in inst["levels"]}
        # The open-loop tables apart: bench/run_all.py reads every key of "instances" as a level.
        # "instances_fixed_rate": offered_per_s in all whatever n; "instances_per_instance_rate":
        # per_instance_per_s each, so n times that in all (each level's offered_per_s).
        for t in OPEN_TABLES:
            if t not in rs[0]:
                continue
            by_level = {
                str(n): {
                    **{k: mmm([r[t][str(n)][k] for r in rs]) for k in (*keys, "p50_ms", "p99_ms")},
                    "offered_per_s": rs[0][t][str(n)]["offered_per_s"],
                    "late": sum(r[t][str(n)]["late"] for r in rs),
                    "arrivals": sum(r[t][str(n)]["offered"] for r in rs),
                }
                for n in inst["levels"]
            }
            rate_key = "offered_per_s" if t == "fixed_rate" else "per_instance_per_s"
            s[f"instances_{t}"] = {rate_key: inst[t], "levels": by_level}
    if hb := out.get("heartbeat"):
        s["heartbeat"] = {
            key: {
                k: mmm([r[key][k] for r in hb["rounds"]])
                for k in (
                    "trips_per_heartbeat",
                    "filter_per_heartbeat",
                    "events_per_heartbeat",
                    "achieved_per_s",
                    "heartbeats_per_statement",
                    "server_us_per_heartbeat",
                    "pg_us_per_heartbeat",
                )
            }
            for key in hb["rounds"][0]
        }
    if ee := out.get("e2e"):
        rs = ee["rounds"]
        s["e2e"] = {
            "ratio_pg_over_lmdb": mmm([r["pg_over_lmdb"] for r in rs]),
            "pg_trips_per_delivery": mmm([r["pg"]["trips_per_delivery"] for r in rs]),
            **{f"{side}_stalls": sum(r[side]["stalls"] for r in rs) for side in E2E_SIDES},
            **{f"{side}_msgs_per_s": mmm([r[side]["msgs_per_s"] for r in rs]) for side in E2E_SIDES},
            **{
                f"{side}_{g.replace(' ', '_')}_us_per_msg": mmm([r[side]["cpu_us_per_msg"].get(g, 0.0) for r in rs])
                for side in E2E_SIDES
                for g in ("server", "postgresql", "total")
            },
        }
    return s


def _row(label: str, values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return f"| {label} | {min_med_max(values, fmt)} |"


def med(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """One table cell: the median, then min-max."""
    return f"{fmt(med(values))} ({fmt(min(values))}-{fmt(max(values))})"


def markdown(out: dict[str, Any]) -> str:
    m = out["meta"]
    lines = [
        f"PostgreSQL {m['pg_version']} (throwaway cluster, fsync and synchronous_commit on, 127.0.0.1), asyncpg "
        f"{m['asyncpg']}, {m['cpus']} CPUs shared by the servers, PostgreSQL, brokers, fleets and this load "
        f"generator (except in ingest's pinned layout); load average (1 min) {m['loadavg_1m_before']:.2f} before, "
        f"{m['loadavg_1m_after']:.2f} after; "
        f"{m['rounds']} paired rounds, order rotating; rates min | median | max, the rest medians. "
        f"{m['wall_s']:.0f} s.",
    ]
    if ing := out.get("ingest"):
        lines += ["", *ingest_markdown(ing, m)]
    if inst := out.get("instances"):
        lines += ["", *instances_markdown(inst, m)]
    if hb := out.get("heartbeat"):
        lines += ["", *heartbeat_markdown(hb, m)]
    if ee := out.get("e2e"):
        lines += ["", *e2e_markdown(ee, m)]
    for part, stmts in out.get("statements", {}).items():
        lines += [
            "",
            f"#### Busiest statements of part {part} (pg_stat_statements, every database)",
            "",
            "| database | calls | total ms | mean ms | rows | statement |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for st in stmts:
            q = st["query"].replace("|", "\\|")
            lines.append(
                f"| {st['db']} | {st['calls']:,} | {st['total_ms']:,.0f} | {st['mean_ms']:.3f} | "
                f"{st['rows']:,} | `{q}` |"
            )
    return "\n".join(lines)


INGEST_NAMES = {
    "pg": "serve on PostgreSQL",
    "pg_unbounded": "serve on PostgreSQL, no backlog bound",
    "raw": "raw asyncpg loop",
    "lmdb": "serve on LMDB",
}
#: The sides in the per-round tables' headers.
INGEST_SHORT = {"pg": "PostgreSQL", "pg_unbounded": "PostgreSQL, no bound", "raw": "raw", "lmdb": "LMDB"}
#: The sides in the pinned per-round table's CPU-busy columns.
BUSY_SHORT = {"pg": "pg", "pg_unbounded": "pg no bound", "raw": "raw", "lmdb": "LMDB"}
UNBOUNDED_RATIO = "ratio PostgreSQL without the bound / raw asyncpg (paired per round)"
UNBOUNDED_NOTE = (
    f"The side *{INGEST_NAMES['pg_unbounded']}* is there to show the backlog bound's price beside the raw loop "
    "(a batch counts the queues of a sample of its VINs and of those listed at half the bound, which the raw loop "
    "does not): the same server, fresh "
    "database and warm-up as *serve on PostgreSQL*, with `max_pending_per_vehicle = 0` "
    "(`SDV_FANOUT_MAX_PENDING_PER_VEHICLE=0`), a setting an operator may choose but not the default "
    f"({Config().max_pending_per_vehicle}), so the bounded side stays the product's number."
)


def ratio_rows(rs: list[dict[str, Any]], lmdb_label: str) -> list[str]:
    """The paired ratios: the product's (the target's), without the bound beside it, over LMDB."""
    lines = [
        _row("**ratio PostgreSQL / raw asyncpg** (paired per round; target ≥ 0.8)", [r["pg_over_raw"] for r in rs], dec)
    ]
    if "pg_unbounded" in rs[0]:
        lines.append(_row(UNBOUNDED_RATIO, [r["pg_unbounded_over_raw"] for r in rs], dec))
    lines.append(_row(lmdb_label, [r["pg_over_lmdb"] for r in rs], dec))
    return lines


def round_cells(r: dict[str, Any]) -> str:
    """A per-round table's rates and ratios: each side's rows/s, pg/raw, [no bound/raw,] pg/LMDB."""
    sides = sides_of(r)
    ratios_ = [r["pg_over_raw"], *([r["pg_unbounded_over_raw"]] if "pg_unbounded" in sides else []), r["pg_over_lmdb"]]
    return " | ".join([*(f"{r[s]['rows_per_s']:,.0f}" for s in sides), *(f"{x:.2f}" for x in ratios_)])


def round_header(sides: Sequence[str]) -> str:
    """round_cells' column names."""
    return " | ".join(
        [
            *(f"{INGEST_SHORT[s]} rows/s" for s in sides),
            "pg/raw",
            *(["pg no bound/raw"] if "pg_unbounded" in sides else []),
            "pg/LMDB",
        ]
    )


def ingest_rate_rows(rs: list[dict[str, Any]], sides: Sequence[str], lmdb_ratio: str) -> list[str]:
    """A layout's rates table: VIN-rows/s per side, the ratios (`lmdb_ratio` labels PostgreSQL /
    LMDB), batch latency per side."""
    lines = ["| metric | min | median | max |", "|---|---:|---:|---:|"]
    lines += [_row(f"{INGEST_NAMES[s]} VIN-rows/s", [r[s]["rows_per_s"] for r in rs], num) for s in sides]
    lines += ratio_rows(rs, lmdb_ratio)
    lines += [_row(f"{INGEST_NAMES[s]} batch latency p50 ms", [r[s]["p50_ms"] for r in rs], dec) for s in sides]
    return lines


def ingest_markdown(ing: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs = ing["rounds"]
    lines: list[str] = []
    if "pg" in rs[0]:
        sides = sides_of(rs[0])
        lines += [
            f"### Ingest: {ing['batches']} batches x {BATCH_VINS} VINs per run, "
            f"{ing['clients']} channels / connections",
            "",
            *ingest_rate_rows(rs, sides, "ratio PostgreSQL / LMDB (paired per round)"),
        ]
        lines += ["", *ingest_cpu_table(rs)]
        procs = rs[0]["pg"]["server_processes"]
        lines += [
            "",
            f"Each run a fresh database (or data dir) and a fresh server ({procs} process(es)); the raw loop writes "
            "into the product's schema (same tables and indexes): per batch one transaction with `INSERT INTO blobs "
            "... ON CONFLICT DO NOTHING` and one `INSERT INTO rows ... SELECT FROM unnest($1) ... ON CONFLICT DO "
            "UPDATE`, nothing else (no receipts, counts, outcomes, backlog bound, old-row read or dispatch check). "
            f"Before a server side is measured, {WARM_BATCHES_PER_CLIENT} batches per channel of other VINs and "
            "requests go in unmeasured (the server's database pool grows to what the load needs, statements get "
            "prepared), as the raw loop opens its connections and prepares outside its measurement. A "
            "checkpoint before every run; CPU counted until the servers and PostgreSQL are idle again. This is the "
            f"**shared** layout: the server, PostgreSQL and this load generator all run on all {m['cpus']} CPUs, so "
            "on a small machine the serve sides pay for three busy programs on the cores the raw side leaves to "
            "PostgreSQL and a tiny client; the pinned layout below gives PostgreSQL a core of its own, as its own "
            "machine in production.",
            *(["", UNBOUNDED_NOTE] if "pg_unbounded" in sides else []),
            "",
            f"| round | order | {round_header(sides)} |",
            "|---:|---|" + "---:|" * (len(sides) + 2 + ("pg_unbounded" in sides)),
        ]
        for i, r in enumerate(rs, 1):
            lines.append(f"| {i} | {r['order']} | {round_cells(r)} |")
    if "pinned" in rs[0]:
        lines += ["", *pinned_markdown(ing, m)]
    elif ing.get("pinned_note"):
        lines += ["", f"Ingest with PostgreSQL on its own core (pinned layout): {ing['pinned_note']}."]
    return lines


def ingest_cpu_table(rs: list[dict[str, Any]], cpus: dict[str, int] | None = None) -> list[str]:
    """CPU µs per VIN-row by group, medians over the rounds; with the pinned layout's `cpus`, how
    busy PostgreSQL's CPU and the client side's CPU were."""
    busy = (
        f" | CPU {cpus['postgresql']} (PostgreSQL's) busy under load "
        f"| CPU {cpus['client']} (client side's) busy under load"
        if cpus
        else ""
    )
    lines = [
        "| CPU µs per VIN-row (median) | sdv-fanout server | PostgreSQL (all its processes) | this process "
        f"| server + PostgreSQL{busy} | other processes (share of a core) |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if cpus else ""),
    ]
    for side in sides_of(rs[0]):
        srv, pgc = med([r[side]["server_us_per_row"] for r in rs]), med([r[side]["pg_us_per_row"] for r in rs])
        cores = (
            "".join(f" | {share(med([r[side]['cpu_busy'][str(c)] for r in rs]))}" for c in cpus.values())
            if cpus
            else ""
        )
        lines.append(
            f"| {INGEST_NAMES[side]} | {srv:.1f} | {pgc:.1f} | {med([r[side]['client_us_per_row'] for r in rs]):.1f} "
            f"| {srv + pgc:.1f}{cores} | {share(med([r[side]['other_share'] for r in rs]))} |"
        )
    return lines


def pinned_markdown(ing: dict[str, Any], m: dict[str, Any]) -> list[str]:
    """The pinned layout's tables: PostgreSQL on a CPU of its own, the client side on another."""
    rs = [r["pinned"] for r in ing["rounds"]]
    sides = sides_of(rs[0])
    cpus = ing["pinned_cpus"]
    db_cpu, client_cpu = cpus["postgresql"], cpus["client"]
    lines = [
        f"### Ingest, PostgreSQL on its own core: {ing['batches']} batches x {BATCH_VINS} VINs per run, "
        f"PostgreSQL on CPU {db_cpu}, the client side on CPU {client_cpu}",
        "",
        *ingest_rate_rows(rs, sides, "ratio PostgreSQL / LMDB (one-core server, paired per round)"),
    ]
    lines += ["", *ingest_cpu_table(rs, cpus)]
    procs = rs[0]["pg"]["server_processes"]
    db_sides = [s for s in sides if s != "lmdb"]  # the LMDB side leaves PostgreSQL's CPU idle
    lines += [
        "",
        f"In production PostgreSQL runs on a machine of its own. Here it gets CPU {db_cpu} alone: the postmaster and "
        "every process it has are pinned there (`sched_setaffinity`, every thread), and the backends it forks "
        f"later inherit the mask. CPU {client_cpu} is the client side's: for the PostgreSQL and LMDB sides the "
        f"`serve` process tree and this load generator (every thread of it), the server started with that one CPU "
        f"visible and so runs {procs} process(es); for the raw side the raw loop alone. The LMDB side has no "
        f"database: its server and load generator share CPU {client_cpu} while CPU {db_cpu} stays idle, i.e. a "
        "one-core server. The masks are checked after each measurement and set back to all CPUs after each cell. "
        "Cells of both layouts rotate together round by round. How busy each CPU was while the batches went in "
        f"(/proc/stat, anyone's work) says what limits a side: CPU {db_cpu} near 100 % is PostgreSQL, CPU "
        f"{client_cpu} near 100 % the server and load generator, neither means the side waits (commits' fsyncs, "
        "round trips) more than it computes. Other processes (another benchmark, the system) still use either CPU.",
        # Said once, under the shared tables, when they ran.
        *(["", UNBOUNDED_NOTE] if "pg_unbounded" in sides and "pg" not in ing["rounds"][0] else []),
        "",
        f"| round | {round_header(sides)} "
        f"| CPU {db_cpu} busy ({' / '.join(BUSY_SHORT[s] for s in db_sides)}) "
        f"| CPU {client_cpu} busy ({' / '.join(BUSY_SHORT[s] for s in sides)}) |",
        "|---:|" + "---:|" * (len(sides) + 2 + ("pg_unbounded" in sides) + 2),
    ]
    for i, r in enumerate(rs, 1):
        busy = {s: r[s]["cpu_busy"] for s in sides}
        lines.append(
            f"| {i} | {round_cells(r)} "
            f"| {' / '.join(share(busy[s][str(db_cpu)]) for s in db_sides)} "
            f"| {' / '.join(share(busy[s][str(client_cpu)]) for s in sides)} |"
        )
    return lines


def instances_markdown(inst: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs, levels = inst["rounds"], inst["levels"]
    first = levels[0]
    open_ = [t for t in OPEN_TABLES if t in rs[0]]
    mix = (
        f"{1 - m['subscribe_share'] - m['ack_share']:.0%} heartbeats, {m['subscribe_share']:.0%} subscribes, "
        f"{m['ack_share']:.0%} acks"
    )
    lines = [
        f"### Instances: {mix}, {inst['vins']:,} vehicles, closed loop with {m['clients']} calls in flight spread "
        f"over the instances, {m['duration']:g} s per cell",
        "",
        "| instances | calls/s, median (min-max) | **server + PostgreSQL CPU µs/call** | **cost vs "
        f"{first}** (paired, median (min-max)) | server µs/call | PostgreSQL µs/call | load generator µs/call "
        "| db round trips/call | p99 ms | server CPU (cores) | PostgreSQL CPU (cores) | idle instances (cores) "
        "| other processes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in levels:
        c = [r[str(n)] for r in rs]
        lines.append(
            f"| {n} | {spread([x['calls_per_s'] for x in c], num)} | {med([x['us_per_call'] for x in c]):,.0f} | "
            f"{spread([x['cost_vs_first'] for x in c], dec)} | {med([x['server_us_per_call'] for x in c]):,.0f} | "
            f"{med([x['pg_us_per_call'] for x in c]):,.0f} | {med([x['client_us_per_call'] for x in c]):,.0f} | "
            f"{med([x['trips_per_call'] for x in c]):.2f} | {med([x['p99_ms'] for x in c]):.1f} | "
            f"{med([x['server_share'] for x in c]):.2f} | {med([x['pg_share'] for x in c]):.2f} | "
            f"{med([x['idle_instances_share'] for x in c]):.2f} | {share(med([x['other_share'] for x in c]))} |"
        )
    lines += [
        "",
        f"Each instance is one `serve` process (`processes = 1`) with its own port and pool, all on one database, "
        f"delivering to one mosquitto; {max(levels)} run throughout, the driver uses the first n. Set-up: every "
        f"vehicle subscribed, then one row each, so each has a delivery out; the acks walk those rows "
        f"({inst['acks_issued']:,} acks issued, {inst['rows_stored'] - inst['rows_left']:,} rows deleted). CPU per "
        "call counts every call issued (warm-up included) and lasts until the servers and PostgreSQL are idle, so the "
        "work behind the answers (heartbeat filter, events) is in it. calls/s is bounded by the 2 shared cores: "
        "read the cost column. At saturation the cost column also holds the machine's: more processes busy on "
        "the same cores add scheduling and waiting to every call"
        + (
            f"; the open-loop {'tables below measure' if len(open_) > 1 else 'table below measures'} the cost below "
            "saturation."
            if open_
            else "."
        ),
    ]
    for t in open_:
        lines += ["", *open_loop_markdown(inst, m, t)]
    return lines


#: An open-loop cell's arrivals not sent (late) above this share: the table says so.
LATE_NOTE_SHARE = 0.01


def open_loop_markdown(inst: dict[str, Any], m: dict[str, Any], t: str) -> list[str]:
    """One of the instances part's open-loop tables (`t` in OPEN_TABLES): the same mix at each n's
    total offered rate, its title and prose by table, then which cells (if any) could not send more
    than LATE_NOTE_SHARE of their arrivals."""
    rs, levels = [r[t] for r in inst["rounds"]], inst["levels"]
    title, prose = (fixed_rate_text if t == "fixed_rate" else per_instance_text)(inst, m)
    lines = [
        title,
        "",
        "| instances | offered calls/s | achieved calls/s, median (min-max) | achieved / offered "
        f"| **server + PostgreSQL CPU µs/call** | **cost vs {levels[0]}** (paired, median (min-max)) "
        "| server µs/call | PostgreSQL µs/call | load generator µs/call | db round trips/call | p50 ms | p99 ms "
        "| late: not sent (all rounds, share of arrivals) / send lag p99 ms "
        "| server CPU (cores) | PostgreSQL CPU (cores) | idle instances (cores) | other processes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    late: list[str] = []
    for n in levels:
        c = [r[str(n)] for r in rs]
        offered = c[0]["offered_per_s"]
        missed = sum(x["late"] for x in c) / max(1, sum(x["offered"] for x in c))
        lines.append(
            f"| {n} | {offered:,.0f} | {spread([x['calls_per_s'] for x in c], num)} | "
            f"{share(med([x['calls_per_s'] / offered for x in c]))} | "
            f"{med([x['us_per_call'] for x in c]):,.0f} | {spread([x['cost_vs_first'] for x in c], dec)} | "
            f"{med([x['server_us_per_call'] for x in c]):,.0f} | {med([x['pg_us_per_call'] for x in c]):,.0f} | "
            f"{med([x['client_us_per_call'] for x in c]):,.0f} | {med([x['trips_per_call'] for x in c]):.2f} | "
            f"{med([x['p50_ms'] for x in c]):.1f} | {med([x['p99_ms'] for x in c]):.1f} | "
            f"{sum(x['late'] for x in c):,} ({missed:.1%}) / {med([x['send_lag_p99_ms'] for x in c]):.1f} | "
            f"{med([x['server_share'] for x in c]):.2f} | "
            f"{med([x['pg_share'] for x in c]):.2f} | {med([x['idle_instances_share'] for x in c]):.2f} | "
            f"{share(med([x['other_share'] for x in c]))} |"
        )
        worst = max(x["late"] / max(1, x["offered"]) for x in c)
        if worst > LATE_NOTE_SHARE:
            late.append(
                f"{n} instance{'s' * (n > 1)} at {offered:,.0f} calls/s ({missed:.1%} of arrivals late over the "
                f"rounds, {worst:.1%} in the worst)"
            )
    low = min(r[str(n)]["offered_per_s"] for r in rs for n in levels)
    lines += [
        "",
        prose,
        "",
        "achieved / offered: calls answered per second over the nominal offered rate; the Poisson arrivals alone "
        f"move it by about ±{1 / (low * m['duration']) ** 0.5:.0%} at {low:,.0f} calls/s over {m['duration']:g} s "
        "(one standard deviation), less at higher rates.",
    ]
    if late:
        lines += [
            "",
            f"**Not all of the offered load was sent in this run**: more than {LATE_NOTE_SHARE:.0%} of a cell's "
            f"arrivals found {inst['max_in_flight']} calls in flight and were not sent, for "
            + "; ".join(late)
            + ". Those cells' achieved rate is under the offered one (the answers came too slowly: the machine was "
            "near saturation, or other load on it), and their CPU per call is over the calls sent.",
        ]
    return lines


def fixed_rate_text(inst: dict[str, Any], m: dict[str, Any]) -> tuple[str, str]:
    """The fixed-rate table's title and prose: one total offered rate, whatever the number of instances."""
    levels, rate = inst["levels"], inst["fixed_rate"]
    title = (
        f"### Instances at a fixed rate of {rate:,.0f} calls/s: the same mix, open loop (Poisson arrivals) spread "
        f"call by call over the instances, at most {inst['max_in_flight']} calls in flight, {m['duration']:g} s per "
        "cell"
    )
    prose = (
        "CPU per call is a cost, so it is measured below saturation: the instances together get the same offered "
        f"rate whatever their number ({rate:,.0f} calls/s, i.e. {rate / max(levels):,.0f} per instance with "
        f"{max(levels)}), the cores keep idle time, and what grows with n is what each instance adds per call, "
        "not the scheduler's work of a saturated machine: each gets 1/n of the calls, so fewer of them share "
        "an event-loop wake-up or a batched heartbeat filter statement (see round trips/call), and its own "
        "timers and pool are spread over fewer calls (a higher `--inst-rate` lowers the cost per call at every "
        "n). Arrivals at their Poisson times, each call issued on time "
        f"unless {inst['max_in_flight']} are already in flight: then it is not sent and counts as late (nothing "
        "queues, so the offered rate is never exceeded to catch up). Same servers, set-up and CPU accounting as "
        "the closed-loop table (every call issued, warm-up included, until the servers and PostgreSQL are idle), "
        "except that counting starts once the driver's channels are open and warm: their set-up would weigh on "
        "a few hundred calls, more with more instances. Its cells rotate with the other tables' cells."
    )
    return title, prose


def per_instance_text(inst: dict[str, Any], m: dict[str, Any]) -> tuple[str, str]:
    """The equal-load table's title and prose: each instance offered the same rate, so n times it in all."""
    levels, each = inst["levels"], inst["per_instance_rate"]
    top = max(levels)
    saturation = med([r[str(top)]["calls_per_s"] for r in inst["rounds"]])
    title = (
        f"### Instances at equal load per instance, {each:,.0f} calls/s each: the same mix, open loop (Poisson "
        f"arrivals) at n x {each:,.0f} calls/s in all, spread call by call over the n instances, at most "
        f"{inst['max_in_flight']} calls in flight, {m['duration']:g} s per cell"
    )
    below = (
        f"stays below this {m['cpus']}-core VM's saturation ({top} x {each:,.0f} = {top * each:,.0f} calls/s "
        f"against the {saturation:,.0f} calls/s of the closed loop above with {top}), so the cores keep idle time"
        if top * each < saturation
        else f"is at or above this {m['cpus']}-core VM's saturation ({top} x {each:,.0f} = {top * each:,.0f} "
        f"calls/s against the {saturation:,.0f} calls/s of the closed loop above with {top}): its top rows hold "
        "some of the saturated machine's scheduling too; a lower `--inst-rate-per-instance` keeps under it"
    )
    shared = [n for n in levels if inst["fixed_rate"] and n * each == inst["fixed_rate"]]
    prose = (
        "This is the scale-out measurement: scaling out adds instances, each carrying its share of a growing "
        f"fleet, so n instances are offered n x {each:,.0f} calls/s, {each:,.0f} each. In production each instance "
        "would have cores of its own, so throughput scales with cores when CPU per call stays flat here as n "
        f"grows (cost vs {levels[0]} near 1): n instances then carry n times the calls on n times the cores. Here "
        f"they share the VM's cores, and the total {below}. Unlike the fixed-rate table, each instance's "
        "load does not fall as n grows, so neither does the number of calls sharing its wake-ups and batched "
        "statements. Same driver (Poisson arrivals, at most "
        f"{inst['max_in_flight']} in flight, late arrivals not sent), set-up and CPU accounting as the fixed-rate "
        "table; its cells rotate with the other tables' cells"
        + (
            f", and its {' and '.join(f'{n}-instance' for n in shared)} "
            f"{'cells are' if len(shared) > 1 else 'cell is'} the fixed-rate table's (the same offered rate: "
            "measured once per round, shown in both)."
            if shared
            else "."
        )
    )
    return title, prose


def heartbeat_markdown(hb: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs = hb["rounds"]
    lines = [
        f"### Heartbeat round trips: {hb['vins_per_fleet']:,} vehicles per fleet, open loop (Poisson) for "
        f"{m['hb_duration']:g} s per cell",
        "",
        "| window ms | fleet | offered/s | achieved/s | **db round trips / heartbeat**, median (min-max) "
        "(target ≤ 0.05) | heartbeat filter / heartbeat | events / heartbeat | heartbeats per filter statement "
        "| server µs/heartbeat | PostgreSQL µs/heartbeat |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in rs[0]:
        w, phase, rate = key.split("/")
        c = [r[key] for r in rs]
        lines.append(
            f"| {w} | {phase} | {float(rate):,.0f} | {med([x['achieved_per_s'] for x in c]):,.0f} | "
            f"{spread([x['trips_per_heartbeat'] for x in c], lambda v: f'{v:.3f}')} | "
            f"{med([x['filter_per_heartbeat'] for x in c]):.3f} | {med([x['events_per_heartbeat'] for x in c]):.4f} | "
            f"{med([x['heartbeats_per_statement'] for x in c]):.1f} | "
            f"{med([x['server_us_per_heartbeat'] for x in c]):.0f} | {med([x['pg_us_per_heartbeat'] for x in c]):.0f} |"
        )
    lines += [
        "",
        f"One instance per `heartbeat_window_ms` (each one process) on one database; two fleets, every vehicle "
        f"connected (subscribed) before: **idle** has nothing pending; in **work**, {hb['busy']:,} of its vehicles "
        f"({m['work_share']:.0%}) have 2 rows, the first sent at set-up and still out (no vehicle PUBACKs; "
        f"{hb['out_before']:,} deliveries out before, {hb['out_after']:,} after). Round trips are the server's "
        "`sdv_fanout_db_round_trips_total` (every purpose) over `sdv_fanout_heartbeats_total`, from before the "
        "cell until the work behind the answers is done. A statement gathers what arrives in one window plus what "
        "arrives while the previous statement runs, so round trips per heartbeat ≈ 1 / (rate x (window + statement "
        "time)) per instance.",
    ]
    return lines


def e2e_markdown(ee: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs = ee["rounds"]
    lines = [
        f"### End to end: {ee['vehicles']:,} vehicles x {ee['batches']} batches per measurement, bench/e2e.py's rig "
        "once per store",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        _row(
            "PostgreSQL deliveries/s (batch → MQTT → PUBACK → acked hook → row deleted)",
            [r["pg"]["msgs_per_s"] for r in rs],
            num,
        ),
        _row("LMDB deliveries/s", [r["lmdb"]["msgs_per_s"] for r in rs], num),
        _row("**ratio PostgreSQL / LMDB** (paired per round)", [r["pg_over_lmdb"] for r in rs], dec),
        _row("PostgreSQL: per-vehicle cycle p50 ms", [r["pg"]["cycle_p50_ms"] for r in rs], dec),
        _row("LMDB: per-vehicle cycle p50 ms", [r["lmdb"]["cycle_p50_ms"] for r in rs], dec),
        _row("PostgreSQL: store write transactions/s", [r["pg"]["commits_per_s"] for r in rs], num),
        _row("PostgreSQL: database round trips / delivery", [r["pg"].get("trips_per_delivery", 0.0) for r in rs], dec),
        _row("LMDB: store commits/s", [r["lmdb"]["commits_per_s"] for r in rs], num),
        "",
        "| CPU µs per delivery (median) | server | PostgreSQL | mosquitto | sim fleet (vehicles + hook driver) "
        "| this process | all | other processes (share of a core) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, name in (("pg", "PostgreSQL"), ("lmdb", "LMDB")):

        def us(g: str, side: str = side) -> float:
            return med([r[side]["cpu_us_per_msg"].get(g, 0.0) for r in rs])

        lines.append(
            f"| {name} | {us('server'):,.0f} | {us('postgresql'):,.0f} | {us('mosquitto'):,.0f} | "
            f"{us('sim fleet'):,.0f} | {us('bench'):,.0f} | {us('total'):,.0f} | "
            f"{share(med([r[side]['cpu']['other processes'] for r in rs]))} |"
        )
    stalls = {side: sum(r[side]["stalls"] for r in rs) for side in E2E_SIDES}
    nudged = {side: sum(r[side]["nudged_vins"] for r in rs) for side in E2E_SIDES}
    idle = sum(r["pg"]["idle_vins"] for r in rs)
    lines += [
        "",
        f"**Stalls** (rows left and no delivery ended for {ee['stall_s']:g} s; each vehicle still holding rows then "
        f"sent one heartbeat, as its next periodic one would): PostgreSQL {stalls['pg']} in the measured runs "
        f"({nudged['pg']} vehicle heartbeats; {idle} of those vehicles had no delivery out, i.e. a lost wake-up, "
        f"not a slow one), LMDB {stalls['lmdb']} ({nudged['lmdb']}); warm-ups included: {ee['stalls_total']['pg']} "
        f"(lost wake-ups: {ee['idle_total']['pg']}) and {ee['stalls_total']['lmdb']}. A stall's wait is in that "
        "run's time; under load a slow tail can stall too.",
        "",
        f"Two rigs up for the whole part (each its own mosquitto, server with its default process count and "
        f"{ee['procs']} sim fleet processes); per round each runs bench/e2e.py's `run_ours` (first publish → the "
        "store holding 0 rows), order alternating, after one unrecorded warm-up. The idle rig counts as other "
        "processes. Write transactions on PostgreSQL are xids assigned (each event that changed a vehicle's state, "
        "each batch); on LMDB group commits.",
    ]
    return lines


# -- main -------------------------------------------------------------------------------------

PARTS: dict[str, Callable[[Db, argparse.Namespace, Path], dict[str, Any]]] = {
    "ingest": part_ingest,
    "instances": part_instances,
    "heartbeat": part_heartbeat,
    "e2e": part_e2e,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="paired rounds of every part (default 3)")
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run (default {','.join(PARTS)})")
    p.add_argument("--quick", action="store_true", help="small cells, 2 rounds (about a minute)")
    p.add_argument("--clients", type=int, default=8, help="gRPC channels / connections, EMQX's pool_size (default 8)")
    p.add_argument("--ingest-rounds", type=int, default=5, help="ingest: paired rounds (default 5)")
    p.add_argument(
        "--ingest-clients",
        type=int,
        default=32,
        help="ingest: channels / connections of every side (default 32, the PostgreSQL mode's pool_size)",
    )
    p.add_argument("--batches", type=int, default=600, help="ingest: 200-VIN batches per run (default 600)")
    p.add_argument("--fleet", type=int, default=20_000, help="ingest: VINs the batches draw from (default 20000)")
    p.add_argument(
        "--server-processes",
        type=int,
        default=0,
        help="ingest and e2e: SDV_FANOUT_PROCESSES of the servers (default: theirs, one per CPU)",
    )
    p.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="ingest: shared (every process on every CPU) and/or pinned (PostgreSQL on a CPU of its own, the "
        "server and load generator or the raw loop on another) (default shared,pinned)",
    )
    p.add_argument(
        "--no-unbounded",
        action="store_true",
        help="ingest: skip the side 'serve on PostgreSQL, no backlog bound' (max_pending_per_vehicle = 0), "
        "which shows the bound's price beside the raw loop (default: measured)",
    )
    p.add_argument("--instances", default="1,2,3", help="instances: counts compared (default 1,2,3)")
    p.add_argument(
        "--inst-rate",
        type=float,
        default=400.0,
        help="instances: calls/s offered in all by the fixed-rate cells, under saturation (default 400; 0 = none)",
    )
    p.add_argument(
        "--inst-rate-per-instance",
        type=float,
        default=400.0,
        help="instances: calls/s offered to each instance by the equal-load cells, n times that in all "
        "(default 400; 0 = none)",
    )
    p.add_argument("--inst-vins", type=int, default=5_000, help="instances: vehicles (default 5000)")
    p.add_argument("--subscribe-share", type=float, default=0.05, help="instances: share of subscribes (0.05)")
    p.add_argument("--ack-share", type=float, default=0.05, help="instances: share of acks (0.05)")
    p.add_argument("--duration", type=float, default=3.0, help="instances: seconds measured per cell (default 3)")
    p.add_argument("--warmup", type=float, default=0.5, help="unrecorded load before each hook cell (default 0.5)")
    p.add_argument("--hb-windows", default="5,20", help="heartbeat: heartbeat_window_ms values (default 5,20)")
    p.add_argument("--hb-rates", default="500,2000", help="heartbeat: heartbeats/s offered (default 500,2000)")
    p.add_argument("--hb-vins", type=int, default=3_000, help="heartbeat: vehicles per fleet (default 3000)")
    p.add_argument("--work-share", type=float, default=0.1, help="heartbeat: vehicles with work in fleet 'work'")
    p.add_argument("--hb-duration", type=float, default=2.0, help="heartbeat: seconds per cell (default 2)")
    p.add_argument("--vehicles", type=int, default=500, help="e2e: online sim vehicles (default 500)")
    p.add_argument("--e2e-batches", type=int, default=6, help="e2e: batches per measurement (default 6)")
    p.add_argument("--procs", type=int, default=2, help="e2e: sim fleet processes (default 2)")
    p.add_argument("--payload-bytes", type=int, default=256, help="e2e: delivered payload (default 256)")
    p.add_argument(
        "--stall-s",
        type=float,
        default=0.5,
        help="e2e: no delivery ended this long with rows left = a stall: each vehicle holding rows "
        "heartbeats once (default 0.5; 0 = wait, up to 180 s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="servers' log level (default info, as in production)",
    )
    p.add_argument(
        "--statements", action="store_true", help="load pg_stat_statements; print each part's top statements"
    )
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.ingest_rounds = min(args.ingest_rounds, 2)
        args.batches, args.inst_vins, args.duration, args.warmup = 60, 1000, 1.0, 0.2
        args.hb_vins, args.hb_duration, args.hb_rates, args.hb_windows = 1000, 1.0, "1000", "5"
        args.vehicles, args.e2e_batches = 100, 3
    only = [x for x in args.only.split(",") if x]
    if set(only) - set(PARTS) or args.rounds < 1 or args.ingest_rounds < 1:
        p.error(f"--only takes {','.join(PARTS)}; --rounds and --ingest-rounds must be positive")
    given = [x for x in args.layouts.split(",") if x]
    if not given or set(given) - set(LAYOUTS):
        p.error(f"--layouts takes one or both of {','.join(LAYOUTS)}")
    args.layouts = [x for x in LAYOUTS if x in given]
    if args.inst_rate < 0 or args.inst_rate_per_instance < 0:
        p.error("--inst-rate and --inst-rate-per-instance must be 0 (none) or positive")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks
    wall0, load_before = time.monotonic(), os.getloadavg()[0]
    out: dict[str, Any] = {}
    statements: dict[str, Any] = {}
    db = Db(args.statements)
    try:
        with tempfile.TemporaryDirectory(prefix="sdv-bench-pgserve-") as tmp:
            for name in only:
                say(f"== {name}")
                db.reset_statements()
                out[name] = PARTS[name](db, args, Path(tmp) / name)
                if args.statements:
                    statements[name] = db.top_statements()
        version = db.version
    finally:
        db.stop()
    out["meta"] = {
        "command": shlex.join(
            [".venv/bin/python", "-m", "bench.pg_serve", *(argv if argv is not None else sys.argv[1:])]
        ),
        "pg_version": version,
        "asyncpg": asyncpg.__version__,
        "grpc": grpc.__version__,
        **{
            k: getattr(args, k)
            for k in (
                "rounds",
                "clients",
                "ingest_clients",
                "ingest_rounds",
                "duration",
                "layouts",
                "inst_rate",
                "inst_rate_per_instance",
                "hb_duration",
                "subscribe_share",
                "ack_share",
                "work_share",
                "log_level",
                "seed",
            )
        },
        **machine_meta(load_before, wall0),
    }
    if statements:
        out["statements"] = statements
    print(markdown(out))
    out["summary"] = summarise(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
