"""A seeded randomized simulation of a fleet against the real Dispatcher (ring, queues, workers).

A small broker model plays MQTT: deliveries reach a vehicle's live connection,
wait in a persistent session while it is offline, and die with a discarded or
terminated session. Events (connect, resume, disconnect, drop, heartbeat,
batch, ack, our broker link dropping) are interleaved at random. Invariants:
never two of our deliveries outstanding at one vehicle without a cause; every
row of a vehicle that stays online long enough is delivered and deleted;
nothing is published on another VIN's topic.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from exhook_server.dispatch.commands import EndReason, Session
from exhook_server.dispatch.pool import Dispatcher
from tests.dispatch_fakes import MemoryRows, sha1

SEEDS = [1, 2, 3, 4, 5, 6]
VEHICLES = 120
STEPS = 1500


@dataclass
class Delivery:
    vin: str
    request_id: str
    payload: bytes
    epoch: int  # our broker-link epoch when published


@dataclass
class Vehicle:
    vin: str
    session: Session | None = None  # live connection
    persistent: bool = False
    #: Broker-side session state: deliveries not yet acked (sent to the connection or queued).
    unacked: list[Delivery] = field(default_factory=list)
    has_session: bool = False  # a broker session exists (live or persistent-idle)
    last_session: Session | None = None


class Fleet:
    """The broker model and the checks; the Dispatcher under test publishes into it."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.rows = MemoryRows()
        self.vehicles = {f"VIN{n:05d}": Vehicle(f"VIN{n:05d}") for n in range(VEHICLES)}
        self.epoch = 0
        self.link_up = True
        self.port = 10_000
        self.violations: list[str] = []
        self.published = 0

    # -- the Publisher seam -------------------------------------------------------
    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        if not self.link_up:
            return False
        self.published += 1
        row = self.rows.rows.get((vin, request_id))
        if row is None or row[1] != payload:
            self.violations.append(f"published {vin}/{request_id} which is not that VIN's row")
        v = self.vehicles[vin]
        # Outstanding since the last link loss, and not a duplicate of a row already completed.
        same_epoch = [
            d
            for d in v.unacked
            if d.epoch == self.epoch and self.rows.rows.get((vin, d.request_id), (0, None))[1] == d.payload
        ]
        if same_epoch:
            self.violations.append(f"{vin}: second delivery {request_id} while {same_epoch[0].request_id} unacked")
        if v.has_session:
            v.unacked.append(Delivery(vin, request_id, payload, self.epoch))
        return True

    # -- vehicle actions -------------------------------------------------------------
    def new_session(self, vin: str) -> Session:
        self.port += 1
        return Session("emqx@n1", vin, "10.1.0.1", self.port)


async def settle(d: Dispatcher) -> None:
    """Let the workers run until every queue is empty (single-threaded, deterministic)."""
    for _ in range(10_000):
        await asyncio.sleep(0)
        if d.backlog() == 0:
            await asyncio.sleep(0)
            if d.backlog() == 0:
                return
    raise AssertionError("dispatch did not settle")


async def simulate(seed: int, vin_from_clientid: bool = False) -> Fleet:
    rng = random.Random(seed)
    fleet = Fleet(rng)
    # With vin_from_clientid the pool keeps no client map for these vehicles (clientid = VIN).
    named = (lambda clientid: True) if vin_from_clientid else None
    d = Dispatcher(fleet.rows, fleet, workers=4, inflight_timeout_s=1e9, vin_from_clientid=named)
    d.start()
    vins = list(fleet.vehicles)
    rids = [f"task_{t}_{n}" for t in ("ota", "cfg") for n in range(4)]

    def connect(v: Vehicle, clean: bool) -> None:
        s = fleet.new_session(v.vin)
        if not clean and v.has_session:
            d.resumed(s)  # the broker redelivers the session's unacked messages itself
        else:
            if v.has_session and v.last_session is not None:
                d.ended(v.last_session, EndReason.DISCARDED)
            v.unacked.clear()  # a clean start loses the old session
        v.session = v.last_session = s
        v.has_session, v.persistent = True, not clean
        d.connected(s)
        if clean:
            d.subscribed(s, v.vin)

    def disconnect(v: Vehicle, reason: str) -> None:
        assert v.session is not None
        s, v.session = v.session, None
        d.ended(s, EndReason.OFFLINE)
        if not v.persistent:
            d.ended(s, EndReason.TERMINATED)
            v.has_session = False
            v.unacked.clear()

    for _ in range(STEPS):
        v = fleet.vehicles[rng.choice(vins)]
        r = rng.random()
        if r < 0.12:
            if v.session is None:
                connect(v, clean=not (v.has_session and rng.random() < 0.6))
        elif r < 0.18:
            if v.session is not None:
                disconnect(v, rng.choice(["normal", "tcp_closed", "keepalive_timeout"]))
        elif r < 0.30:
            if v.session is not None:
                d.heartbeat(Session("emqx@n1", v.vin, "10.1.0.1"), v.vin)
        elif r < 0.55:
            batch = rng.sample(vins, rng.randint(1, 30))
            rid = rng.choice(rids)
            payload = rng.choice([b"shared", rid.encode(), rng.randbytes(8)])
            for vin in batch:
                fleet.rows.add(vin, rid, payload)
            d.new_batch(batch)
        elif r < 0.97:
            if v.session is not None and v.unacked:
                msg = v.unacked.pop(0)
                d.acked(v.session, v.vin, msg.request_id, sha1(msg.payload))
        else:
            fleet.link_up = not fleet.link_up
            if not fleet.link_up:
                fleet.epoch += 1
            d.broker_connected(fleet.link_up)
        await settle(d)

    # Everyone comes online, the link is up, and vehicles ack everything they get.
    if not fleet.link_up:
        fleet.link_up = True
        d.broker_connected(True)
    for v in fleet.vehicles.values():
        if v.session is None:
            connect(v, clean=True)
    await settle(d)
    for _ in range(200):
        acted = False
        for v in fleet.vehicles.values():
            while v.unacked:
                msg = v.unacked.pop(0)
                d.acked(v.session, v.vin, msg.request_id, sha1(msg.payload))  # type: ignore[arg-type]
                acted = True
        await settle(d)
        if not acted:
            break
    await d.stop()
    return fleet


@pytest.mark.parametrize("vin_from_clientid", [False, True], ids=["client-map", "clientid-is-vin"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_fleet_keeps_invariants_and_drains(seed: int, vin_from_clientid: bool) -> None:
    """Random interleavings never put two deliveries in flight, never mix VINs, and drain every row."""
    fleet = asyncio.run(simulate(seed, vin_from_clientid))
    assert fleet.violations == [], f"seed {seed}: {fleet.violations[:5]}"
    assert fleet.rows.rows == {}, f"seed {seed}: {len(fleet.rows.rows)} rows never delivered"
    assert fleet.published > 100
