"""A PostgreSQL failover under continuous ingest: shared by tests/integration/test_pg_failover.py and
bench/pg_failover.py.

`FailoverRig` runs a primary with a synchronous standby and `sdv-fanout serve` instances on the
multi-host store_url; `Driver` sends batches (a batch_id each) to every instance from threads of its
own and records each answer and when it came; `HealthWatch` samples the instances' gRPC health;
`fail_over` kills the primary and promotes the standby; `check_stored` reads back what the promoted
database holds of each batch. What to wait for, and what to assert or report, is the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testkit.harness import ExHookClient, SubprocessServer, poll
from testkit.pg_cluster import PgCluster, PgError, multi_host_dsn

#: A hook service: like "" (what readiness asks), it says whether batches can be stored now.
HOOK_SERVICE = "emqx.exhook.v3.HookProvider"
#: What liveness asks: SERVING while the process serves, whatever the database does.
PROCESS_SERVICE = "sdv_fanout.Process"
#: ExHookClient's deadline for a call: an error answer later than this is DEADLINE_EXCEEDED.
CLIENT_DEADLINE_S = 10.0


@dataclass(frozen=True)
class Batch:
    """One seed-000 batch: its own request_id, batch_id and payload (so its rows name one sha1)."""

    n: int
    vins: tuple[str, ...]

    @property
    def batch_id(self) -> str:
        return f"b-failover-{self.n}"

    @property
    def request_id(self) -> str:
        return f"task_ota_{self.n}"

    @property
    def data(self) -> str:
        return f"payload of batch {self.n}"

    @property
    def sha1(self) -> bytes:
        return hashlib.sha1(self.data.encode()).digest()


@dataclass(frozen=True)
class Call:
    """One OnMessagePublish of a batch and its answer (times from time.monotonic())."""

    batch: Batch
    instance: int
    started: float
    answered: float
    code: grpc.StatusCode  #: OK = acknowledged; DEADLINE_EXCEEDED = no answer within CLIENT_DEADLINE_S
    detail: str = ""  #: an error's details

    @property
    def ok(self) -> bool:
        return bool(self.code == grpc.StatusCode.OK)

    @property
    def seconds(self) -> float:
        return self.answered - self.started


def fleet(size: int) -> list[str]:
    """`size` distinct 17-character VINs."""
    return [f"LSVFAIL{i:010d}" for i in range(size)]


class Driver:
    """`per_instance` threads per server instance, each on a gRPC channel of its own (one of EMQX's
    pool connections), sending a new batch of `vins` VINs as soon as the last one was answered (then
    `pause_s`), until `stop()`. Every answer is recorded as a Call; `send` sends one more batch
    (a retry) from the caller's thread."""

    def __init__(
        self,
        ports: Sequence[int],
        *,
        per_instance: int = 2,
        vins: int = 200,
        fleet_size: int = 5000,
        pause_s: float = 0.0,
    ) -> None:
        self.ports = list(ports)
        self.per_instance = per_instance
        self.vins = vins
        self.pause_s = pause_s
        self._fleet = fleet(fleet_size)
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: dict[int, ExHookClient] = {}  # send()'s, one per instance

    def start(self) -> Driver:
        for instance, port in enumerate(self.ports):
            for k in range(self.per_instance):
                t = threading.Thread(target=self._run, args=(instance, port), name=f"driver-{instance}-{k}")
                t.start()
                self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop sending; waits for the calls in progress to be answered. Idempotent."""
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_DEADLINE_S + 5)
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def new_batch(self) -> Batch:
        with self._lock:
            n = next(self._numbers)
        return Batch(n, tuple(random.Random(n).sample(self._fleet, self.vins)))

    def send(self, batch: Batch, instance: int) -> Call:
        """One call of `batch` to `instance`, recorded like the threads' calls."""
        if instance not in self._clients:
            self._clients[instance] = ExHookClient(self.ports[instance])
        return self._call(self._clients[instance], batch, instance)

    def calls(self) -> list[Call]:
        """Every call answered so far, in the order of their answers."""
        with self._lock:
            return list(self._calls)

    def _run(self, instance: int, port: int) -> None:
        client = ExHookClient(port)
        try:
            while not self._stop.is_set():
                self._call(client, self.new_batch(), instance)
                if self.pause_s:
                    self._stop.wait(self.pause_s)
        finally:
            client.close()

    def _call(self, client: ExHookClient, batch: Batch, instance: int) -> Call:
        started = time.monotonic()
        detail = ""
        try:
            client.batch(list(batch.vins), batch.request_id, batch.data, batch_id=batch.batch_id)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code, detail = exc.code(), exc.details() or ""
        call = Call(batch, instance, started, time.monotonic(), code, detail)
        with self._lock:
            self._calls.append(call)
        return call


