"""kill -9 against the attempt limit and the answer-awaited state on LMDB.

A real `sdv-fanout serve` subprocess per server lifetime on one data dir, a real mosquitto, and
vehicles played by testkit/emqx_sim.py. A vehicle that takes its command and never PUBACKs it,
reconnecting after every restart, is counted at the vehicle: the command is delivered exactly
max_attempts times over five kill -9 restarts, ends failed, and the next request goes. The same
for a command awaiting the vehicle's answer: PUBACKed once, never delivered again across the
restarts, answered after the last one, then the next request.

Each kill comes once the lifetime's delivery (or PUBACK) is committed, read from the data dir:
what a kill inside that commit window may forget is the documented bound, not what this checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from storage.lmdb import outcomes
from storage.lmdb.batches import sha1_of
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import Store
from testkit.emqx_sim import FakeEmqx, Mosquitto, Vehicle
from testkit.harness import SubprocessServer, poll

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 6
KILLS = 5
VIN = "LSVATTEMPT0000001"
PROBE_VIN = "LSVATTEMPT0000002"
#: One worker: a vehicle's events and the probe vehicle's are handled in the order they came.
SERVER_ENV = {
    "SDV_FANOUT_GC_INTERVAL_S": "0",
    "SDV_FANOUT_WORKERS": "1",
    "SDV_FANOUT_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    # Re-sends come from the vehicle's reconnects, which the test drives, never from a timer.
    "SDV_FANOUT_INFLIGHT_TIMEOUT_S": "600",
    "SDV_FANOUT_STATUS_PER_VEHICLE": "false",
}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as b:
        yield b


@contextmanager
def lifetime(data_dir: Path, broker: Mosquitto, **env: str) -> Iterator[tuple[SubprocessServer, FakeEmqx]]:
    """One server process and the hook driver for it; the server is SIGKILLed on exit."""
    srv = SubprocessServer(data_dir, env={**SERVER_ENV, "SDV_FANOUT_MQTT_URL": broker.url, **env})
    emqx: FakeEmqx | None = None
    try:
        emqx = FakeEmqx(srv.port, broker.port, strict_rpc=False)  # calls cut short by the kill
        emqx.load()
        yield srv, emqx
    finally:
        srv.kill()
        if emqx is not None:
            emqx.close(check=False)


def online(emqx: FakeEmqx, vin: str, *, acks: bool) -> Vehicle:
    """A vehicle on a clean connection, subscribed to its requests."""
    v = emqx.vehicle(vin)
    v.auto_ack = acks
    v.connect()
    v.subscribe()
    return v


def payloads(v: Vehicle) -> list[bytes]:
    return [r.payload for r in v.received]


def committed(data_dir: Path, request_id: str, data: bytes, *, attempts: int, acked: bool = False) -> None:
    """Poll the data dir (read-only) until the row's deliveries are committed as expected."""
    with Store(data_dir, readonly=True) as store:

        def done() -> bool:
            kept = store.tried(VIN, request_id, sha1_of(data), 1 << 62)
            return kept.attempts == attempts and (kept.acked_ms > 0) == acked

        poll(done, timeout_s=10)


def outcome(data_dir: Path, request_id: str) -> outcomes.OutcomeRecord:
    """The row's outcome record, once committed (an end is committed lazily)."""
    with Store(data_dir, readonly=True) as store:

        def ended() -> outcomes.OutcomeRecord | None:
            with store.read() as txn:
                found = [r for r in outcomes.vehicle_outcomes(txn, store.tables, VIN) if r.request_id == request_id]
                return found[0] if found else None

        return poll(ended, timeout_s=10)


def test_a_command_never_pubacked_ends_failed_after_max_attempts_across_kill9(
    tmp_path: Path, broker: Mosquitto
) -> None:
    """Five kill -9 restarts, the vehicle reconnecting after each: the command is delivered
    max_attempts times in all, ends failed, and the request behind it is delivered."""
    data_dir = tmp_path / "lmdb"
    delivered = 0
    for life in range(KILLS + 1):
        with lifetime(data_dir, broker) as (_, emqx):
            if life == 0:
                emqx.publish_batch([VIN], "task_poison", "never")
                emqx.publish_batch([VIN], "task_next", "next")
            v = online(emqx, VIN, acks=False)
            v.wait_for(1)
            committed(data_dir, "task_poison", b"never", attempts=life + 1)
            if life == KILLS:  # sent max_attempts times: the next reconnect ends it
                v.reconnect(clean_start=True)
                v.subscribe()
                v.wait_for(2)
                assert payloads(v)[1] == b"next"
                record = outcome(data_dir, "task_poison")
            delivered += payloads(v).count(b"never")
    assert delivered == MAX_ATTEMPTS
    assert (record.outcome, record.attempts) == (Outcome.FAILED, MAX_ATTEMPTS)


def test_a_command_awaiting_its_answer_is_not_sent_again_across_kill9(tmp_path: Path, broker: Mosquitto) -> None:
    """PUBACKed in the first lifetime, not answered yet: not delivered again after any of five
    kill -9 restarts (the vehicle reconnecting after each), its slot still taken; the answer
    the vehicle then gives ends it responded, and the next request goes. (Its response timeout
    counting the time before a restart: tests/unit/test_attempts_kept.py, on an injected clock.)"""
    data_dir = tmp_path / "lmdb"
    delivered = 0
    for life in range(KILLS + 1):
        with lifetime(data_dir, broker) as (_, emqx):
            if life == 0:
                emqx.publish_batch([VIN], "task_diag", "diag", await_response=True)
                emqx.publish_batch([VIN], "task_next", "next")
            v = online(emqx, VIN, acks=True)
            if life == 0:
                v.wait_for(1)
                committed(data_dir, "task_diag", b"diag", attempts=1, acked=True)
            # A barrier: with one worker, the probe's delivery is published after the vehicle's
            # subscribe was handled (a re-send of the awaited command, or the next request sent
            # while it holds the slot, would be published before it).
            probe = online(emqx, PROBE_VIN, acks=True)
            emqx.publish_batch([PROBE_VIN], f"task_probe_{life}", f"probe{life}")
            probe.wait_for(1)
            if life == KILLS:
                assert payloads(v) == []
                v.respond("task_diag", b"ok")
                assert [r.payload for r in v.wait_for(1)] == [b"next"]
                record = outcome(data_dir, "task_diag")
            delivered += payloads(v).count(b"diag")
    assert delivered == 1
    assert (record.outcome, record.attempts, record.response) == (Outcome.RESPONDED, 1, b"ok")
