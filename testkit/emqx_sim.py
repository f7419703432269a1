"""Play EMQX's side of ExHook honestly: real MQTT through mosquitto, hook calls as EMQX makes them.

EMQX cannot run here, so tests split its two jobs:

* a real **mosquitto** broker (`Mosquitto`) carries every MQTT packet: vehicles are
  testkit/vehicle.py's MQTT 5 clients, and the server under test publishes its deliveries to
  mosquitto with its own client;
* a **driver** (`FakeEmqx` / `Vehicle`) calls the server's HookProvider RPCs at the moments, in the
  order and with the field values EMQX 5 would (docs/exhook-interface.md §1, §4 and the orders
  observed on real EMQX brokers in §6), deriving what it can from what mosquitto really did
  (CONNACK session-present, the vehicle's real TCP port, every PUBLISH the vehicle really got).

What is EMQX-like on purpose:

* `load()` calls OnProviderLoaded and, like EMQX, afterwards only calls the hooks the server listed,
  with the `topics` filters of the four message hooks (`+`/`#` do not match `$` topics; `$SYS/` is
  never sent). Before `load()` (or after `unload()`) no hook is called at all.
* Hooks of one clientid run one after another, in the order their causes happened (EMQX runs
  them in the client's channel process); different clientids run in parallel. A client's hook jobs
  form a lane run by whichever thread finds it idle (a channel thread for what mosquitto did, as
  the MQTT loop every vehicle shares must not wait on an RPC; the test's thread for what the test
  did).
  Takeover/discard hooks of an old connection run in the new connection's lane, so their order is
  exact.
* RPCs go over a pool of `pool_size` (8, EMQX's default) channels, each its own TCP connection,
  picked by clientid as EMQX's `key_dispatch` does: one client's calls share one connection.
  Given several exhook ports (instances behind one Service), each connection is on one instance,
  or (routing="random") each call goes to a random one; an instance found down or hung fails
  that call and is left for the others (testkit/exhook_pool.py).
* Vehicle events over MQTT (`vehicle_events = mqtt`): the server then lists no heartbeat, answer
  or PUBACK hook, so none is called; heartbeats and answers reach its `$share/<group>/...`
  subscription through mosquitto, and `add_rule(rule_body(cfg))` (what `emqx sync` installs) makes
  each vehicle PUBACK of a delivery the ack rule's message to its publisher (testkit/emqx_rules.py).
* A failed RPC does not stop the MQTT side (EMQX logs it and goes on): it is stored in
  `FakeEmqx.rpc_errors`, and `close()` fails the test for it unless `strict_rpc=False`.
* Everything the harness itself gets wrong (an exception in an MQTT callback or in a hook job, or a
  server answer the simulation cannot honour) goes to `FakeEmqx.errors`; `check()` / `close()`
  raise it in the test.

Known gaps (mosquitto cannot tell us, or EMQX behaviour we do not model):

* Connections the driver does not own (the server's own delivery client, raw MQTT clients of a
  test) get no client/session hooks, and their subscriptions are unknown, so `message.dropped`
  ("no_subscribers") only looks at the vehicles' subscriptions.
* `message.publish` for a delivery published by the server is called when the vehicle first
  receives it (EMQX calls it when the message is published, which is earlier if the vehicle was
  offline). If the server denies or rewrites such a message, mosquitto has already routed it: this
  is reported in `errors`.
* With several instances, every delivery's `Message.from` is `delivery_clientid`: mosquitto does
  not say which instance's delivery client published it (the server matches acks by the clientid
  prefix, so any instance's deliveries are recognised).
* The ack rule's output goes to `<ack prefix>/<delivery_clientid>` (the `Message.from` above): with
  several instances, or a server whose delivery client id the test does not pass, the acks reach
  no delivery client of the right instance, so the MQTT-events mode needs one in-process server.
* mosquitto runs no ACL: a vehicle may heartbeat or answer as another VIN over MQTT (EMQX refuses
  it under deploy/emqx/acl.conf), so forged events over MQTT are tested on real EMQX only.
* `client.authenticate` / `client.authorize` are never called (the product must not register them,
  see §7); registering them is reported in `errors`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import hashlib
import heapq
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NamedTuple, TypeVar

import grpc

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit import mqtt, vehicle
from testkit.emqx_rules import RuleEngine, topic_matches
from testkit.exhook_pool import ExHookPool, Routing, accepts_tcp
from testkit.harness import ExHookClient, poll
from testkit.mqtt import TIMEOUT_S, run

T = TypeVar("T")
MOSQUITTO_BIN = "/usr/sbin/mosquitto"
LOOPBACK = "127.0.0.1"

#: hook name -> (HookProvider rpc, request class); the 19 names EMQX knows (§1.2).
HOOK_RPC: dict[str, tuple[str, type[Any]]] = {
    "client.connect": ("OnClientConnect", pb.ClientConnectRequest),
    "client.connack": ("OnClientConnack", pb.ClientConnackRequest),
    "client.connected": ("OnClientConnected", pb.ClientConnectedRequest),
    "client.disconnected": ("OnClientDisconnected", pb.ClientDisconnectedRequest),
    "client.authenticate": ("OnClientAuthenticate", pb.ClientAuthenticateRequest),
    "client.authorize": ("OnClientAuthorize", pb.ClientAuthorizeRequest),
    "client.subscribe": ("OnClientSubscribe", pb.ClientSubscribeRequest),
    "client.unsubscribe": ("OnClientUnsubscribe", pb.ClientUnsubscribeRequest),
    "session.created": ("OnSessionCreated", pb.SessionCreatedRequest),
    "session.subscribed": ("OnSessionSubscribed", pb.SessionSubscribedRequest),
    "session.unsubscribed": ("OnSessionUnsubscribed", pb.SessionUnsubscribedRequest),
    "session.resumed": ("OnSessionResumed", pb.SessionResumedRequest),
    "session.discarded": ("OnSessionDiscarded", pb.SessionDiscardedRequest),
    "session.takenover": ("OnSessionTakenover", pb.SessionTakenoverRequest),
    "session.terminated": ("OnSessionTerminated", pb.SessionTerminatedRequest),
    "message.publish": ("OnMessagePublish", pb.MessagePublishRequest),
    "message.delivered": ("OnMessageDelivered", pb.MessageDeliveredRequest),
    "message.acked": ("OnMessageAcked", pb.MessageAckedRequest),
    "message.dropped": ("OnMessageDropped", pb.MessageDroppedRequest),
}
MESSAGE_HOOKS = frozenset({"message.publish", "message.delivered", "message.acked", "message.dropped"})
NOT_SIMULATED_HOOKS = frozenset({"client.authenticate", "client.authorize"})
BROKER_VERSION = {"v2": "5.8.9", "v3": "5.9.1"}


class SimulationError(AssertionError):
    """The harness could not play EMQX's part faithfully (or crashed while trying)."""


#: Where `free_ports` picks: below the kernel's ephemeral range (ip_local_port_range), from which
#: every outgoing connection of every process on the machine takes its local port. A port picked
#: by bind(0) comes from that range too, and a client connecting anywhere could take it between
#: our pick and the broker's bind (an EMQX 5.9.1 found its distribution port "in use" so).
_PICK_FROM, _PICK_BELOW = 10_000, 32_768


