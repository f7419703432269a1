"""What the hooks tell the dispatch workers: plain, immutable, picklable values.

A command names one VIN, so it can be routed to the worker that owns it (today
an asyncio task, later possibly another process).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Session:
    """One live MQTT connection, as EMQX describes it; stands in for the seed's channel pid.

    EMQX before 5.4 sends no peerport (0): then two connections of one client
    from one host look the same, and only the order and disconnect reasons of
    the hooks tell them apart.
    """

    node: str
    clientid: str
    peerhost: str
    peerport: int = 0

    def same_connection(self, other: Session) -> bool:
        """True when both may be the same connection (an unknown port matches any port)."""
        return (
            self.clientid == other.clientid
            and self.peerhost == other.peerhost
            and self.node == other.node
            and (self.peerport == other.peerport or not self.peerport or not other.peerport)
        )


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
class AckCommitted:
    """Internal: the row delete of an ack is committed; go on with the next row."""

    vin: str
    request_id: str
    sha1: bytes


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


Command = (
    MaybeSend | NewBatch | Acknowledge | Connected | Down | Requeue | AckCommitted | BrokerLost | BrokerBack | Sweep
)
