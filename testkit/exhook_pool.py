"""EMQX's pool of gRPC connections to one ExHook URL, when that URL fronts several server instances.

EMQX opens `pool_size` connections (gun, HTTP/2) to the server URL and sends each hook call over
the connection its client's key hashes to (docs/exhook-interface.md §3), so one
client's calls share one connection. Behind a Kubernetes Service each connection lands on one pod.
`ExHookPool` plays that pool for `FakeEmqx`, with one of two routings:

* ``per_client``: connection k is bound to an instance; a client's calls all reach that instance;
* ``random``: each call goes to an instance picked at random (harsher than EMQX: one client's
  consecutive hooks reach different instances).

A call that finds its instance gone (connection refused or reset: the port refuses TCP) or hung
(DEADLINE_EXCEEDED) fails as it does in EMQX, and the caller applies failed_action. The failure is
recorded in `failovers`, the instance leaves the Service (`down`), and the failed connection
reconnects to another instance (later calls go to the remaining ones); every other connection
bound to it fails its own next call the same way first. An error the server answered (any other
status, or UNAVAILABLE while the port still accepts TCP) changes no routing. With one instance
nothing is ever rerouted: that is the single-server driver as it always was.
"""

from __future__ import annotations

import random
import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import grpc

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.harness import ExHookClient

Routing = Literal["per_client", "random"]
ROUTINGS: tuple[Routing, ...] = ("per_client", "random")

#: RPCs that answer something else than EmptySuccess.
HOOK_RESPONSE: dict[str, type[Any]] = {
    "OnProviderLoaded": pb.LoadedResponse,
    "OnClientAuthenticate": pb.ValuedResponse,
    "OnClientAuthorize": pb.ValuedResponse,
    "OnMessagePublish": pb.ValuedResponse,
}


class Failover(NamedTuple):
    """A call that found its instance down or hung: where it went, what failed, when (monotonic)."""

    port: int
    method: str
    code: grpc.StatusCode
    time: float


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


def routing_key(request: Any) -> str:
    """EMQX's `key_dispatch`: clientinfo.clientid, else conninfo.clientid, else message.from."""
    for field, attr in (("clientinfo", "clientid"), ("conninfo", "clientid"), ("message", "from")):
        if field in request.DESCRIPTOR.fields_by_name and request.HasField(field):
            return str(getattr(getattr(request, field), attr))
    return ""


def accepts_tcp(port: int, host: str = "127.0.0.1", timeout_s: float = 0.2) -> bool:
    """Does something listen on host:port (an instance that refuses nothing is alive)?"""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class ExHookPool:
    """`pool_size` connections per instance reachable, routed as `routing` says (see the module)."""

    def __init__(
        self,
        ports: Sequence[int],
        package: str = "v3",
        pool_size: int = 8,
        routing: Routing = "per_client",
        seed: int | None = None,
    ) -> None:
        if not ports:
            raise ValueError("at least one exhook port")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}")
        self.ports = list(ports)
        self.package = package
        self.pool_size = pool_size
        self.routing = routing
        #: Instances the Service no longer offers (a call found them down or hung).
        self.down: set[int] = set()
        self.failovers: list[Failover] = []
        #: Calls each instance answered (any status the server itself sent).
        self.answered: Counter[int] = Counter()
        self._rng = random.Random(seed)
        # Spread as evenly as a Service's balancing would: connection k to instance k mod n.
        self._bound = [self.ports[k % len(self.ports)] for k in range(pool_size)]
        self._clients: dict[tuple[int, int], ExHookClient] = {}
        self._stubs: dict[tuple[int, int, str], Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Every connection opened up front, as EMQX's pool does when the server is loaded (and as
        # this driver did before it knew several instances): opening channels lazily, from the
        # threads running vehicles' hooks, coincided with CONNACKs waiting over 10 s in full-suite
        # runs. A connection that fails over opens its new channel then.
        for k in range(pool_size):
            for port in self.ports if self.routing == "random" else [self._bound[k]]:
                self._clients[k, port] = ExHookClient(port, self.package)

    def route(self, key: str) -> tuple[int, int]:
        """(connection, instance port) for a call keyed `key`."""
        k = zlib.crc32(key.encode()) % self.pool_size
        with self._lock:
            if self.routing == "random" and len(self.ports) > 1:
                return k, self._rng.choice(self._offered())
            return k, self._bound[k]

    def _offered(self) -> list[int]:
        """Instances the Service offers a new connection (all of them when none is left up)."""
        return [p for p in self.ports if p not in self.down] or list(self.ports)

    def client(self, k: int, port: int) -> ExHookClient:
        """Connection k's own TCP connection to the instance on `port` (opened on first use)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ExHookPool is closed")
            c = self._clients.get((k, port))
            if c is None:
                c = self._clients[k, port] = ExHookClient(port, self.package)
            return c

    def _stub(self, k: int, port: int, method: str) -> Callable[..., Any]:
        stub = self._stubs.get((k, port, method))
        if stub is None:
            response_cls = HOOK_RESPONSE.get(method, pb.EmptySuccess)
            stub = self.client(k, port).channel.unary_unary(
                f"/emqx.exhook.{self.package}.HookProvider/{method}",
                request_serializer=_serialize,
                response_deserializer=response_cls.FromString,
            )
            self._stubs[k, port, method] = stub
        return stub

    def call(self, method: str, request: Any, timeout_s: float) -> Any:
        """One unary call routed by the request's key; a failure is raised (after any failover)."""
        k, port = self.route(routing_key(request))
        try:
            response = self._stub(k, port, method)(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            self._failed(k, port, method, exc)
            raise
        with self._lock:
            self.answered[port] += 1
        return response

    def _failed(self, k: int, port: int, method: str, exc: grpc.RpcError) -> None:
        code = exc.code()
        if len(self.ports) == 1:
            return
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            pass  # hung: gone for EMQX as for a liveness probe
        elif code != grpc.StatusCode.UNAVAILABLE or accepts_tcp(port):
            with self._lock:
                self.answered[port] += 1
            return  # the server answered this error itself: the connection stays where it is
        with self._lock:
            self.down.add(port)
            self.failovers.append(Failover(port, method, code, time.monotonic()))
            if self._bound[k] == port:
                others = [p for p in self._offered() if p != port]
                self._bound[k] = self._rng.choice(others) if others else port

    def back(self, port: int) -> None:
        """The instance is offered again (connections stay where they are, as EMQX's do)."""
        with self._lock:
            self.down.discard(port)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients = list(self._clients.values())
            self._clients.clear()
            self._stubs.clear()
        for c in clients:
            c.close()


__all__ = ["HOOK_RESPONSE", "ROUTINGS", "ExHookPool", "Failover", "Routing", "accepts_tcp", "routing_key"]
