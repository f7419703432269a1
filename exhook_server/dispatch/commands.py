"""What the hooks tell the dispatch workers: plain, immutable, picklable values.

A command names one VIN, so it can be routed to the worker that owns it, in this process or in
another of its group.
"""

from __future__ import annotations

import enum
import socket
import sys
from dataclasses import dataclass

#: Marks a packed IPv6 address (an IPv4 one fits below it).
_V6 = 1 << 144


def _pack_addr(host: str, port: int) -> int | tuple[str, int]:
    """Peer address and port as one int when the host is an IP address in canonical text
    (what EMQX sends), else as they came: one 32-48 B int instead of a string and an int."""
    if host and 0 <= port <= 0xFFFF:  # no host (an event over MQTT): spare two failed parses
        for family, flag in ((socket.AF_INET, 0), (socket.AF_INET6, _V6)):
            try:
                raw = socket.inet_pton(family, host)
            except OSError:
                continue
            # Only an exact round trip: `peerhost` must give back the very text EMQX sent.
            if socket.inet_ntop(family, raw) == host:
                return flag | int.from_bytes(raw) << 16 | port
    return (host, port)


class Session:
    """One live MQTT connection, as EMQX describes it; stands in for the seed's channel pid.

    EMQX before 5.4 sends no peerport (0): then two connections of one client
    from one host look the same, and only the order and disconnect reasons of
    the hooks tell them apart.

    Immutable, and small because every online VIN keeps one: the node name is
    interned (a cluster has a few), host and port are packed into one int, and
    `with_clientid` lets the presence map share the VIN string it is keyed by.
    """

    __slots__ = ("_addr", "clientid", "node")
    node: str
    clientid: str
    _addr: int | tuple[str, int]

    def __init__(self, node: str, clientid: str, peerhost: str, peerport: int = 0) -> None:
        object.__setattr__(self, "node", sys.intern(node))
        object.__setattr__(self, "clientid", clientid)
        object.__setattr__(self, "_addr", _pack_addr(peerhost, peerport))

    @property
    def peerhost(self) -> str:
        addr = self._addr
        if isinstance(addr, tuple):
            return addr[0]
        if addr & _V6:
            return socket.inet_ntop(socket.AF_INET6, ((addr ^ _V6) >> 16).to_bytes(16))
        return socket.inet_ntop(socket.AF_INET, (addr >> 16).to_bytes(4))

    @property
    def peerport(self) -> int:
        addr = self._addr
        return addr[1] if isinstance(addr, tuple) else addr & 0xFFFF

    def with_clientid(self, clientid: str) -> Session:
        """This session holding `clientid`, an equal string object (e.g. the presence map's key)."""
        assert clientid == self.clientid
        twin = object.__new__(Session)
        object.__setattr__(twin, "node", self.node)
        object.__setattr__(twin, "clientid", clientid)
        object.__setattr__(twin, "_addr", self._addr)
        return twin

    def same_connection(self, other: Session) -> bool:
        """True when both may be the same connection (an unknown port matches any port; an
        unknown node, an event over MQTT vouched for by the client id alone, any connection)."""
        if self.clientid != other.clientid:
            return False
        if not self.node or not other.node:
            return True
        if self.node != other.node:
            return False
        a, b = self._addr, other._addr
        if a == b:
            return True
        if isinstance(a, int) and isinstance(b, int):
            return a >> 16 == b >> 16 and not (a & 0xFFFF and b & 0xFFFF)
        return self.peerhost == other.peerhost and (not self.peerport or not other.peerport)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Session is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Session is immutable: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Session):
            return NotImplemented
        return self.clientid == other.clientid and self._addr == other._addr and self.node == other.node

    def __hash__(self) -> int:
        return hash((self.node, self.clientid, self._addr))

    def __repr__(self) -> str:
        return (
            f"Session(node={self.node!r}, clientid={self.clientid!r}, "
            f"peerhost={self.peerhost!r}, peerport={self.peerport!r})"
        )

    def __reduce__(self) -> tuple[type[Session], tuple[str, str, str, int]]:
        return Session, (self.node, self.clientid, self.peerhost, self.peerport)


