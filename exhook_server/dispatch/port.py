"""What hooks, acks, the Admin API and housekeeping ask of dispatch, whichever store is behind it.

Two implementations, each built by its store's backend (`Backend.dispatcher`, from
`DispatchNeeds`): `backends.lmdb.pool.Dispatcher` (LMDB: each vehicle's state in the memory of the
worker that owns it, events forwarded between the processes of one host) and
`backends.postgres.dispatch.SharedDispatcher` (PostgreSQL: the state in the database, any instance
handles any vehicle). Both run the same rules (`worker.Worker`); callers never know which answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from exhook_server.dispatch.commands import EndReason, Session
from exhook_server.dispatch.pacing import Pacer
from exhook_server.dispatch.ring import HashRing
from exhook_server.dispatch.worker import LatencyListener, OutcomeListener, Publisher, ResponseListener, StartBudget


class Dispatch(Protocol):
    """Vehicle events in, deliveries out (see the module docstring)."""

    ring: HashRing

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def backlog(self) -> int:
        """Events queued here and not handled yet."""
        ...

    def drain_now(self) -> None:
        """Handle what waits for the next loop turn now (after a read of the delivery client)."""
        ...

    # -- events from hooks -------------------------------------------------------
    def new_batch(self, vins: Iterable[str], request_id: str = "") -> None: ...

    def subscribed(self, session: Session, vin: str) -> None: ...

    def resumed(self, session: Session) -> None: ...

    def heartbeat(self, session: Session, vin: str) -> None: ...

    def acked(self, session: Session, vin: str, request_id: str, sha1: bytes) -> None: ...

    def responded(self, session: Session, vin: str, request_id: str, payload: bytes, size: int) -> None: ...

    async def cancelled(self, request_id: str, rows: tuple[tuple[str, bytes], ...]) -> int:
        """A cancel ended these (VIN, sha1) rows: how many were out for delivery."""
        ...

    def connected(self, session: Session) -> None: ...

    def ended(self, session: Session, reason: EndReason) -> None: ...

    def requeue(self, vin: str) -> None: ...

    # -- events from the delivery client and housekeeping ----------------------------
    def broker_connected(self, up: bool) -> None: ...

    async def node_started(self, node: str, started_ms: int) -> None:
        """EMQX node `node` loaded us; it started at `started_ms` (our clock). When that is a
        restart, the sessions known on it are forgotten before this returns (EMQX calls no hook
        of a new session before its OnProviderLoaded is answered)."""
        ...

    def refused(self, vin: str, request_id: str, reason: str, final: bool) -> None: ...

    def sweep(self) -> None: ...

    def refresh_gauges(self) -> None: ...

    # -- the whole deployment's view (Admin API) ------------------------------------
    async def group_totals(self) -> tuple[int, int, int]:
        """(online vehicles, deliveries in flight, queued events)."""
        ...

    async def vehicle_state(self, vin: str) -> tuple[Session | None, Any]:
        """(presence session, in-flight entry) of `vin`."""
        ...

    async def group_online(self) -> list[str]:
        """Every online VIN, sorted."""
        ...

    async def pacing_of(self, request_id: str) -> tuple[int, int, str]:
        """(deliveries of `request_id` in flight fleet-wide, deliveries of it started in the last
        minute, where those were counted: "group" or "instance")."""
        ...

    async def online_among(self, vins: Sequence[str]) -> int:
        """How many of `vins` are online now (a preview's `online_now`)."""
        ...


@dataclass(frozen=True, slots=True)
class DispatchNeeds:
    """What a backend's dispatch takes from the server that runs it (`Backend.dispatcher`)."""

    #: Publishes a delivery (the MQTT delivery client, once started).
    publisher: Publisher
    #: Whether a clientid names its vehicle (vin_from_clientid); None: never.
    vin_from_clientid: Callable[[str], bool] | None
    #: Told of each pair's outcome (status_per_vehicle); None: nobody.
    on_outcome: OutcomeListener | None
    #: Told of each answer a vehicle sends.
    on_response: ResponseListener
    #: Who sends this instance's deliveries (its MQTT clientid).
    sender: Callable[[], str]
    #: Whether the delivery client holds its broker link now.
    connected: Callable[[], bool]
    #: The request ids whose campaign policy holds their rows now (dispatch/gates.py); None: none.
    held: Callable[[], frozenset[str]] | None = None
    #: Campaign pacing (max_per_minute, ramp, max_in_flight; dispatch/pacing.py); None: none.
    pacing: Pacer | None = None
    #: The request ids whose policy gives their rows high priority now (dispatch/gates.py).
    high: Callable[[], frozenset[str]] | None = None
    #: This process's delivery budget (max_deliveries_per_s, dispatch/budget.py); None: unbounded.
    budget: StartBudget | None = None
    #: Told of each delivery's latencies (exhook_server/latency.py); None: nobody.
    on_latency: LatencyListener | None = None