def _pick_range() -> tuple[int, int]:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = _PICK_BELOW
    return _PICK_FROM, max(_PICK_FROM + 1_000, min(low, 65_536))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see `free_ports`)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago, picked at random outside
    the ephemeral range (no outgoing connection takes them meanwhile; see `_PICK_FROM`). All are
    held at once while they are picked: the same port is never given twice (an EMQX once got the
    same port for its dashboard and its RPC server, and did not boot)."""
    low, high = _pick_range()
    pick = random.SystemRandom()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(1_000):
            if len(ports) == n:
                return ports
            port = pick.randrange(low, high)
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue  # taken (or in TIME_WAIT): another
            ports.append(port)
        raise OSError(f"no {n} free ports on {LOOPBACK} in [{low}, {high})")


# ---------------------------------------------------------------------------------------------
# mosquitto
# ---------------------------------------------------------------------------------------------


class Mosquitto:
    """A real mosquitto 2 broker on 127.0.0.1, started and stopped by the test.

    Logs (stderr of the process) go to `log_path` in tmp_dir; restarts append to the same file.
    `max_inflight_messages` defaults to 32 like EMQX's `mqtt.max_inflight`; 0 means unlimited.
    """

    def __init__(
        self,
        tmp_dir: Path,
        port: int | None = None,
        *,
        max_inflight_messages: int = 32,
        max_queued_messages: int = 10000,
        verbose: bool = True,
        binary: str = MOSQUITTO_BIN,
    ) -> None:
        self.tmp_dir = Path(tmp_dir)
        self.port: int = port if port is not None else free_port()
        self.max_inflight_messages = max_inflight_messages
        self.max_queued_messages = max_queued_messages
        self.verbose = verbose
        self.binary = binary
        self.conf_path = self.tmp_dir / f"mosquitto-{self.port}.conf"
        self.log_path = self.tmp_dir / f"mosquitto-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """`mqtt://127.0.0.1:<port>`."""
        return f"mqtt://{LOOPBACK}:{self.port}"

    @property
    def running(self) -> bool:
        """True while the broker process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def _config(self) -> str:
        log_types = ["error", "warning", "notice", "information", "subscribe", "unsubscribe"]
        if self.verbose:
            log_types.append("debug")
        lines = [
            f"listener {self.port} {LOOPBACK}",
            "allow_anonymous true",
            "persistence false",
            f"max_inflight_messages {self.max_inflight_messages}",
            f"max_queued_messages {self.max_queued_messages}",
            "set_tcp_nodelay true",
            "connection_messages true",
            "log_dest stderr",  # the process's stderr is our log file: no permission games as root
            "log_timestamp true",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
            *(f"log_type {t}" for t in log_types),
        ]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        """Write the config, start the broker and wait until it accepts TCP connections."""
        if self.running:
            raise RuntimeError(f"mosquitto already running on {self.port}")
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self._config())
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        offset = self._log.tell()
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        marker = f"listen socket on port {self.port}"

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}:\n{self.log()}")
            return marker in self.log(offset) and accepts_tcp(self.port)

        try:
            poll(ready, timeout_s=timeout_s, interval_s=0.02)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after timeout_s; always waits for the process."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, timeout_s: float = 10.0) -> Mosquitto:
        """A broker restart on the same port: every connection and (non-persisted) session is lost."""
        self.stop()
        return self.start(timeout_s)

    def log(self, offset: int = 0) -> str:
        """The broker log from byte offset (all of it by default)."""
        if self._log is not None:
            self._log.flush()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> Mosquitto:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_mosquitto(tmp_dir: Path, **kwargs: Any) -> Iterator[Mosquitto]:
    """A started Mosquitto (free port) that is stopped on exit."""
    broker = Mosquitto(tmp_dir, **kwargs).start()
    try:
        yield broker
    finally:
        broker.stop()


# ---------------------------------------------------------------------------------------------
# the EMQX side
# ---------------------------------------------------------------------------------------------


class Received(NamedTuple):
    """One PUBLISH a vehicle received (recorded once its delivered/acked hooks ran); `mid` is its
    packet id, `time` when it was read (time.time())."""

    topic: str
    payload: bytes
    mid: int
    time: float

    @property
    def request_id(self) -> str:
        return self.topic.rsplit("/", 1)[-1]


class Acked(NamedTuple):
    """One PUBACK a vehicle sent; `time` (time.time()) is taken just before it is sent, so a
    PUBLISH received before it was received while this one was still unacknowledged."""

    topic: str
    payload: bytes
    mid: int
    time: float


@dataclass
class HookCall:
    """One RPC the driver made (or tried): hook name, rpc, request, response (None on failure)."""

    hook: str
    method: str
    request: Any
    response: Any


class _Guid:
    """EMQX-like message ids: 64-bit µs timestamp, 48-bit node/pid hash, 16-bit sequence; 32 hex."""

    def __init__(self, node: str) -> None:
        digest = hashlib.sha1(f"{node}/{os.getpid()}/{id(self)}".encode()).digest()
        self._npid = int.from_bytes(digest[:6], "big")
        self._seq = itertools.count()

    def next(self) -> str:
        return f"{time.time_ns() // 1000:016X}{self._npid:012X}{next(self._seq) & 0xFFFF:04X}"


#: The properties a CONNACK may carry (MQTT 5 §3.2.2.3), by id, as EMQX names them.
_CONNACK_PROPERTY = {
    0x11: "Session-Expiry-Interval", 0x12: "Assigned-Client-Identifier", 0x13: "Server-Keep-Alive",
    0x15: "Authentication-Method", 0x16: "Authentication-Data", 0x1A: "Response-Information",
    0x1C: "Server-Reference", 0x1F: "Reason-String", 0x21: "Receive-Maximum", 0x22: "Topic-Alias-Maximum",
    0x24: "Maximum-QoS", 0x25: "Retain-Available", 0x27: "Maximum-Packet-Size",
    0x28: "Wildcard-Subscription-Available", 0x29: "Subscription-Identifier-Available",
    0x2A: "Shared-Subscription-Available",
}  # fmt: skip
#: CONNACK reason codes of a refusal (MQTT 5 §3.2.2.2), as EMQX's result_code spells them.
_REFUSED = {
    0x80: "unspecified_error", 0x81: "malformed_packet", 0x82: "protocol_error",
    0x83: "implementation_specific_error", 0x84: "unsupported_protocol_version",
    0x85: "client_identifier_not_valid", 0x86: "bad_user_name_or_password", 0x87: "not_authorized",
    0x88: "server_unavailable", 0x89: "server_busy", 0x8A: "banned", 0x8C: "bad_authentication_method",
    0x90: "topic_name_invalid", 0x95: "packet_too_large", 0x97: "quota_exceeded", 0x99: "payload_format_invalid",
    0x9A: "retain_not_supported", 0x9B: "qos_not_supported", 0x9C: "use_another_server", 0x9D: "server_moved",
    0x9F: "connection_rate_exceeded",
}  # fmt: skip


def _props(properties: dict[int, Any]) -> list[pb.Property]:
    """A CONNACK's properties as EMQX passes them (User-Property left out: it goes elsewhere in v3)."""
    return [
        pb.Property(name=_CONNACK_PROPERTY[pid], value=v if isinstance(v, bytes) else str(v).encode())
        for pid, v in sorted(properties.items())
        if pid in _CONNACK_PROPERTY
    ]


