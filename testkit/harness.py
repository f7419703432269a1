"""Test harness: a real server (in-process thread or subprocess) and a client that calls it as EMQX does.

The client plays EMQX's side of ExHook with the project's generated v3 classes;
tests/wire.py has an independent encoder for the wire-conformance tests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from exhook_server._proto import exhook_v3_pb2 as pb
from exhook_server.config import Config
from exhook_server.server import FanoutServer
from storage.lmdb.store import now_ms

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def poll(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.01) -> Any:
    """Return predicate()'s first truthy value, or fail after timeout_s (never a bare sleep). The
    default deadline is generous: a passing wait costs what the condition takes, and on 2 loaded
    cores with tests running side by side a few-ms condition has been seen to take seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


class StepClock:
    """A wall clock in ms that moves only when the test says so: TTLs and deadlines judged by it
    cannot race the machine's clock. Starts at the real time, so stamps look like real ones."""

    def __init__(self, start_ms: int | None = None) -> None:
        self.ms = now_ms() if start_ms is None else start_ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += round(seconds * 1000)


def alive(pid: int) -> bool:
    """Is `pid` a running process (a zombie waiting for its reaper does not count)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


class ExHookClient:
    """Calls HookProvider RPCs over a real loopback channel, the way EMQX's pool does."""

    def __init__(self, port: int, package: str = "v3") -> None:
        # EMQX's client takes echoed payloads of any size; so must ours.
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_receive_message_length", -1),
                ("grpc.max_send_message_length", -1),
                # Its own TCP connection, as each of EMQX's pool workers has (gRPC would share one).
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        self.package = package

    def call(self, method: str, request: Any, timeout_s: float = 10.0) -> Any:
        response_cls: Any = {
            "OnProviderLoaded": pb.LoadedResponse,
            "OnClientAuthenticate": pb.ValuedResponse,
            "OnClientAuthorize": pb.ValuedResponse,
            "OnMessagePublish": pb.ValuedResponse,
        }.get(method, pb.EmptySuccess)
        stub = self.channel.unary_unary(
            f"/emqx.exhook.{self.package}.HookProvider/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        return stub(request, timeout=timeout_s)

    def publish(self, topic: str, payload: bytes, sender: str = "sdv-platform", username: str = "platform") -> Any:
        """OnMessagePublish with a message shaped like EMQX's (id, node, headers, timestamp)."""
        msg = pb.Message(
            node="emqx@127.0.0.1",
            id=os.urandom(16).hex().upper(),
            qos=1,
            topic=topic,
            payload=payload,
            timestamp=int(time.time() * 1000),
            headers={"username": username, "protocol": "mqtt", "peerhost": "127.0.0.1"},
        )
        setattr(msg, "from", sender)
        req = pb.MessagePublishRequest(
            message=msg, meta=pb.RequestMeta(node="emqx@127.0.0.1", version="5.8.9", cluster_name="emqxcl")
        )
        return self.call("OnMessagePublish", req)

    def batch(
        self, vins: list[str], request_id: str, data: str | bytes, *, topic: str = "$SDV-FANOUT", **extra: Any
    ) -> Any:
        """Publish a seed-000 batch; bytes data goes base64 encoded."""
        doc: dict[str, Any] = {"ids": vins, "request_id": request_id}
        if isinstance(data, bytes):
            doc.update(data=base64.b64encode(data).decode(), data_encoding="base64")
        else:
            doc["data"] = data
        doc.update(extra)
        return self.publish(topic, json.dumps(doc).encode())

    def close(self) -> None:
        self.channel.close()


@dataclass
class InProcessServer:
    """A FanoutServer on its own event loop in a background thread."""

    cfg: Config
    #: The server's wall clock in ms (FanoutServer's `clock`): tests that step time pass their own.
    clock: Callable[[], int] = now_ms
    server: FanoutServer | None = None
    port: int = 0
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _thread: threading.Thread | None = None

    def start(self) -> InProcessServer:
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self.server = FanoutServer(self.cfg, clock=self.clock)
                self.port = self._loop.run_until_complete(self.server.start())
            except BaseException as exc:  # surfaced to the test below
                errors.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fanout-server", daemon=True)
        self._thread.start()
        started.wait(30)
        if errors:
            raise errors[0]
        return self

    def run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def store(self):  # type: ignore[no-untyped-def]
        """The LMDB store (LMDB mode only; store-neutral tests use `pending`, `stats`)."""
        assert self.server is not None and self.server.store is not None, "this server runs on PostgreSQL"
        return self.server.store

    def pending(self, vin: str) -> list[Any]:
        """The vehicle's pending rows in delivery order, from whichever store the server uses."""
        assert self.server is not None
        rows, _ = self.run(self.server.reads.vehicle(vin, 1))
        return rows  # type: ignore[no-any-return]

    def stats(self) -> Any:
        """The store's counts (`Reads.stats`), whichever store the server uses."""
        assert self.server is not None
        return self.run(self.server.reads.stats())

    def generations(self, request_id: str) -> list[Any]:
        """The request's generations (`Reads.generations`), whichever store."""
        assert self.server is not None
        return self.run(self.server.reads.generations(request_id))  # type: ignore[no-any-return]

    def vehicle_outcomes(self, vin: str, limit: int = 1000) -> list[Any]:
        """The vehicle's outcome records, whichever store."""
        assert self.server is not None
        _, found = self.run(self.server.reads.vehicle(vin, limit))
        return found  # type: ignore[no-any-return]

    def cancels_in_progress(self) -> list[str]:
        """Cancels of every vehicle with chunks to go, whichever store."""
        assert self.server is not None
        return self.run(self.server.ingestor._writes.cancels_in_progress())  # type: ignore[no-any-return]

    def in_flight(self, vin: str) -> Any:
        """The vehicle's delivery in flight (a worker.InFlight, or None), whichever store."""
        assert self.server is not None
        _, entry = self.run(self.server.dispatcher.vehicle_state(vin))
        return entry

    def vehicles_at(self, bound: int) -> int:
        assert self.server is not None
        return self.run(self.server.reads.vehicles_at(bound))  # type: ignore[no-any-return]

    def counts_and_recount(self) -> tuple[dict[tuple[str, bytes], dict[str, int]], dict[Any, Any]]:
        """(every generation's stored counts, the counts rebuilt from rows and outcomes alone):
        equal whenever the store's bookkeeping is right."""
        assert self.server is not None
        stored = {(g.request_id, g.sha1): g.counts for g in self.run(self.server.reads.all_generations())}
        if self.server.store is not None:
            from storage.lmdb import outcomes

            with self.server.store.read() as txn:
                return stored, outcomes.recount(txn, self.server.store.tables)

        async def pg_recount() -> Any:
            from storage.postgres import outcomes as pg_outcomes

            async with self.server.pool.acquire() as conn:  # type: ignore[union-attr]
                return await pg_outcomes.recount(conn)

        return stored, self.run(pg_recount())

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop(grace_s=1.0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()


class SubprocessServer:
    """`sdv-fanout serve` as a real child process, for kill -9 and CLI tests."""

    def __init__(
        self, data_dir: Path, *extra: str, env: dict[str, str] | None = None, inherit_env: bool = True
    ) -> None:
        """`env` adds to this process's environment and to the test defaults below (no broker,
        admin and metrics on free loopback ports); with `inherit_env` False it is the whole
        environment but PATH (give the addresses as flags in `extra`)."""
        self.data_dir = data_dir
        self.pids: list[int] = []
        self.ready = data_dir.parent / f"ready-{os.getpid()}-{time.monotonic_ns()}.json"
        self.log_path = data_dir.parent / f"server-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [
                str(BIN / "sdv-fanout"),
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                str(data_dir),
                "--ready-file",
                str(self.ready),
                "--log-format",
                "json",
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "SDV_FANOUT_MQTT_URL": "",
                "SDV_FANOUT_METRICS_LISTEN": "127.0.0.1:0",
                "SDV_FANOUT_ADMIN_LISTEN": "127.0.0.1:0",  # tests run side by side: never the fixed 9001
                **(env or {}),
            }
            if inherit_env
            else {"PATH": os.environ.get("PATH", ""), **(env or {})},
        )
        try:
            info = poll(self._read_ready, timeout_s=30)
        except AssertionError:
            self.kill()
            raise AssertionError(f"server did not start:\n{self.log()}") from None
        self.port: int = info["port"]
        self.metrics_port: int = info["metrics_port"]
        #: The Admin API's port (0 when admin_listen is empty).
        self.admin_port: int = info["admin_port"]
        #: The server processes under the parent when it runs several (SDV_FANOUT_PROCESSES).
        self.pids = info.get("pids", [])

    def _read_ready(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return json.loads(self.ready.read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def events(self) -> Iterator[dict[str, Any]]:
        for line in self.log().splitlines():
            if line.startswith("{"):
                yield json.loads(line)

    def logged(self, event: str) -> bool:
        """Has the server logged `event`? (A line still being written is skipped.)"""
        for line in self.log().splitlines():
            try:
                if json.loads(line).get("event") == event:
                    return True
            except ValueError:
                continue
        return False

    def kill(self) -> None:
        """kill -9: no chance to flush or close anything."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        poll(lambda: not any(map(alive, self.pids)))  # they die with the parent (PR_SET_PDEATHSIG)
        self._log.close()

    def terminate(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout_s)
        assert not any(map(alive, self.pids)), "server processes outlived their parent"
        self._log.close()
        return code


def admin_stats(channel: grpc.Channel) -> Any:
    """Admin GetStats over `channel` (plaintext or TLS: the caller picks the credentials)."""
    from exhook_server._proto import admin_pb2

    return admin_call(channel, "GetStats", admin_pb2.GetStatsRequest())


def admin_call(target: int | grpc.Channel, method: str, request: Any) -> Any:
    """One Admin RPC (`method`, its reply type read from the service descriptor) on a plaintext
    listener's port of 127.0.0.1, or over `channel`."""
    from exhook_server._proto import admin_pb2

    if isinstance(target, int):
        with grpc.insecure_channel(f"127.0.0.1:{target}") as channel:
            return admin_call(channel, method, request)
    reply = admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name[method].output_type.name
    stub = target.unary_unary(
        f"/sdv.fanout.v1.Admin/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=getattr(admin_pb2, reply).FromString,
    )
    return stub(request, timeout=10)


def put(writer: Any, store: Any, vins: list[str], rid: str, blob: bytes, at: int) -> None:
    """Store one seed-format batch directly (no gRPC), committed, with row timestamp `at` (ms)."""
    import functools

    from storage.lmdb import batches

    writer.submit(
        functools.partial(batches.store_batch, t=store.tables, vins=vins, request_id=rid, blob=blob, now_ms=at)
    ).result()


def signal_all(srv: SubprocessServer, sig: int) -> None:
    """`sig` to the instance's every process (SIGSTOP of a parent alone stops no server child)."""
    for pid in {srv.proc.pid, *srv.pids}:
        os.kill(pid, sig)


def stop(srv: SubprocessServer) -> None:
    """Whatever state it is in (running, stopped, killed): gone and reaped afterwards; a drain
    that overruns its shutdown timeout is a failure (after a kill -9)."""
    if srv.proc.poll() is not None:
        srv.kill()  # already dead: reaps it and closes its log
        return
    signal_all(srv, signal.SIGCONT)
    try:
        srv.terminate(timeout_s=15)
    except BaseException:
        srv.kill()
        raise


def metric(srv: SubprocessServer, name: str, labels: str = "") -> float:
    """A counter or gauge from the instance's /metrics, summed over the series whose labels
    contain `labels` (e.g. 'purpose="batch_filter"')."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == name and labels in line
    )


class Throttle:
    """True at most once per period (a vehicle's heartbeat interval)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.period_s
        return True


def fill_rows(port: int, rows: int, request_id: str, prefix: str, clients: int = 4, chunk: int = 1_000) -> None:
    """`rows` pending rows of `request_id` (VINs `prefix` + a zero-padded number, 17 characters),
    in batches of `chunk` VINs from `clients` ExHook channels in parallel."""
    chans = [ExHookClient(port) for _ in range(clients)]
    width = 17 - len(prefix)
    try:

        def one(n: int) -> None:
            vins = [f"{prefix}{i:0{width}d}" for i in range(n * chunk, min(rows, (n + 1) * chunk))]
            chans[n % clients].batch(vins, request_id, "firmware-x")

        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(-(-rows // chunk))))
    finally:
        for c in chans:
            c.close()