def acked(calls: Iterable[Call], *, started_after: float = float("-inf"), instance: int | None = None) -> list[Call]:
    """The acknowledged calls that started after `started_after` (of `instance`, or of any), by answer time."""
    return sorted(
        (c for c in calls if c.ok and c.started >= started_after and instance in (None, c.instance)),
        key=lambda c: c.answered,
    )


def never_acked(calls: Iterable[Call]) -> list[Batch]:
    """The batches none of whose calls was acknowledged (the platform would send them again), in order."""
    calls = list(calls)
    ok = {c.batch.n for c in calls if c.ok}
    return sorted({c.batch for c in calls if c.batch.n not in ok}, key=lambda b: b.n)


class HealthWatch:
    """Samples the gRPC health of each instance's hook service, "" and the process every `interval_s` from a
    thread of its own; `samples` holds (time, instance, service, status name) for each sample."""

    def __init__(self, ports: Sequence[int], interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in ports]
        self._lock = threading.Lock()
        self._samples: list[tuple[float, int, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-watch")

    def start(self) -> HealthWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15)
        for ch in self._channels:
            ch.close()

    def samples(self, instance: int, service: str = HOOK_SERVICE) -> list[tuple[float, str]]:
        with self._lock:
            return [(t, status) for t, i, s, status in self._samples if i == instance and s == service]

    def first(self, instance: int, status: str, after: float, service: str = HOOK_SERVICE) -> float | None:
        """When `status` was first seen at or after `after`; None if never."""
        return next((t for t, s in self.samples(instance, service) if t >= after and s == status), None)

    def _run(self) -> None:
        stubs = [health_pb2_grpc.HealthStub(ch) for ch in self._channels]
        while not self._stop.is_set():
            for instance, stub in enumerate(stubs):
                for service in ("", HOOK_SERVICE, PROCESS_SERVICE):
                    try:
                        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    except grpc.RpcError as exc:
                        status = f"rpc {exc.code().name}"
                    with self._lock:
                        self._samples.append((time.monotonic(), instance, service, status))
            self._stop.wait(self.interval_s)


class FailoverRig:
    """A primary with a synchronous standby (clusters of its own) and one `sdv-fanout serve` per
    entry of `instance_env` (one process each) on the multi-host store_url naming both. `stop()`
    leaves no server, no cluster and no dir behind."""

    def __init__(self, tmp: Path, instance_env: Sequence[dict[str, str]], name: str = "failover") -> None:
        tmp.mkdir(parents=True, exist_ok=True)  # the servers' logs and ready files go here
        self.primary = PgCluster.create(name=f"{name}-primary")
        self.standby: PgCluster | None = None
        self.servers: list[SubprocessServer] = []
        try:
            self.standby = self.primary.basebackup_standby(f"{name}_standby")
            self.store_url = multi_host_dsn(self.primary, self.standby)
            for i, env in enumerate(instance_env):
                settings = {"SDV_FANOUT_STORE_URL": self.store_url, "SDV_FANOUT_PROCESSES": "1", **env}
                self.servers.append(SubprocessServer(tmp / f"instance{i}", env=settings))
        except BaseException:
            self.stop()
            raise

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def stop_servers(self) -> None:
        """SIGTERM each instance (SIGKILL if it does not stop); their logs stay readable."""
        for server in self.servers:
            if server.proc.poll() is None:
                try:
                    server.terminate(20)
                except Exception:
                    server.kill()

    def stop(self) -> None:
        self.stop_servers()
        if self.standby is not None:
            self.standby.stop()
        self.primary.stop()

    def __enter__(self) -> FailoverRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Timeline:
    """When the primary was killed (the first SIGKILL), when every process of it was gone, when the
    promote started, and when the standby accepted writes (monotonic). A batch sent between the
    first two can still commit: its backend had not died yet."""

    killed: float
    dead: float
    promote_started: float
    promoted: float


def fail_over(rig: FailoverRig, before_promote: Callable[[float], None] | None = None) -> Timeline:
    """kill -9 the primary, call `before_promote(killed)` (what the outage must have shown first),
    then promote the standby."""
    assert rig.standby is not None
    killed = time.monotonic()
    rig.primary.kill()
    dead = time.monotonic()
    if before_promote is not None:
        before_promote(killed)
    promote_started = time.monotonic()
    asyncio.run(promote(rig.standby))
    return Timeline(killed, dead, promote_started, time.monotonic())


async def promote(standby: PgCluster, timeout_s: int = 30) -> None:
    """`pg_promote()`, waiting until the standby accepts writes. Not `PgCluster.promote()`: that
    forks pg_ctl and psql while the driver's threads are inside gRPC calls, and gRPC's fork
    handlers then may abort the child (seen: pg_ctl promote killed by SIGABRT, "Check failed:
    next_worker->state == KICKED" in ev_epoll1_linux.cc)."""
    conn = await asyncpg.connect(standby.admin_dsn, timeout=10)
    try:
        if not await conn.fetchval("SELECT pg_promote(true, $1)", timeout_s):
            raise PgError(f"{standby.name}: not promoted within {timeout_s} s\n{standby.log_tail()}")
    finally:
        await conn.close()
    standby.standby_of = None


def wait_acked(driver: Driver, count: int, *, started_after: float, instance: int, timeout_s: float) -> Call:
    """The first of `count` calls to `instance` started after `started_after` to be acknowledged."""

    def first_of_enough() -> Call | None:
        got = acked(driver.calls(), started_after=started_after, instance=instance)
        return got[0] if len(got) >= count else None

    return poll(first_of_enough, timeout_s=timeout_s, interval_s=0.02)  # type: ignore[no-any-return]


def events(server: SubprocessServer, name: str) -> list[dict[str, Any]]:
    """The server's log events called `name` so far (a line still being written is skipped)."""
    out = []
    for line in server.log().splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if doc.get("event") == name:
                out.append(doc)
    return out


def ingest_events(servers: Iterable[SubprocessServer]) -> tuple[Counter[str], Counter[str]]:
    """`batch_stored` events per request_id and `batch_duplicate` events per batch_id, over all servers."""
    stored: Counter[str] = Counter()
    duplicate: Counter[str] = Counter()
    for server in servers:
        stored.update(e["request_id"] for e in events(server, "batch_stored"))
        duplicate.update(e["batch_id"] for e in events(server, "batch_duplicate"))
    return stored, duplicate


@dataclass(frozen=True)
class Stored:
    """What the database holds of one batch: its receipt, its rows and its generation's count."""

    receipt: bool  #: a `batches` row for its batch_id naming its request_id and payload
    receipt_rows: int  #: the rows that receipt says were stored
    rows: int  #: rows of its request_id holding its payload
    total: int  #: its generation's `total` (a pair counted twice would show here)

    def whole(self, vins: int) -> bool:
        return self.receipt and self.receipt_rows == self.rows == self.total == vins


_STORED = """
SELECT b.batch_id,
       coalesce(r.request_id = b.request_id AND r.sha1 = b.sha1, false) AS receipt,
       coalesce(r.rows, 0) AS receipt_rows,
       (SELECT count(*) FROM rows w WHERE w.request_id = b.request_id AND w.sha1 = b.sha1) AS rows,
       coalesce((SELECT g.total FROM generations g WHERE g.request_id = b.request_id AND g.sha1 = b.sha1), 0)
           AS total
FROM unnest($1::text[], $2::text[], $3::bytea[]) AS b (batch_id, request_id, sha1)
LEFT JOIN batches r ON r.batch_id = b.batch_id
"""


def check_stored(dsn: str, batches: Sequence[Batch]) -> dict[int, Stored]:
    """What the database at `dsn` holds of each batch, by batch number."""

    async def read() -> list[Any]:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return list(
                await conn.fetch(
                    _STORED, [b.batch_id for b in batches], [b.request_id for b in batches], [b.sha1 for b in batches]
                )
            )
        finally:
            await conn.close()

    by_id = {b.batch_id: b.n for b in batches}
    return {
        by_id[r["batch_id"]]: Stored(r["receipt"], r["receipt_rows"], r["rows"], r["total"])
        for r in asyncio.run(read())
    }