def _result_code(rc: int) -> str:
    return "success" if rc < 0x80 else _REFUSED.get(rc, f"reason_0x{rc:02x}")


class Acker:
    """One thread that runs the PUBACKs vehicles hold back (no thread per vehicle): each `fn`
    runs `delay_s` after `later()`, in due order; after `stop()` nothing more runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None  # started by the first later()

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._stopped:
                return
            heapq.heappush(self._due, (time.monotonic() + delay_s, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vehicle-acker", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cond.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._stopped:
                    return
                _, _, fn = heapq.heappop(self._due)
            fn()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._due.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)


class _Lane:
    """The hook jobs of one clientid, run one at a time in the order they were submitted."""

    __slots__ = ("busy", "jobs", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: (future, or None for a job nobody waits for, function, arguments)
        self.jobs: deque[tuple[Future[Any] | None, Callable[..., Any], tuple[Any, ...]]] = deque()
        #: A thread is running this lane's jobs (it runs the ones queued meanwhile too).
        self.busy = False


class _Sub:
    """One SUBSCRIBE of a connection, until its SUBACK's hook job is queued."""

    __slots__ = ("job", "opts", "suback", "topic")

    def __init__(self, topic: str, opts: pb.SubOpts) -> None:
        self.topic = topic
        self.opts = opts
        self.suback: asyncio.Future[list[int]]  # set on the loop, with the SUBSCRIBE sent
        self.job: Future[None] | None = None


class _Conn:
    """One MQTT connection of a vehicle whose CONNACK came = one EMQX channel (state:
    connecting/open/idle/gone)."""

    def __init__(self, vehicle: Vehicle, link: mqtt.Connection) -> None:
        self.vehicle = vehicle
        self.link = link
        self.persistent = vehicle.persistent
        self.expiry_s = vehicle.session_expiry_s
        self.state = "connecting"  # changed only by jobs in the clientid's lane (and broker_lost)
        self.dropping = False  # we are tearing the socket down: no more PUBACKs
        self.session_present, self.reason_code = link.connack.result()
        self.connack_props = _props(link.connack_props)
        sockname = link.transport.get_extra_info("sockname") if link.transport is not None else None
        self.peerport = int(sockname[1]) if sockname else 0
        node, port, clientid, username = vehicle.emqx.node, vehicle.emqx.mqtt_port, vehicle.clientid, vehicle.username
        self.conninfo = pb.ConnInfo(
            node=node,
            clientid=clientid,
            username=username,
            peerhost=LOOPBACK,
            sockport=port,
            proto_name="MQTT",
            proto_ver="5",
            keepalive=vehicle.keepalive,
            peerport=self.peerport,
        )
        self.clientinfo = pb.ClientInfo(
            node=node,
            clientid=clientid,
            username=username,
            peerhost=LOOPBACK,
            sockport=port,
            protocol="mqtt",
            mountpoint="",
            anonymous=True,
            peerport=self.peerport,
        )
        self.subscriptions: dict[str, pb.SubOpts] = {}
        self.expiry_timer: threading.Timer | None = None
        self.lock = threading.Lock()  # orders subscribe() bookkeeping vs the SUBACK's job
        self.subs: list[_Sub] = []
        self.connect_job: Future[None] | None = None

    @property
    def closed(self) -> bool:
        """The TCP connection is gone."""
        return self.link.is_closed


