"""One vehicle's rows locked by someone else (PostgreSQL mode) cost only that vehicle's work.

Another session (here a connection of the test, in its own thread) holds `FOR UPDATE` on every
row of one vehicle for longer than `ingest_timeout_s`. Batches that must lock those rows answer
UNAVAILABLE within the ingest timeout and give their pool connection back at once (no session of
the server is left waiting on the lock); batches of every other vehicle, sent meanwhile and in
between, all succeed; once the lock goes, the locked vehicle's batch is stored too. A cancel of
every vehicle whose walk meets the locked rows tries that chunk again and finishes after the lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import asyncpg
import grpc
import pytest

from testkit.harness import ExHookClient, InProcessServer, poll

pytestmark = pytest.mark.slow

#: Small, so that holding the lock for several times this stays a short test.
INGEST_TIMEOUT_S = 1.5
POOL_SIZE = 4
LOCKED = "LOCKEDVIN00000001"
OTHERS = [f"OTHERVIN{i:09d}" for i in range(40)]


@pytest.fixture
def store_kind() -> str:
    return "postgresql"


@contextmanager
def rows_locked(dsn: str, vin: str) -> Iterator[Callable[[], float]]:
    """Every row of `vin` locked FOR UPDATE by a connection of our own until the block ends;
    yields how long the lock has been held (s)."""
    taken = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []
    since: list[float] = []

    async def hold() -> None:
        conn = await asyncpg.connect(dsn, server_settings={"application_name": "lock-holder"})
        try:
            async with conn.transaction():
                locked = await conn.fetch("SELECT vin FROM rows WHERE vin = $1 FOR UPDATE", vin)
                assert locked, "the vehicle has no rows to lock"
                since.append(time.monotonic())
                taken.set()
                for _ in range(6000):  # bounded: 60 s at most
                    if release.is_set():
                        break
                    await asyncio.sleep(0.01)
        finally:
            await conn.close()

    def run() -> None:
        try:
            asyncio.run(hold())
        except BaseException as exc:
            errors.append(exc)
            taken.set()

    thread = threading.Thread(target=run, name="lock-holder", daemon=True)
    thread.start()
    assert taken.wait(20)
    if errors:
        raise errors[0]
    try:
        yield lambda: time.monotonic() - since[0]
    finally:
        release.set()
        thread.join(20)


def waiting_on_locks(srv: InProcessServer) -> int:
    """Sessions of the server's pool waiting for a lock right now."""

    async def count() -> int:
        conn = await asyncpg.connect(srv.cfg.store_url)
        try:
            return int(
                await conn.fetchval(
                    """SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                       AND application_name = 'sdv-fanout' AND wait_event_type = 'Lock'"""
                )
            )
        finally:
            await conn.close()

    return asyncio.run(count())


def outcome(client: ExHookClient, vins: list[str], request_id: str, data: str) -> str:
    """The answer to the batch: "ok", or the name of its gRPC status code."""
    try:
        client.batch(vins, request_id, data)
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return "ok"


def test_a_locked_vehicle_fails_only_its_own_batches(make_server: Any) -> None:
    srv: InProcessServer = make_server(ingest_timeout_s=INGEST_TIMEOUT_S, store_pool_size=POOL_SIZE)
    clients = [ExHookClient(srv.port) for _ in range(8)]
    try:
        assert outcome(clients[0], [LOCKED, *OTHERS[:5]], "r-locked", "v1") == "ok"
        with rows_locked(srv.cfg.store_url, LOCKED) as held_s, ThreadPoolExecutor(8) as pool:
            # More batches that must wait for the locked rows than the pool has connections.
            first = list(
                pool.map(lambda i: outcome(clients[i], [LOCKED], "r-locked", f"v{i + 2}"), range(POOL_SIZE + 2))
            )
            assert first == ["UNAVAILABLE"] * (POOL_SIZE + 2)
            # They gave their connections back: nobody of ours waits on the lock any more.
            poll(lambda: waiting_on_locks(srv) == 0, timeout_s=INGEST_TIMEOUT_S)

            # Other vehicles' batches, with more locked ones arriving beside them, for as long as
            # the lock has not been held three ingest timeouts.
            others: list[str] = []
            locked: list[str] = []
            for n in range(200):  # bounded
                if held_s() > 3 * INGEST_TIMEOUT_S and n >= 4:
                    break
                round_ = [
                    pool.submit(outcome, clients[i], OTHERS[(n * 6 + i) % 40 : (n * 6 + i) % 40 + 1], f"r{n}", "x")
                    for i in range(6)
                ]
                stuck = [pool.submit(outcome, clients[6 + i], [LOCKED], "r-locked", f"w{n}{i}") for i in range(2)]
                others += [f.result() for f in round_]
                locked += [f.result() for f in stuck]
            assert others == ["ok"] * len(others), f"other vehicles' batches failed: {others}"
            assert set(locked) == {"UNAVAILABLE"}
            assert held_s() > 3 * INGEST_TIMEOUT_S
        # The lock gone, the vehicle's batch is stored.
        assert outcome(clients[0], [LOCKED], "r-locked", "after") == "ok"
        assert [r.request_id for r in srv.pending(LOCKED)] == ["r-locked"]
    finally:
        for c in clients:
            c.close()


def test_a_cancel_walk_waits_out_a_locked_vehicle_and_finishes(make_server: Any) -> None:
    """A cancel of every vehicle whose walk meets the locked vehicle's rows tries that chunk again
    (it neither holds its connection on the lock nor stops until the next start-up) and ends once
    the lock goes; other vehicles' batches succeed meanwhile."""
    srv: InProcessServer = make_server(
        ingest_timeout_s=INGEST_TIMEOUT_S, store_pool_size=POOL_SIZE, cancel_chunk_rows=2
    )
    first = [f"AAAVIN{i:011d}" for i in range(4)]  # before LOCKED in VIN order: the first chunks
    client = ExHookClient(srv.port)
    try:
        assert outcome(client, [*first, LOCKED], "r-cancel", "v1") == "ok"
        with rows_locked(srv.cfg.store_url, LOCKED) as held_s:
            client.publish(srv.cfg.cancel_topic, b'{"request_id": "r-cancel"}')
            poll(lambda: all(not srv.pending(v) for v in first))
            for n in range(200):  # bounded: until the walk has met the lock a few times
                if held_s() > 3 * srv.cfg.lock_timeout_s and n >= 4:
                    break
                assert outcome(client, [OTHERS[n % 40]], f"r-other-{n}", "x") == "ok"
            assert srv.cancels_in_progress() == ["r-cancel"]
            assert waiting_on_locks(srv) <= 1  # the chunk's try, if one is waiting right now
        poll(lambda: srv.cancels_in_progress() == [], timeout_s=20)
        assert srv.pending(LOCKED) == []
        assert srv.generations("r-cancel")[0].counts["cancelled"] == 5
    finally:
        client.close()
