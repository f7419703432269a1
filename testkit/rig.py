"""The end-to-end rig of the benches: mosquitto, `sdv-fanout serve` with delivery on, a simulated
EMQX for the platform's publishes, and fleet processes (testkit/fleet.py) of sim or raw vehicles.

`run_ours` is one measured pass: B batches naming every VIN, timed from the first publish until
the store holds no row, with CPU per process group and the fleets' receive times."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import grpc

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
    descendants,
    pct,
    pending_rows,
    stop_server,
)

FLEET = [sys.executable, "-m", "testkit.fleet"]
MAX_PER_PROC = 300  # vehicles per fleet process: its one GIL carries their MQTT and hook calls
#: Loopback only, and no clash with another server on the default metrics port.
SERVER_ENV = {"SDV_FANOUT_METRICS_LISTEN": "127.0.0.1:0"}


def add_rig_options(
    p: argparse.ArgumentParser, *, vehicles: int, procs: int, deadline_s: float, seed: int, server_processes: int = 0
) -> None:
    """The options every bench on this rig takes (Rig and server_env read them), with its defaults."""
    p.add_argument("--vehicles", type=int, default=vehicles, help=f"online vehicles (default {vehicles})")
    p.add_argument("--procs", type=int, default=procs,
                   help=f"processes per fleet (default {procs}; <= {MAX_PER_PROC} vehicles each)")  # fmt: skip
    p.add_argument("--payload-bytes", type=int, default=256, help="delivered payload size (default 256)")
    own = server_processes or "theirs, one per CPU"
    p.add_argument("--server-processes", type=int, default=server_processes,
                   help=f"SDV_FANOUT_PROCESSES for the servers (default {own})")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=deadline_s,
                   help=f"give up on a phase after this (default {deadline_s:g})")  # fmt: skip
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level (default info, as in production)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--keep-tmp", action="store_true", help="keep the tmp dir (logs, LMDB) even after a successful run")


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
        #: More flags of the sim fleets (testkit/fleet.py), e.g. --response-bytes.
        self.sim_args: list[str] = []
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
        extra = ["--exhook-port", str(self.server.port), "--delivery-clientid", self.delivery_clientid, *self.sim_args]
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