class Trigger(enum.StrEnum):
    """Why a maybe_send was issued."""

    NEW_BATCH = "new_batch"
    SESSION_SUBSCRIBED = "session_subscribed"
    SESSION_RESUMED = "session_resumed"
    HEARTBEAT = "heartbeat"
    #: Our MQTT connection came back: everything online may need a (re)send.
    BROKER_BACK = "broker_back"
    #: An operator asked (Admin.Requeue): forget the in-flight entry and send again.
    REQUEUE = "requeue"
    #: The periodic sweep found a delivery unacked for longer than the in-flight timeout.
    TIMEOUT = "timeout"
    #: The broker refused the delivery in flight: the same row again (alone), or the next one.
    REFUSED = "refused"


class EndReason(enum.StrEnum):
    """How a vehicle's connection or session ended, as far as dispatch cares."""

    #: The session moved to a new connection (session.resumed came first): nothing is lost.
    TAKENOVER = "takenover"
    #: A new clean connection replaced it: what it had in flight is gone.
    DISCARDED = "discarded"
    #: The connection is gone; a persistent session may still redeliver on resume.
    OFFLINE = "offline"
    #: The broker session is gone (session.terminated): nothing will be redelivered.
    TERMINATED = "terminated"


@dataclass(frozen=True, slots=True)
class MaybeSend:
    trigger: Trigger
    vin: str
    session: Session | None = None


@dataclass(frozen=True, slots=True)
class NewBatch:
    """New rows for these VINs, all owned by one worker: one queue entry per worker per batch
    instead of one per VIN (a batch names hundreds of mostly offline vehicles)."""

    vins: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """The vehicle PUBACKed our delivery of `request_id` whose payload hashes to `sha1`."""

    vin: str
    session: Session
    request_id: str
    sha1: bytes


@dataclass(frozen=True, slots=True)
class Responded:
    """The vehicle answered `request_id` on the response topic (`session`: who published it)."""

    vin: str
    session: Session
    request_id: str
    #: The answer's first max_response_bytes.
    payload: bytes
    #: The answer's full size in bytes.
    size: int


@dataclass(frozen=True, slots=True)
class Connected:
    """A new connection of a client: any older connection of that clientid is gone (EMQX allows one)."""

    vin: str
    session: Session


@dataclass(frozen=True, slots=True)
class Down:
    vin: str
    session: Session
    reason: EndReason


@dataclass(frozen=True, slots=True)
class Requeue:
    """Operator action: drop the VIN's in-flight entry and send its oldest row again."""

    vin: str


@dataclass(frozen=True, slots=True)
class Refused:
    """From the delivery client: the broker refused our delivery of `request_id` to `vin`.
    `final`: refused delivery_max_refusals times, so the row ends failed."""

    vin: str
    request_id: str
    reason: str
    final: bool


@dataclass(frozen=True, slots=True)
class BrokerLost:
    """Internal, to every worker: our MQTT connection dropped; in-flight entries are void."""


@dataclass(frozen=True, slots=True)
class BrokerBack:
    """Internal, to every worker: our MQTT connection is back; send to everyone online."""


@dataclass(frozen=True, slots=True)
class Sweep:
    """Internal, to every worker: re-send deliveries older than the in-flight timeout
    to vehicles still online (a lost PUBACK must not wait for the next heartbeat)."""


@dataclass(frozen=True, slots=True)
class NodeRestarted:
    """Internal, to every worker: EMQX node `node` started again; every session it held is gone
    (presence and deliveries out on it are void: the vehicles' new connections say where they are)."""

    node: str


Command = (
    MaybeSend
    | NewBatch
    | Acknowledge
    | Responded
    | Connected
    | Down
    | Requeue
    | Refused
    | BrokerLost
    | BrokerBack
    | NodeRestarted
    | Sweep
)