class FakeEmqx:
    """Drives a HookProvider server the way an EMQX node would, next to a real mosquitto.

    Every request carries RequestMeta(node, version, "EMQX", cluster_name); the broker version is
    5.8.9 for the v2 package and 5.9.1 for v3. Call `load()` first: like EMQX, only hooks the server
    registered are called. `close()` stops every vehicle and raises if the harness saw errors.
    """

    def __init__(
        self,
        exhook_port: int | Sequence[int],
        mqtt_port: int,
        package: str = "v3",
        node: str = "emqx@127.0.0.1",
        cluster_name: str = "emqxcl",
        delivery_prefix: str = "sdv-fanout-",
        request_prefix: str = "agent/{VIN}/proxy/request",
        *,
        delivery_clientid: str | None = None,
        delivery_headers: dict[str, str] | None = None,
        request_timeout_s: float = 5.0,
        strict_rpc: bool = True,
        job_timeout_s: float = 30.0,
        pool_size: int = 8,
        routing: Routing = "per_client",
        seed: int | None = None,
    ) -> None:
        if package not in BROKER_VERSION:
            raise ValueError(f"package must be one of {sorted(BROKER_VERSION)}")
        #: The server instances behind EMQX's one ExHook URL (one port: a single server).
        self.exhook_ports = [exhook_port] if isinstance(exhook_port, int) else list(exhook_port)
        self.exhook_port = self.exhook_ports[0]
        self.mqtt_port = mqtt_port
        self.package = package
        self.node = node
        self.cluster_name = cluster_name
        self.version = BROKER_VERSION[package]
        self.delivery_prefix = delivery_prefix
        self.request_prefix = request_prefix
        #: `Message.from` of deliveries the vehicles receive (the server's own MQTT client id).
        self.delivery_clientid = delivery_clientid or delivery_prefix + "test"
        #: EMQX exports username/protocol/peerhost of the publishing MQTT connection (§2.5).
        self.delivery_headers = (
            dict(delivery_headers) if delivery_headers is not None else {"protocol": "mqtt", "peerhost": LOOPBACK}
        )
        self.request_timeout_s = request_timeout_s
        self.strict_rpc = strict_rpc
        self.job_timeout_s = job_timeout_s
        #: EMQX's pool: `pool_size` connections, a client's calls over the one its clientid picks,
        #: each connection on one instance (or, routing="random", a random instance per call).
        self.exhook = ExHookPool(self.exhook_ports, package, pool_size, routing, seed)
        #: Called with (rpc, seconds) after each hook RPC, answered or failed (e.g. by a benchmark).
        self.on_rpc: Callable[[str, float], None] | None = None
        self.meta = pb.RequestMeta(node=node, version=self.version, sysdescr="EMQX", cluster_name=cluster_name)
        self.hooks: dict[str, list[str]] | None = None  # registered hook -> topic filters
        self.calls: deque[HookCall] = deque(maxlen=100_000)
        self.errors: list[BaseException] = []
        self.rpc_errors: list[tuple[str, grpc.RpcError]] = []
        self.vehicles: list[Vehicle] = []
        self._started = time.monotonic()
        self._guid = _Guid(node)
        self._lock = threading.Lock()
        self._channels: dict[str, _Conn] = {}  # clientid -> live or idle (persistent) channel
        self._lanes: dict[str, _Lane] = {}
        self._inflight: dict[tuple[str, str, bytes], pb.Message] = {}  # unacked deliveries
        self._acker = Acker()
        #: Threads that run the held-back PUBACKs' hook jobs (each vehicle's in its lane's order).
        #: In EMQX each client's hooks run in its own channel process: a hook call hung on a stopped
        #: instance delays that client's PUBACK, never everyone's. Run on the Acker's one thread,
        #: such a call held every vehicle's PUBACK for the request timeout (seen as deliveries
        #: re-sent after the in-flight timeout fleet-wide in the SIGSTOP test).
        self._channel_threads = ThreadPoolExecutor(64, thread_name_prefix="emqx-channel")
        #: The rule engine: the rules `add_rule` installed, run on each PUBACK.
        self.rules = RuleEngine(mqtt_port)
        self._closed = False

    @property
    def client(self) -> ExHookClient:
        """The pool connection (and instance) that provider calls go over."""
        return self.exhook.client(*self.exhook.route(""))

    # -- provider lifecycle ------------------------------------------------------------------

    def load(self) -> pb.LoadedResponse:
        """OnProviderLoaded; remember the hookspecs (an unknown hook name fails the load, as in EMQX)."""
        now = datetime.now(UTC)
        broker = pb.BrokerInfo(
            version=self.version,
            sysdescr="EMQX",
            uptime=int((time.monotonic() - self._started) * 1000),
            datetime=now.strftime("%Y-%m-%dT%H:%M:%S") + f".{now.microsecond:06d}000+00:00",
        )
        req = pb.ProviderLoadedRequest(broker=broker, meta=self.meta)
        resp: pb.LoadedResponse = self.exhook.call("OnProviderLoaded", req, self.request_timeout_s)
        self.calls.append(HookCall("provider.loaded", "OnProviderLoaded", req, resp))
        hooks: dict[str, list[str]] = {}
        for spec in resp.hooks:
            if spec.name not in HOOK_RPC:
                self.hooks = None
                raise SimulationError(f"unknown_hookpoint {spec.name!r}: EMQX would refuse to load the provider")
            if spec.name in NOT_SIMULATED_HOOKS:
                self.errors.append(SimulationError(f"{spec.name} is registered but not simulated (see §7)"))
            hooks[spec.name] = list(spec.topics) if spec.name in MESSAGE_HOOKS else []
        self.hooks = hooks
        return resp

    def unload(self) -> pb.EmptySuccess | None:
        """OnProviderUnloaded (errors ignored, as EMQX does); no hook is called afterwards."""
        self.hooks = None
        req = pb.ProviderUnloadedRequest(meta=self.meta)
        try:
            resp: pb.EmptySuccess | None = self.exhook.call("OnProviderUnloaded", req, self.request_timeout_s)
        except grpc.RpcError:
            resp = None
        self.calls.append(HookCall("provider.unloaded", "OnProviderUnloaded", req, resp))
        return resp

    # -- RPC plumbing ------------------------------------------------------------------------

    def registered(self, hook: str, topic: str | None = None) -> bool:
        """Would EMQX call this server for `hook` (and, for message hooks, this topic)?"""
        hooks = self.hooks
        if hooks is None or hook not in hooks:
            return False
        if hook in MESSAGE_HOOKS and topic is not None:
            if topic.startswith("$SYS/"):
                return False
            filters = hooks[hook]
            return not filters or any(topic_matches(f, topic) for f in filters)
        return True

    def _call(self, hook: str, request: Any, topic: str | None = None) -> Any:
        """Call `hook` if registered; RPC failures are recorded, never raised (EMQX carries on)."""
        if not self.registered(hook, topic):
            return None
        method, _ = HOOK_RPC[hook]
        request.meta.CopyFrom(self.meta)
        t = time.perf_counter()
        try:
            resp = self.exhook.call(method, request, self.request_timeout_s)
        except grpc.RpcError as exc:
            with self._lock:
                self.rpc_errors.append((hook, exc))
            self.calls.append(HookCall(hook, method, request, None))
            return None
        finally:
            if self.on_rpc is not None:
                self.on_rpc(method, time.perf_counter() - t)
        self.calls.append(HookCall(hook, method, request, resp))
        return resp

    def new_message(
        self, topic: str, payload: bytes, qos: int, sender: str, headers: dict[str, str] | None = None
    ) -> pb.Message:
        """A Message as EMQX builds it: node, fresh 32-hex id, timestamp in ms."""
        msg = pb.Message(
            node=self.node,
            id=self._guid.next(),
            qos=qos,
            topic=topic,
            payload=payload,
            timestamp=time.time_ns() // 1_000_000,
            headers=headers or {},
        )
        setattr(msg, "from", sender)
        return msg

    def _run_publish(self, msg: pb.Message) -> tuple[pb.ValuedResponse | None, pb.Message, bool]:
        """message.publish fold (§2.4): returns (response, message to route, allowed)."""
        resp = self._call("message.publish", pb.MessagePublishRequest(message=msg), topic=msg.topic)
        if resp is None or resp.type == pb.ValuedResponse.IGNORE or resp.WhichOneof("value") != "message":
            return resp, msg, True
        new = copy.deepcopy(msg)
        new.topic, new.qos, new.payload = resp.message.topic, resp.message.qos, resp.message.payload
        allow = resp.message.headers.get("allow_publish")
        if allow in ("true", "false"):
            new.headers["allow_publish"] = allow
        return resp, new, new.headers.get("allow_publish") != "false"

    def _has_subscriber(self, topic: str) -> bool:
        with self._lock:
            channels = list(self._channels.values())
        return any(topic_matches(f, topic) for c in channels for f in c.subscriptions)

    def _dropped_if_unrouted(self, msg: pb.Message) -> None:
        if not self._has_subscriber(msg.topic):
            self._call("message.dropped", pb.MessageDroppedRequest(message=msg, reason="no_subscribers"), msg.topic)

    # -- platform side -----------------------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, sender: str = "sdv-platform", username: str = "platform"
    ) -> pb.ValuedResponse | None:
        """A platform MQTT client's publish: message.publish, then message.dropped if nobody subscribes.

        Not routed through mosquitto: meant for topics no vehicle subscribes to ($SDV-FANOUT...).
        Returns the server's answer (None if message.publish is not registered for the topic).
        """
        headers = {"username": username, "protocol": "mqtt", "peerhost": LOOPBACK}
        resp, routed, allowed = self._run_publish(self.new_message(topic, payload, qos, sender, headers))
        if allowed:
            if self._has_subscriber(routed.topic):
                self.errors.append(SimulationError(f"platform publish to {routed.topic} has subscribers: not routed"))
            self._dropped_if_unrouted(routed)
        return resp

    def publish_batch(
        self,
        vins: list[str],
        request_id: str,
        data: str | bytes,
        sender: str = "sdv-platform",
        *,
        topic: str = "$SDV-FANOUT",
        **extra: Any,
    ) -> pb.ValuedResponse | None:
        """Publish a seed batch `{"ids", "request_id", "data"}`; bytes data go base64 + data_encoding."""
        doc: dict[str, Any] = {"ids": list(vins), "request_id": request_id}
        if isinstance(data, bytes):
            doc.update(data=base64.b64encode(data).decode(), data_encoding="base64")
        else:
            doc["data"] = data
        doc.update(extra)
        return self.publish(topic, json.dumps(doc).encode(), sender=sender)

    # -- vehicles ----------------------------------------------------------------------------

    def vehicle(
        self,
        vin: str,
        clientid: str | None = None,
        clean_start: bool = True,
        session_expiry_s: int = 0,
        *,
        username: str | None = None,
        keepalive: int = 60,
    ) -> Vehicle:
        """A new (not yet connected) vehicle; FakeEmqx.close() closes it."""
        v = Vehicle(
            self,
            vin,
            clientid or vin,
            username if username is not None else vin,
            clean_start,
            session_expiry_s,
            keepalive,
        )
        with self._lock:
            self.vehicles.append(v)
        return v

    def online(self, vins: Sequence[str], *, auto_ack: bool = True, **kw: Any) -> list[Vehicle]:
        """New vehicles (`vehicle()`'s keywords), each connected and subscribed to its request
        filter in turn; with auto_ack False they hold their PUBACKs until `ack_pending()`."""
        out = []
        for vin in vins:
            v = self.vehicle(vin, **kw)
            v.auto_ack = auto_ack
            v.connect()
            v.subscribe()
            out.append(v)
        return out

    def request_filter(self, vin: str) -> str:
        """The vehicle's request subscription, e.g. `agent/<vin>/proxy/request/+`."""
        return self.request_prefix.replace("{VIN}", vin) + "/+"

    def _lane(self, clientid: str) -> _Lane:
        with self._lock:
            if self._closed:
                raise RuntimeError("FakeEmqx is closed")
            lane = self._lanes.get(clientid)
            if lane is None:
                lane = self._lanes[clientid] = _Lane()
            return lane

    def _submit(self, clientid: str, fn: Callable[..., Any], *args: Any, elsewhere: bool = False) -> Future[Any]:
        """Run a hook job after the clientid's earlier ones; its outcome is the future's.

        If no earlier job is still running, the calling thread runs it (and whatever is queued
        behind it meanwhile) before returning, or with `elsewhere` a channel thread does (what
        the MQTT loop hands over: it never blocks); else it is queued for the thread running them."""
        fut: Future[Any] = Future()
        self._enqueue(clientid, fut, fn, args, self._channel_threads if elsewhere else None)
        return fut

    def _post(self, clientid: str, fn: Callable[..., Any], *args: Any, elsewhere: bool = False) -> None:
        """`_submit` for a job nobody waits for (one per delivered message): a failure goes to errors."""
        self._enqueue(clientid, None, fn, args, self._channel_threads if elsewhere else None)

    def _enqueue(
        self,
        clientid: str,
        fut: Future[Any] | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        elsewhere: ThreadPoolExecutor | None = None,
    ) -> None:
        """Queue the job in the clientid's lane; if no thread runs the lane, run it here (or, with
        `elsewhere`, on one of its threads)."""
        lane = self._lane(clientid)
        with lane.lock:
            lane.jobs.append((fut, fn, args))
            if lane.busy:
                return
            lane.busy = True
        if elsewhere is None:
            self._run_lane(lane)
            return
        try:
            elsewhere.submit(self._run_lane, lane)
        except RuntimeError:  # shut down (closed): here, where it only cancels what is queued
            self._run_lane(lane)

    def _run_lane(self, lane: _Lane) -> None:
        while True:
            with lane.lock:
                if not lane.jobs:
                    lane.busy = False
                    return
                fut, fn, args = lane.jobs.popleft()
            if fut is None:
                if not self._closed:
                    try:
                        fn(*args)
                    except BaseException as exc:
                        self.errors.append(exc)
                continue
            if self._closed:
                fut.cancel()  # as a closed executor cancels what it had not started
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _wait(self, fut: Future[Any]) -> Any:
        return fut.result(self.job_timeout_s)

    def _later(self, delay_s: float, clientid: str, fn: Callable[..., Any], *args: Any) -> None:
        """`_post` the job after delay_s (dropped if the FakeEmqx closed meanwhile)."""

        def post() -> None:
            with contextlib.suppress(RuntimeError):  # closed: no more jobs
                # Queued here, in due order; run on a channel thread, not the Acker's.
                self._enqueue(clientid, None, fn, args, elsewhere=self._channel_threads)

        self._acker.later(delay_s, post)

    # channel registry (what EMQX's emqx_cm knows)
    def _channel(self, clientid: str) -> _Conn | None:
        with self._lock:
            return self._channels.get(clientid)

    def _register(self, conn: _Conn) -> None:
        with self._lock:
            self._channels[conn.vehicle.clientid] = conn

    def _unregister(self, conn: _Conn) -> None:
        with self._lock:
            if self._channels.get(conn.vehicle.clientid) is conn:
                del self._channels[conn.vehicle.clientid]
        if conn.expiry_timer is not None:
            conn.expiry_timer.cancel()

    def _delivery_message(self, clientid: str, topic: str, payload: bytes, qos: int, dup: bool) -> pb.Message:
        """The Message EMQX would pass to delivered/acked for a PUBLISH the vehicle got.

        A redelivery of an unacked message keeps its id; a first delivery is a message the server
        published (from = delivery_clientid), so message.publish runs for it first if registered.
        """
        key = (clientid, topic, payload)
        with self._lock:
            known = self._inflight.get(key)
        if known is not None:
            return known
        msg = self.new_message(topic, payload, qos, self.delivery_clientid, self.delivery_headers)
        if not dup:
            _, routed, allowed = self._run_publish(msg)
            if not allowed or (routed.topic, routed.payload, routed.qos) != (msg.topic, msg.payload, msg.qos):
                self.errors.append(
                    SimulationError(f"server denied/rewrote its own delivery on {topic}; mosquitto already routed it")
                )
            msg = routed
        if qos > 0:
            with self._lock:
                self._inflight[key] = msg
        return msg

    def _acked(self, clientid: str, topic: str, payload: bytes) -> None:
        """After message.acked: the message is no longer in flight, and the rules' `message_acked`
        event runs (the ack rule republishes it to the delivery client that published it)."""
        with self._lock:
            msg = self._inflight.pop((clientid, topic, payload), None)
        if self.rules.rules:
            self.rules.acked(clientid, topic, payload, getattr(msg, "from") if msg else self.delivery_clientid)

    # -- rules ---------------------------------------------------------------------------------

    def add_rule(self, body: dict[str, Any]) -> None:
        """`POST /api/v5/rules` (as `sdv-fanout emqx sync` sends it): from now on each PUBACK of a
        delivery goes through the rule (see testkit/emqx_rules.py)."""
        self.rules.add(body)

    # -- broker restarts -----------------------------------------------------------------------

    def broker_lost(self, timeout_s: float = 10.0) -> None:
        """The broker went away: wait until every vehicle saw it, then forget all channels and sessions."""
        with self._lock:
            vehicles = list(self.vehicles)
        for v in vehicles:
            v._lost(timeout_s)
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._inflight.clear()
        for c in channels:
            c.state = "gone"
            if c.expiry_timer is not None:
                c.expiry_timer.cancel()

    def restart_broker(
        self, broker: Mosquitto, *, graceful: bool = True, reload: bool = True, timeout_s: float = 10.0
    ) -> None:
        """An EMQX restart: OnProviderUnloaded (if graceful), broker restart, all clients dropped
        without hooks (exhook is already unloaded), then OnProviderLoaded again (if reload)."""
        if graceful:
            self.unload()
        else:
            self.hooks = None
        broker.restart()
        self.broker_lost(timeout_s)
        if reload:
            self.load()

    # -- teardown ------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the first harness error (and, with strict_rpc, the first failed RPC)."""
        if self.errors:
            raise SimulationError(f"{len(self.errors)} harness error(s); first: {self.errors[0]!r}") from self.errors[0]
        if self.strict_rpc and self.rpc_errors:
            hook, exc = self.rpc_errors[0]
            raise SimulationError(f"{len(self.rpc_errors)} failed RPC(s); first: {hook}: {exc!r}") from exc

    def close(self, check: bool = True) -> None:
        """Stop every vehicle (no hooks), the workers and the gRPC channel; then `check()`."""
        self._acker.stop()
        with self._lock:
            vehicles = list(self.vehicles)
        for v in vehicles:
            v.close()
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
            channels = list(self._channels.values())
        for c in channels:
            if c.expiry_timer is not None:
                c.expiry_timer.cancel()
        for lane in lanes:
            with lane.lock:
                queued, lane.jobs = list(lane.jobs), deque()
            for fut, _, _ in queued:
                if fut is not None:
                    fut.cancel()
        # A job still running (say on a session-expiry timer) finishes before its channel closes.
        poll(lambda: not any(lane.busy for lane in lanes), timeout_s=self.job_timeout_s)
        self._channel_threads.shutdown(wait=False)
        self.rules.close()
        self.exhook.close()
        if check:
            self.check()

    def __enter__(self) -> FakeEmqx:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(check=exc_type is None)


class Vehicle(vehicle.Vehicle):
    """testkit/vehicle.py's vehicle (its connections on the process's one MQTT loop) whose hooks
    FakeEmqx calls as EMQX would: what mosquitto did (CONNACK, SUBACK, each PUBLISH) becomes a job
    of its clientid's lane, run on a channel thread (never on the loop, which every vehicle shares);
    what the test does (subscribe, publish, PUBACK, disconnect, drop) runs in the same lane.

    `persistent` follows MQTT 5: the session outlives the connection iff session_expiry_s > 0.
    Each connect is a new TCP connection, the previous one left open (mosquitto takes it over),
    so `peerport` changes. `received` holds each PUBLISH once its delivered/acked hooks ran;
    `unacked`, `acks` and `on_delivery` keep testkit/vehicle.py's meaning.
    """

    received: list[Received]  # type: ignore[assignment]
    unacked: list[tuple[Any, Received]]  # type: ignore[assignment]
    acks: list[tuple[Received, float]]  # type: ignore[assignment]

    def __init__(
        self,
        emqx: FakeEmqx,
        vin: str,
        clientid: str,
        username: str,
        clean_start: bool,
        session_expiry_s: int,
        keepalive: int = 60,
    ) -> None:
        super().__init__(
            emqx.mqtt_port,
            vin,
            clientid=clientid,
            username=username,
            session_expiry_s=session_expiry_s,
            request_prefix=emqx.request_prefix,
            keepalive_s=keepalive,
        )
        self.emqx = emqx
        self.clean_start = clean_start
        self.keepalive = keepalive
        #: With auto_ack, hold each PUBACK back this long (a slow vehicle: a second delivery sent
        #: before the PUBACK would then show in `received` before its `pubacks` entry).
        self.ack_delay_s = 0.0
        self._pending: list[tuple[_Conn, Received, pb.Message]] = []
        self._conns: list[_Conn] = []
        self._conn: _Conn | None = None
        self._channels: dict[mqtt.Connection, _Conn] = {}
        self._channels_lock = threading.Lock()
        self._last_subscriptions: dict[str, pb.SubOpts] = {}

    # -- views -------------------------------------------------------------------------------

    @property
    def pubacks(self) -> list[Acked]:
        """Every PUBACK sent, in order (`acks` as Acked records)."""
        return [Acked(r.topic, r.payload, r.mid, t) for r, t in list(self.acks)]

    @property
    def peerport(self) -> int:
        """The local TCP port of the current connection (EMQX's peerport)."""
        return self._require_conn().peerport

    @property
    def is_connected(self) -> bool:
        """True while the current MQTT connection is up."""
        return self._conn is not None and not self._conn.closed

    def clientinfo(self) -> pb.ClientInfo:
        """The ClientInfo EMQX sends for the current connection (a copy)."""
        ci = pb.ClientInfo()
        ci.CopyFrom(self._require_conn().clientinfo)
        return ci

    def _require_conn(self) -> _Conn:
        if self._conn is None:
            raise RuntimeError(f"{self.clientid} never connected")
        return self._conn

    def _require_open(self) -> _Conn:
        conn = self._require_conn()
        if conn.state != "open" or conn.closed:
            raise RuntimeError(f"{self.clientid} is not connected (channel {conn.state})")
        return conn

    # -- what mosquitto did (on the loop: never block, never raise) ------------------------------

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced by FakeEmqx.check()/close()
            if not self.emqx._closed:
                self.emqx.errors.append(exc)

    def _channel(self, link: mqtt.Connection) -> _Conn:
        """The channel of a connection whose CONNACK came; made (and its connect job queued) by
        whichever comes first: the connect call, or a PUBLISH right behind the CONNACK."""
        with self._channels_lock:
            conn = self._channels.get(link)
            if conn is None:
                conn = self._channels[link] = _Conn(self, link)
                self._conns.append(conn)
                conn.connect_job = self.emqx._submit(self.clientid, self._job_connected, conn, elsewhere=True)
            return conn

    def _subacked(self, conn: _Conn) -> None:
        """Queue the subscribe jobs of the SUBACKs that came, in order, before any later PUBLISH."""
        with conn.lock:
            while conn.subs and conn.subs[0].suback.done():
                sub = conn.subs.pop(0)
                if sub.suback.cancelled() or sub.suback.exception() is not None:
                    continue  # the connection went: no SUBACK, no hook
                codes = sub.suback.result()
                sub.job = self.emqx._submit(
                    self.clientid, self._job_subscribed, conn, sub.topic, sub.opts, codes, elsewhere=True
                )

    def _on_message(self, link: mqtt.Connection, m: mqtt.Message) -> None:
        def run() -> None:
            conn = self._channel(link)
            self._subacked(conn)
            self.emqx._post(self.clientid, self._job_message, conn, m, elsewhere=True)

        self._guard(run)

    # -- hook jobs (the clientid's lane) ---------------------------------------------------------

    def _job_connected(self, conn: _Conn) -> None:
        emqx = self.emqx
        props = []
        if conn.expiry_s > 0:
            props.append(pb.Property(name="Session-Expiry-Interval", value=str(conn.expiry_s).encode()))
        emqx._call("client.connect", pb.ClientConnectRequest(conninfo=conn.conninfo, props=props))
        if conn.reason_code >= 0x80:
            emqx._call(
                "client.connack",
                pb.ClientConnackRequest(
                    conninfo=conn.conninfo, result_code=_result_code(conn.reason_code), props=conn.connack_props
                ),
            )
            conn.state = "gone"
            return
        old = emqx._channel(self.clientid)
        if old is conn:
            old = None
        if conn.session_present:
            emqx._call("session.resumed", pb.SessionResumedRequest(clientinfo=conn.clientinfo))
            if old is not None:
                self._end_old(old, "takenover")
            conn.subscriptions = dict(old.subscriptions if old is not None else self._last_subscriptions)
        else:
            if old is not None:
                self._end_old(old, "discarded")
            emqx._call("session.created", pb.SessionCreatedRequest(clientinfo=conn.clientinfo))
        conn.state = "open"
        emqx._register(conn)
        emqx._call("client.connected", pb.ClientConnectedRequest(clientinfo=conn.clientinfo))
        emqx._call(
            "client.connack",
            pb.ClientConnackRequest(conninfo=conn.conninfo, result_code="success", props=conn.connack_props),
        )

    def _end_old(self, old: _Conn, reason: str) -> None:
        """The old channel of this clientid ends: §7 shows `client.disconnected(reason)` for it even
        when it was already disconnected (idle persistent session), then session.<reason>."""
        emqx = self.emqx
        emqx._call("client.disconnected", pb.ClientDisconnectedRequest(clientinfo=old.clientinfo, reason=reason))
        emqx._call(f"session.{reason}", HOOK_RPC[f"session.{reason}"][1](clientinfo=old.clientinfo))
        old.state = "gone"
        emqx._unregister(old)
        old.vehicle._pending = [p for p in old.vehicle._pending if p[0] is not old]

    def _job_subscribed(self, conn: _Conn, topic: str, opts: pb.SubOpts, reason_codes: list[int]) -> None:
        if any(rc >= 0x80 for rc in reason_codes):
            raise SimulationError(f"SUBACK for {topic} refused: {reason_codes}")
        if conn.state != "open":
            return
        emqx = self.emqx
        tf = pb.TopicFilter(name=topic, subopts=opts)
        emqx._call("client.subscribe", pb.ClientSubscribeRequest(clientinfo=conn.clientinfo, topic_filters=[tf]))
        emqx._call(
            "session.subscribed", pb.SessionSubscribedRequest(clientinfo=conn.clientinfo, topic=topic, subopts=opts)
        )
        conn.subscriptions[topic] = opts
        self._last_subscriptions[topic] = opts

    def _job_message(self, conn: _Conn, m: mqtt.Message) -> None:
        emqx = self.emqx
        got = Received(m.topic, m.payload, m.pid, m.time)
        alive = conn.state == "open"
        msg = emqx._delivery_message(self.clientid, m.topic, m.payload, m.qos, m.dup) if alive else None
        if msg is not None:
            emqx._call(
                "message.delivered", pb.MessageDeliveredRequest(clientinfo=conn.clientinfo, message=msg), m.topic
            )
            if m.qos > 0:
                self.unacked.append((conn.link, got))
                self.max_unacked = max(self.max_unacked, sum(1 for link, _ in self.unacked if link is conn.link))
                if self.auto_ack and self.ack_delay_s > 0:
                    emqx._later(self.ack_delay_s, self.clientid, self._puback, conn, got, msg)
                elif self.auto_ack:
                    self._puback(conn, got, msg)
                else:
                    self._pending.append((conn, got, msg))
        self.received.append(got)
        if self.on_delivery is not None:
            self.on_delivery(got)  # type: ignore[arg-type]

    def _puback(self, conn: _Conn, got: Received, msg: pb.Message) -> bool:
        """PUBACK, then message.acked, as EMQX calls it when the PUBACK arrives."""
        if conn.dropping or conn.closed or conn.state != "open":
            return False
        t = time.time()
        if not run(_on_loop(conn.link.puback, got.mid), TIMEOUT_S):
            return False
        with contextlib.suppress(ValueError):
            self.unacked.remove((conn.link, got))
        self.acks.append((got, t))
        self.emqx._call("message.acked", pb.MessageAckedRequest(clientinfo=conn.clientinfo, message=msg), msg.topic)
        self.emqx._acked(self.clientid, msg.topic, msg.payload)
        return True

    def _job_ack_pending(self) -> int:
        pending, self._pending = self._pending, []
        return sum(self._puback(conn, got, msg) for conn, got, msg in pending)

    def _publish_now(
        self, conn: _Conn, topic: str, payload: bytes, qos: int
    ) -> tuple[pb.ValuedResponse | None, bool | None]:
        """message.publish, then (if allowed) the message it leaves, sent on the vehicle's
        connection, and message.dropped if nobody subscribes: the server's answer, and whether the
        message went out (None: not allowed). Runs in the clientid's lane."""
        emqx = self.emqx
        headers = {"username": self.username, "protocol": "mqtt", "peerhost": LOOPBACK}
        resp, routed, allowed = emqx._run_publish(emqx.new_message(topic, payload, qos, self.clientid, headers))
        if not allowed:
            return resp, None
        try:
            run(_on_loop(conn.link.publish, routed.topic, routed.payload, routed.qos), TIMEOUT_S)
        except mqtt.MqttError:
            return resp, False
        emqx._dropped_if_unrouted(routed)
        return resp, True

    def _job_publish(self, conn: _Conn, topic: str, payload: bytes, qos: int) -> pb.ValuedResponse | None:
        if conn.state != "open":
            raise RuntimeError(f"{self.clientid} is not connected")
        resp, sent = self._publish_now(conn, topic, payload, qos)
        if sent is False:
            raise SimulationError(f"publish on {topic} failed: {self.clientid} is not connected")
        return resp

    def _job_closed(self, conn: _Conn, reason: str) -> None:
        """client.disconnected(reason); session.terminated({shutdown,reason}) unless the session persists."""
        if conn.state != "open":
            return  # already taken over / discarded / lost with the broker
        emqx = self.emqx
        emqx._call("client.disconnected", pb.ClientDisconnectedRequest(clientinfo=conn.clientinfo, reason=reason))
        self._pending = [p for p in self._pending if p[0] is not conn]
        if conn.persistent:
            conn.state = "idle"
            timer = threading.Timer(conn.expiry_s, self._expire, args=(conn,))
            timer.daemon = True
            conn.expiry_timer = timer
            timer.start()
        else:
            emqx._call(
                "session.terminated",
                pb.SessionTerminatedRequest(clientinfo=conn.clientinfo, reason=f"{{shutdown,{reason}}}"),
            )
            conn.state = "gone"
            emqx._unregister(conn)

    def _expire(self, conn: _Conn) -> None:
        def job() -> None:
            if conn.state == "idle":
                self.emqx._call(
                    "session.terminated", pb.SessionTerminatedRequest(clientinfo=conn.clientinfo, reason="expired")
                )
                conn.state = "gone"
                self.emqx._unregister(conn)

        def submit() -> None:
            self.emqx._post(self.clientid, job)

        self._guard(submit)

    # -- on the loop ---------------------------------------------------------------------------

    async def _aopen(self, timeout_s: float) -> mqtt.Connection:
        """A new TCP connection and its CONNACK, the previous connection left as it is."""
        loop = asyncio.get_running_loop()
        username, keepalive_s, expiry_s = self.username, self.keepalive_s, self.session_expiry_s
        _, link = await loop.create_connection(
            lambda: mqtt.Connection(self.clientid, username, self.clean_start, keepalive_s, expiry_s, self._on_message),
            LOOPBACK,
            self.port,
        )
        try:
            await asyncio.wait_for(asyncio.shield(link.connack), timeout_s)
        except BaseException:
            link.abort()
            raise
        self.conn = link
        self.unacked.clear()  # as testkit/vehicle.py's: the deliveries of the last connection
        return link

    async def _aclose(
        self, links: list[mqtt.Connection], close: Callable[[mqtt.Connection], None], timeout_s: float
    ) -> bool:
        """`close` each connection, then wait (bounded) until they are closed; were they?"""
        for link in links:
            close(link)
        pending = [link.closed for link in links if not link.is_closed]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        return all(link.is_closed for link in links)

    # -- test API ------------------------------------------------------------------------------

    def connect(self, timeout_s: float = 10.0) -> None:  # type: ignore[override]
        """New TCP connection + CONNECT; after CONNACK the hooks run in EMQX's order (§7):
        connect → [resumed → old disconnected(takenover) → old takenover | old disconnected(discarded)
        → old discarded → created] → connected → connack("success")."""
        try:
            link = run(self._aopen(timeout_s), timeout_s + 1)
        except (OSError, mqtt.MqttError) as exc:
            raise RuntimeError(f"{self.clientid}: connection closed before CONNACK ({exc})") from exc
        conn = self._channel(link)
        self._conn = conn
        assert conn.connect_job is not None
        self.emqx._wait(conn.connect_job)
        if conn.reason_code >= 0x80:
            run(self._aclose([link], mqtt.Connection.abort, timeout_s), timeout_s + 1)
            raise RuntimeError(f"{self.clientid}: CONNACK {_result_code(conn.reason_code)}")

    def reconnect(  # type: ignore[override]
        self, clean_start: bool, session_expiry_s: int | None = None, timeout_s: float = 10.0
    ) -> None:
        """Connect again on a new TCP connection (resume or discard order, as mosquitto's CONNACK says)."""
        self.clean_start = clean_start
        if session_expiry_s is not None:
            self.session_expiry_s = session_expiry_s
        self.connect(timeout_s)

    def subscribe(self, topic: str | None = None, qos: int = 1, timeout_s: float = 10.0) -> None:  # type: ignore[override]
        """SUBSCRIBE (default `<request_prefix>/+`, QoS 1); after SUBACK: client.subscribe → session.subscribed."""
        conn = self._require_open()
        sub = _Sub(topic or self.request_filter, pb.SubOpts(qos=qos))

        async def subscribe() -> list[int]:
            with conn.lock:
                sub.suback = conn.link.subscribe([(sub.topic, qos)])
                conn.subs.append(sub)
            return await asyncio.wait_for(asyncio.shield(sub.suback), timeout_s)

        try:
            run(subscribe(), timeout_s + 1)
        except (mqtt.MqttError, TimeoutError) as exc:
            raise RuntimeError(f"{self.clientid}: connection closed before SUBACK ({exc})") from exc
        self._subacked(conn)
        assert sub.job is not None
        self.emqx._wait(sub.job)

    def heartbeat(self, kind: str = "online", payload: bytes = b"") -> pb.ValuedResponse | None:  # type: ignore[override]
        """`message.publish` for `ecp/<vin>/<kind>` (QoS 0), then the real publish if allowed.

        The published message is the one the server's answer leaves (topic/qos/payload rewrite,
        `allow_publish=false` → not published), then `message.dropped(no_subscribers)` if no
        vehicle subscribes. Returns the server's answer (None if publish is not registered)."""
        return self.publish(f"ecp/{self.vin}/{kind}", payload, qos=0)

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> pb.ValuedResponse | None:  # type: ignore[override]
        """The vehicle publishes: `message.publish` (if registered for the topic), then the real
        publish if allowed, then `message.dropped(no_subscribers)` if nobody subscribes."""
        conn = self._require_open()
        answer: pb.ValuedResponse | None = self.emqx._wait(
            self.emqx._submit(self.clientid, self._job_publish, conn, topic, payload, qos)
        )
        return answer

    def respond(self, request_id: str, payload: bytes, vin: str | None = None) -> pb.ValuedResponse | None:
        """The vehicle's answer to `request_id` on `agent/<vin>/proxy/response/<request_id>`
        (another `vin` plays a forged answer)."""
        return self.publish(f"agent/{vin or self.vin}/proxy/response/{request_id}", payload)

    def disconnect(self, timeout_s: float = 10.0) -> None:
        """Clean DISCONNECT; then client.disconnected("normal") (+ session.terminated if not persistent)."""
        conn = self._require_open()
        conn.dropping = True
        self._finish_close(conn, mqtt.Connection.disconnect, "normal", timeout_s)

    def drop(self, timeout_s: float = 10.0) -> None:
        """Abrupt close (TCP FIN, no DISCONNECT); then client.disconnected("tcp_closed") (+ terminated).

        Waits until mosquitto closed its side too, i.e. it has noticed the loss."""
        conn = self._require_open()
        conn.dropping = True
        self._finish_close(conn, mqtt.Connection.half_close, "tcp_closed", timeout_s)

    def crash_before_ack(self, timeout_s: float = 10.0) -> None:
        """drop() while messages are still unacked: they stay in mosquitto's session for redelivery."""
        self.drop(timeout_s)

    def _finish_close(
        self, conn: _Conn, close: Callable[[mqtt.Connection], None], reason: str, timeout_s: float
    ) -> None:
        if not run(self._aclose([conn.link], close, timeout_s), timeout_s + 1):
            raise TimeoutError(f"{self.clientid}: mosquitto did not close the connection within {timeout_s} s")
        run(self._aclose([conn.link], mqtt.Connection.abort, timeout_s), timeout_s + 1)
        self.emqx._wait(self.emqx._submit(self.clientid, self._job_closed, conn, reason))

    def ack_pending(self) -> int:
        """PUBACK every message held back with auto_ack=False (message.acked each); returns how many."""
        return self.emqx._wait(self.emqx._submit(self.clientid, self._job_ack_pending))  # type: ignore[no-any-return]

    def ack_held(self) -> int:
        """testkit/vehicle.py's name for ack_pending()."""
        return self.ack_pending()

    def wait_for(self, n: int, timeout_s: float = 30.0) -> list[Received]:
        """Poll until n PUBLISHes were received (and their hooks ran); returns them all."""

        def enough() -> bool:
            self.emqx.check()
            return len(self.received) >= n

        poll(enough, timeout_s=timeout_s)
        return list(self.received)

    def wait_disconnected(self, timeout_s: float = 10.0) -> None:
        """Poll until the current connection is closed (e.g. kicked or broker stopped)."""
        conn = self._require_conn()
        poll(lambda: conn.closed, timeout_s=timeout_s)

    def _lost(self, timeout_s: float) -> None:
        """The broker is gone: reap the connection; its channel ends without any hook."""
        conn = self._conn
        if conn is None or conn.state == "gone":
            return
        run(self._aclose([conn.link], lambda _link: None, timeout_s), timeout_s + 1)
        run(self._aclose([conn.link], mqtt.Connection.abort, timeout_s), timeout_s + 1)

        def job() -> None:
            conn.state = "gone"
            if conn.expiry_timer is not None:
                conn.expiry_timer.cancel()
            self._pending = [p for p in self._pending if p[0] is not conn]

        self.emqx._wait(self.emqx._submit(self.clientid, job))

    def close(self, timeout_s: float = 5.0) -> None:
        """Close every connection of this vehicle at once (no DISCONNECT, no hooks), and wait
        (bounded) until their sockets are closed."""
        with self._channels_lock:
            conns = list(self._conns)
        for conn in conns:
            conn.dropping = True
        links = [c.link for c in conns]
        if self.conn is not None and self.conn not in links:
            links.append(self.conn)  # its CONNACK never came
        run(self._aclose(links, mqtt.Connection.abort, timeout_s), timeout_s + 1)


async def _on_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the MQTT loop (a connection is driven only from there)."""
    return fn(*args)


__all__ = [
    "HOOK_RPC",
    "MESSAGE_HOOKS",
    "Acked",
    "Acker",
    "FakeEmqx",
    "HookCall",
    "Mosquitto",
    "Received",
    "SimulationError",
    "Vehicle",
    "free_port",
    "running_mosquitto",
    "topic_matches",
]
