"""Dispatch over a real PostgreSQL (exhook_server/backends/postgres/dispatch.py): the worker's rules on state
kept in the database, and several instances sharing one database (issue 14)."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from exhook_server.aio import cancel_all
from exhook_server.backends.postgres import pgmode
from exhook_server.backends.postgres.dispatch import SharedDispatcher
from exhook_server.config import Config
from exhook_server.dispatch.commands import EndReason, Session
from exhook_server.dispatch.pacing import LocalBudget, Pacer
from exhook_server.policy import Policy
from storage.lmdb.batches import RowSpec, sha1_of
from storage.lmdb.outcomes import Outcome
from storage.postgres import batches, migrate, outcomes
from storage.postgres import dispatch as pgd
from storage.postgres.constants import LEADER_LOCK, LockClass
from testkit.pg_cluster import PgCluster

_names = itertools.count()


@pytest.fixture
def dsn(pg_cluster: PgCluster) -> str:
    dsn = pg_cluster.new_database(f"shared_{next(_names)}")

    async def setup() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate.migrate(conn)
        finally:
            await conn.close()

    asyncio.run(setup())
    return dsn


class Recorder:
    """A Publisher that keeps what each instance sent, in order."""

    def __init__(self, name: str, log: list[tuple[str, str, str, bytes]]) -> None:
        self.name = name
        self.log = log
        self.up = True

    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        if not self.up:
            return False
        self.log.append((self.name, vin, request_id, payload))
        return True


class Rig:
    """`n` instances (SharedDispatcher + pool) over one database."""

    def __init__(self, dsn: str, n: int = 1, **kw: Any) -> None:
        self.dsn = dsn
        self.n = n
        self.kw = kw
        self.sent: list[tuple[str, str, str, bytes]] = []
        self.outcomes: list[tuple[str, str, Outcome, int]] = []
        self.instances: list[SharedDispatcher] = []
        self.pubs: list[Recorder] = []
        self.pools: list[Any] = []
        self.conn: Any = None

    async def __aenter__(self) -> Rig:
        self.conn = await asyncpg.connect(self.dsn)
        for i in range(self.n):
            pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4)
            pub = Recorder(f"i{i}", self.sent)
            kw = {
                "inflight_timeout_s": 60.0,
                "lanes": 4,
                "heartbeat_window_s": 0.002,
                "sender": lambda i=i: f"sdv-fanout-i{i}",
            } | self.kw
            d = SharedDispatcher(
                pool,
                pub,
                connected=lambda pub=pub: pub.up,
                vin_from_clientid=lambda c: c.startswith("V"),
                on_outcome=lambda vin, rid, sha1, outcome, attempts: self.outcomes.append(
                    (vin, rid, outcome, attempts)
                ),
                **kw,
            )
            d.start()
            self.instances.append(d)
            self.pubs.append(pub)
            self.pools.append(pool)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for d in self.instances:
            await d.stop()
        for pool in self.pools:
            await pool.close()
        await self.conn.close()

    async def batch(self, vins: list[str], rid: str, data: bytes, spec: RowSpec | None = None) -> None:
        kwargs = {} if spec is None else {"spec": spec}
        await batches.store_batch(self.conn, vins, rid, data, int(time.time() * 1000), **kwargs)
        self.instances[0].new_batch(vins)

    def sent_to(self, vin: str) -> list[str]:
        return [rid for _, v, rid, _ in self.sent if v == vin]

    async def until(self, cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; sent={self.sent}")
            await asyncio.sleep(0.005)

    async def one_out(self, rid: str, data: bytes) -> SharedDispatcher:
        """V1 online on the first instance with `rid` delivered to it and not PUBACKed; events done."""
        d = self.instances[0]
        d.subscribed(S("V1"), "V1")
        await self.batch(["V1"], rid, data)
        await self.until(lambda: self.sent_to("V1") == [rid], "the delivery")
        await self.idle()
        return d

    async def idle(self) -> None:
        """Every instance's queues empty (events done)."""
        await self.until(lambda: all(d.backlog() == 0 and not d._background for d in self.instances), "idle")


def S(vin: str, port: int = 1) -> Session:
    return Session("emqx@n1", vin, "10.0.0.1", port)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_online_vehicle_gets_oldest_first_one_at_a_time(dsn: str) -> None:
    async def body() -> None:
        async with Rig(dsn) as rig:
            d = rig.instances[0]
            d.subscribed(S("V1"), "V1")
            await rig.batch(["V1"], "task_a_1", b"one")
            await rig.batch(["V1"], "task_a_2", b"two")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "first delivery")
            await rig.idle()
            assert rig.sent_to("V1") == ["task_a_1"]  # one in flight
            d.acked(S("V1"), "V1", "task_a_1", sha1_of(b"one"))
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1", "task_a_2"], "second delivery")
            d.acked(S("V1"), "V1", "task_a_2", sha1_of(b"two"))
            await rig.until(lambda: len(rig.outcomes) == 2, "two outcomes")
            assert await outcomes.outcome_of(rig.conn, "V1", "task_a_1", sha1_of(b"one")) is Outcome.DELIVERED
            assert await rig.conn.fetchval("SELECT count(*) FROM rows") == 0

    run(body)


def test_offline_vehicle_gets_nothing_until_it_subscribes(dsn: str) -> None:
    async def body() -> None:
        async with Rig(dsn) as rig:
            await rig.batch(["V1"], "task_a_1", b"one")
            await rig.idle()
            assert rig.sent == []
            rig.instances[0].heartbeat(S("V1"), "V1")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "delivery on heartbeat")

    run(body)


def test_a_puback_from_another_client_ends_nothing_on_any_instance(dsn: str) -> None:
    """Another client's PUBACK of V1's delivery (it read V1's topic) ends nothing on any instance:
    the row stays out, nothing else is sent, counted; V1's own PUBACK then ends it."""
    from prometheus_client import REGISTRY

    def ignored() -> float:
        return REGISTRY.get_sample_value("sdv_fanout_acks_ignored_total", {"reason": "not_the_vehicle"}) or 0.0

    async def body() -> None:
        async with Rig(dsn, 2) as rig:
            a, b = rig.instances
            before = ignored()
            a.subscribed(S("V1"), "V1")
            await rig.batch(["V1"], "task_a_1", b"one")
            await rig.batch(["V1"], "task_a_2", b"two")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "delivery")
            b.acked(S("V2", 9), "V1", "task_a_1", sha1_of(b"one"))
            await rig.idle()
            assert ignored() == before + 1
            assert rig.sent_to("V1") == ["task_a_1"] and rig.outcomes == []
            assert await rig.conn.fetchval("SELECT count(*) FROM rows WHERE vin = 'V1'") == 2
            assert (await b.vehicle_state("V1"))[1] is not None  # still out
            b.acked(S("V1"), "V1", "task_a_1", sha1_of(b"one"))
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1", "task_a_2"], "next after the vehicle's ack")
            assert rig.outcomes == [("V1", "task_a_1", Outcome.DELIVERED, 1)]

    run(body)


def test_disconnect_elsewhere_voids_and_resubscribe_resends(dsn: str) -> None:
    """Subscribe on one instance, the disconnect (discarded) on another, a new subscription on a
    third: the delivery goes again as a re-send (attempt 2)."""

    async def body() -> None:
        async with Rig(dsn, 3) as rig:
            a, b, c = rig.instances
            a.subscribed(S("V1", 1), "V1")
            await rig.batch(["V1"], "task_a_1", b"one")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "delivery")
            b.ended(S("V1", 1), EndReason.DISCARDED)
            await rig.idle()
            assert await rig.conn.fetchval("SELECT count(*) FROM presence") == 0
            c.subscribed(S("V1", 2), "V1")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1", "task_a_1"], "re-send")
            c.acked(S("V1", 2), "V1", "task_a_1", sha1_of(b"one"))
            await rig.until(lambda: len(rig.outcomes) == 1, "outcome")
            assert rig.outcomes == [("V1", "task_a_1", Outcome.DELIVERED, 2)]

    run(body)


def test_resume_on_another_instance_does_not_resend(dsn: str) -> None:
    async def body() -> None:
        async with Rig(dsn, 2) as rig:
            a, b = rig.instances
            a.subscribed(S("V1", 1), "V1")
            await rig.batch(["V1"], "task_a_1", b"one")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "delivery")
            a.ended(S("V1", 1), EndReason.OFFLINE)
            b.resumed(S("V1", 2))
            await rig.idle()
            assert rig.sent_to("V1") == ["task_a_1"]
            b.acked(S("V1", 2), "V1", "task_a_1", sha1_of(b"one"))
            await rig.until(lambda: len(rig.outcomes) == 1, "outcome")

    run(body)


def test_timeout_sweep_resends_and_attempts_limit_fails(dsn: str) -> None:
    async def body() -> None:
        now = [time.time()]  # the instances' clock, stepped past the timeout before each sweep
        async with Rig(dsn, 2, inflight_timeout_s=60, max_attempts=2, clock=lambda: now[0]) as rig:
            a, b = rig.instances
            a.subscribed(S("V1"), "V1")
            await rig.batch(["V1"], "task_a_1", b"one")
            await rig.batch(["V1"], "task_a_2", b"two")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "delivery")
            b.sweep()  # not due yet
            await rig.idle()
            assert rig.sent_to("V1") == ["task_a_1"]
            for want in (["task_a_1", "task_a_1"], ["task_a_1", "task_a_1", "task_a_2"]):
                now[0] += 61
                b.sweep()
                await rig.until(lambda want=want: rig.sent_to("V1") == want, "the sweep's send")
            assert ("V1", "task_a_1", Outcome.FAILED, 2) in rig.outcomes

    run(body)


def test_awaited_answer_ends_responded_from_any_instance(dsn: str) -> None:
    async def body() -> None:
        async with Rig(dsn, 2) as rig:
            a, b = rig.instances
            a.subscribed(S("V1"), "V1")
            await rig.batch(["V1"], "task_diag_1", b"q", RowSpec(flags=1))
            await rig.batch(["V1"], "task_diag_2", b"r")
            await rig.until(lambda: rig.sent_to("V1") == ["task_diag_1"], "delivery")
            b.acked(S("V1"), "V1", "task_diag_1", sha1_of(b"q"))
            await rig.idle()
            assert rig.sent_to("V1") == ["task_diag_1"]  # the slot waits for the answer
            a.responded(S("V1"), "V1", "task_diag_1", b"ok", 2)
            await rig.until(lambda: rig.sent_to("V1") == ["task_diag_1", "task_diag_2"], "next after answer")
            assert ("V1", "task_diag_1", Outcome.RESPONDED, 1) in rig.outcomes

    run(body)


def test_cancel_marks_the_delivery_out_and_its_puback_amends(dsn: str) -> None:
    async def body() -> None:
        async with Rig(dsn, 2) as rig:
            a, b = rig.instances
            a.subscribed(S("V1"), "V1")
            await rig.batch(["V1", "V2"], "task_a_1", b"one")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "delivery")
            chunk = await batches.cancel_vins(rig.conn, "task_a_1", ["V1", "V2"], int(time.time() * 1000))
            assert await b.cancelled("task_a_1", chunk.cancelled) == 1
            a.acked(S("V1"), "V1", "task_a_1", sha1_of(b"one"))
            await rig.until(lambda: len(rig.outcomes) == 1, "amended")
            assert await outcomes.outcome_of(rig.conn, "V1", "task_a_1", sha1_of(b"one")) is Outcome.DELIVERED

    run(body)


def test_broker_lost_voids_only_this_instances_deliveries_and_back_resends(dsn: str) -> None:
    async def body() -> None:
        async with Rig(dsn, 2) as rig:
            a, _b = rig.instances
            a.subscribed(S("V1"), "V1")
            await rig.batch(["V1"], "task_a_1", b"one")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1"], "delivery")
            sender = rig.sent[-1][0]
            owner = rig.instances[int(sender[1])]
            rig.pubs[int(sender[1])].up = False
            owner.broker_connected(False)
            await rig.idle()
            assert await rig.conn.fetchval("SELECT voided FROM vin_state WHERE vin = 'V1'")
            rig.pubs[int(sender[1])].up = True
            owner.broker_connected(True)
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1", "task_a_1"], "re-send")

    run(body)


def test_a_restarted_node_forgets_what_it_held_and_our_link_sends_once_to_the_new_connection(dsn: str) -> None:
    """EMQX node n1 restarts while a delivery is out to V1 (its session on n1) and V2's session is
    on n2: the reload drops V1's presence and voids its delivery (our link's return sends nothing
    there), keeps n2's, and V1's new subscription gets the delivery once. A second reload of the
    same incarnation changes nothing."""

    async def body() -> None:
        async with Rig(dsn, 2) as rig:
            a, b = rig.instances
            n2 = Session("emqx@n2", "V2", "10.0.0.2", 7)
            a.subscribed(S("V1"), "V1")
            a.subscribed(n2, "V2")
            await rig.batch(["V1", "V2"], "task_a_1", b"one")
            await rig.until(lambda: rig.sent_to("V1") == rig.sent_to("V2") == ["task_a_1"], "deliveries")
            for pub, d in zip(rig.pubs, rig.instances, strict=True):
                pub.up = False
                d.broker_connected(False)
            await rig.idle()
            started = int(time.time() * 1000)
            await b.node_started("emqx@n1", started)
            assert await rig.conn.fetchval("SELECT array_agg(vin ORDER BY vin) FROM presence") == ["V2"]
            for pub, d in zip(rig.pubs, rig.instances, strict=True):
                pub.up = True
                d.broker_connected(True)
            await rig.until(lambda: rig.sent_to("V2") == ["task_a_1", "task_a_1"], "n2's vehicle re-sent")
            await rig.idle()
            assert rig.sent_to("V1") == ["task_a_1"]
            b.subscribed(S("V1", 2), "V1")
            await rig.until(lambda: rig.sent_to("V1") == ["task_a_1", "task_a_1"], "the new connection's delivery")
            await a.node_started("emqx@n1", started)  # the same incarnation, reloaded through another instance
            await rig.idle()
            assert await rig.conn.fetchval("SELECT count(*) FROM presence") == 2

    run(body)


def test_three_instances_random_hooks_never_two_in_flight(dsn: str) -> None:
    """The harsh mode: every hook of every vehicle goes to a random instance. Vehicles ack what
    they get; at no time does a vehicle have two deliveries out, everything is delivered, and
    each vehicle gets its requests oldest first."""

    async def body() -> None:
        rnd = random.Random(7)
        async with Rig(dsn, 3) as rig:
            vins = [f"V{n:03d}" for n in range(40)]
            for vin in vins:
                rnd.choice(rig.instances).subscribed(S(vin), vin)
            rids = [f"task_a_{n}" for n in range(5)]
            for rid in rids:
                await batches.store_batch(rig.conn, vins, rid, rid.encode(), int(time.time() * 1000))
                rnd.choice(rig.instances).new_batch(vins)
            acked = 0
            seen = 0
            out: dict[str, str] = {}
            deadline = time.monotonic() + 60
            while acked < len(vins) * len(rids):
                assert time.monotonic() < deadline, f"stuck at {acked} acks"
                for _, vin, rid, _payload in rig.sent[seen:]:
                    assert vin not in out, f"{vin} got {rid} while {out.get(vin)} was out"
                    out[vin] = rid
                seen = len(rig.sent)
                for vin, rid in list(out.items()):
                    if rnd.random() < 0.5:
                        del out[vin]
                        rnd.choice(rig.instances).acked(S(vin), vin, rid, sha1_of(rid.encode()))
                        acked += 1
                    elif rnd.random() < 0.2:
                        rnd.choice(rig.instances).heartbeat(S(vin), vin)
                await asyncio.sleep(0.01)
            await rig.idle()  # the last acks' events have run
            for vin in vins:
                assert rig.sent_to(vin) == rids
            assert await rig.conn.fetchval("SELECT count(*) FROM rows") == 0

    run(body)


def test_instances_triggering_the_same_vehicles_at_once_send_each_request_once(dsn: str) -> None:
    """Four instances hear of the same vehicles at the same moment (a heartbeat on one, a
    subscription on another, a new batch on the others): each vehicle gets its request once."""

    async def body() -> None:
        async with Rig(dsn, 4) as rig:
            vins = [f"V{n:02d}" for n in range(30)]
            await batches.store_batch(rig.conn, vins, "task_ota_1", b"fw", int(time.time() * 1000))
            for vin in vins:
                rig.instances[0].subscribed(S(vin), vin)
            for vin in vins:
                rig.instances[1].heartbeat(S(vin), vin)
                rig.instances[2].subscribed(S(vin), vin)
            rig.instances[3].new_batch(vins)
            await rig.until(lambda: len(rig.sent) >= len(vins), "deliveries")
            await rig.idle()
            assert sorted(v for _, v, _, _ in rig.sent) == vins

    run(body)


def test_a_vehicle_lock_held_by_an_instance_stalled_inside_a_statement_is_freed(dsn: str) -> None:
    """An instance stopped between a statement's Parse and its Bind (asyncpg prepares with Parse,
    Describe and Flush, then binds) leaves its backend "active", waiting for the client, with the
    vehicle's lock held: idle_in_transaction_session_timeout never ends that transaction, so every
    instance's events for the vehicle would wait for as long as it is stopped. end_stalled ends
    such a session (and only one that old), and the next event gets the lock."""

    async def body() -> None:
        pool = await pgmode.create_pool(Config(store_url=dsn, store_pool_size=3))
        # The stalled instance's session: the product's settings, PostgreSQL's idle bound short.
        settings = {"application_name": "sdv-fanout", "idle_in_transaction_session_timeout": "200"}
        stalled = await asyncpg.connect(dsn, server_settings=settings)
        try:
            await stalled.execute("BEGIN")
            await pgd.load(stalled, "V1", int(time.time() * 1000), 0)  # the vehicle's lock
            await stalled.prepare("SELECT 1")  # Parse, Describe, Flush: the Bind never comes
            pid = stalled.get_server_pid()

            async def lock_within(timeout_s: float) -> None:
                async with asyncio.timeout(timeout_s), pool.acquire() as conn, conn.transaction():
                    await pgd.load(conn, "V1", int(time.time() * 1000), 0)

            # Five times PostgreSQL's idle bound later, the lock is still held.
            with pytest.raises(TimeoutError):
                await lock_within(1.0)
            assert await pgmode.end_stalled(pool, older_than_s=60) == []  # younger: left alone
            [ended] = await pgmode.end_stalled(pool, older_than_s=0.5)
            assert (ended.pid, ended.state, ended.wait) == (pid, "active", "Client:ClientRead")
            await lock_within(2.0)
            assert await pgmode.end_stalled(pool, older_than_s=0.5) == []
        finally:
            stalled.terminate()
            await pool.close()

    run(body)


def test_a_stalled_leader_loses_the_lead_and_a_live_one_keeps_it(dsn: str) -> None:
    """The leader's session lock lives on an idle connection of its own, which no PostgreSQL
    timeout ends: a stopped leader kept the lead (and its jobs, the idle vehicles' wake-up among
    them, stopped) for as long as it was stopped. end_stalled ends a leader's connection silent
    for longer than its bound; a live leader's (a statement every retry_s) it leaves alone."""

    async def body() -> None:
        pool = await pgmode.create_pool(Config(store_url=dsn, store_pool_size=2))
        leading = asyncio.Event()

        async def job() -> None:
            leading.set()
            await asyncio.Event().wait()

        leader = asyncio.create_task(pgmode.lead(Config(store_url=dsn), lambda: [job()], retry_s=0.1))
        stalled = None
        try:
            async with asyncio.timeout(10):
                await leading.wait()
            # 2.5 s past a 2 s bound, a statement every 0.1 s: never silent that long. (A bound of
            # a few retries would end a live leader whenever a loaded machine paused this process.)
            for _ in range(25):
                assert await pgmode.end_stalled(pool, older_than_s=2.0) == []
                await asyncio.sleep(0.1)
            await cancel_all([leader])
            # A leader stopped while leading: the lock on its connection, and silence.
            settings = {"application_name": pgmode.LEADER_APPLICATION}
            stalled = await asyncpg.connect(dsn, server_settings=settings)
            assert await stalled.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK)
            ended: list[pgmode.Stalled] = []
            async with asyncio.timeout(5):
                while not ended:
                    ended = await pgmode.end_stalled(pool, older_than_s=0.5)
                    await asyncio.sleep(0.1)
            assert [(e.pid, e.state) for e in ended] == [(stalled.get_server_pid(), "idle")]
            assert await pool.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK)
        finally:
            await cancel_all([leader])
            if stalled is not None:
                stalled.terminate()
            await pool.close()

    run(body)


def test_a_request_lock_held_by_an_instance_stalled_inside_a_statement_is_freed(dsn: str) -> None:
    """The same stall inside a plugin-format batch's transaction, which holds its request's lock
    (shared) and its rows: a cancel of every vehicle of that request (the exclusive lock) would wait
    for as long as the instance is stopped. end_stalled ends it."""

    async def body() -> None:
        pool = await pgmode.create_pool(Config(store_url=dsn, store_pool_size=3))
        settings = {"application_name": "sdv-fanout", "idle_in_transaction_session_timeout": "200"}
        stalled = await asyncpg.connect(dsn, server_settings=settings)
        lock = "SELECT pg_advisory_xact_lock($1, hashtext($2))"
        try:
            await stalled.execute("BEGIN")
            await stalled.execute(lock.replace("lock(", "lock_shared("), LockClass.REQUEST, "task_ota_1")
            await stalled.prepare("SELECT 2")  # Parse, Describe, Flush: the Bind never comes
            pid = stalled.get_server_pid()

            async def cancel_lock_within(timeout_s: float) -> None:
                async with asyncio.timeout(timeout_s), pool.acquire() as conn, conn.transaction():
                    await conn.execute(lock, LockClass.REQUEST, "task_ota_1")

            with pytest.raises(TimeoutError):
                await cancel_lock_within(1.0)
            [ended] = await pgmode.end_stalled(pool, older_than_s=0.5)
            assert (ended.pid, ended.state) == (pid, "active")
            await cancel_lock_within(2.0)
        finally:
            stalled.terminate()
            await pool.close()

    run(body)


def test_a_batch_save_writes_only_vehicles_as_it_loaded_them_and_never_waits_for_their_lock(dsn: str) -> None:
    """save_many writes a vehicle's decision only if its presence and delivery are still what
    load_many read (another instance's event in between: CHANGED), and only if its lock is free
    right now (held: BUSY, at once, no wait); either way nothing of that vehicle is written, and
    the other vehicles of the batch are saved."""

    async def body() -> None:
        conn = await asyncpg.connect(dsn)
        other = await asyncpg.connect(dsn)
        try:
            now = int(time.time() * 1000)
            data = b"payload"
            await batches.store_batch(conn, ["V1", "V2", "V3"], "task_s_1", data, now)
            loaded = await pgd.load_many(conn, ["V1", "V2", "V3"], now, 3)
            assert [len(loaded[v].rows) for v in ("V1", "V2", "V3")] == [1, 1, 1]
            # Another instance brings V2 online in between; another holds V3's lock right now.
            await other.fetchval("SELECT sdv_vin_save('V2', $1, 1::int2, 'other', 0::int2, NULL, NULL, NULL, NULL, "
                                 "NULL, NULL, NULL, NULL, NULL, NULL, '{}', '{}', '{}', '{}', '{}')", now)  # fmt: skip
            lock = other.transaction()
            await lock.start()
            await pgd.load(other, "V3", now, 0)

            def sent(vin: str) -> pgd.Save:
                m = pgd.Marker("task_s_1", sha1_of(data), "mine", now, 1)
                return pgd.Save(vin, loaded[vin], presence=("mine",), marker=(m,), sender="i0")

            async with asyncio.timeout(5):  # a wait for V3's lock would take lock_timeout or forever
                verdicts = await pgd.save_many(conn, now, [sent("V1"), sent("V2"), sent("V3")])
            assert [v for v, _ in verdicts] == [pgd.SAVED, pgd.CHANGED, pgd.BUSY]
            await lock.rollback()
            marked = await conn.fetch("SELECT vin, sender FROM vin_state ORDER BY vin")
            assert [(r["vin"], r["sender"]) for r in marked] == [("V1", "i0")]
            online = await conn.fetch("SELECT vin, session FROM presence ORDER BY vin")
            assert [(r["vin"], r["session"]) for r in online] == [("V1", "mine"), ("V2", "other")]
        finally:
            await conn.close()
            await other.close()

    asyncio.run(body())


def test_a_vehicle_whose_paced_request_opened_during_its_load_waits_for_capacity(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event loads a vehicle's rows with the paced request passed over (no token here then);
    the pacer's tick gives it a token while the load is on its way. The vehicle found nothing
    because of that request, so it must wait for its capacity (`Pacer.idle`): the next tick offers
    it the token and it gets the request (it was forgotten until the periodic wake before)."""
    rid = "task_paced_1"
    wall = [1_000_000]
    budget = LocalBudget(clock=lambda: wall[0] / 1000)

    async def body() -> None:
        async with Rig(dsn) as rig:
            d = rig.instances[0]
            pacer = Pacer(budget, wall_ms=lambda: wall[0], on_wake=d.new_batch)
            d._pacing = pacer
            d.subscribed(S("V1"), "V1")
            await rig.idle()
            pacer.set(rid, Policy(max_per_minute=60), wall[0])
            assert rid in pacer.blocked()
            real_load = pgd.load_many
            ticked: list[bool] = []

            async def load_then_tick(*args: Any, **kwargs: Any) -> dict[str, pgd.Loaded]:
                loaded = await real_load(*args, **kwargs)
                if not ticked:  # the tick lands while the load is on its way
                    ticked.append(True)
                    await pacer.tick()
                    assert rid not in pacer.blocked()
                return loaded

            monkeypatch.setattr(pgd, "load_many", load_then_tick)
            await rig.batch(["V1"], rid, b"paced")
            await rig.until(lambda: bool(ticked), "the event's load")
            await rig.idle()
            await pacer.tick()  # the token is still here: the waiting vehicle is offered it
            await rig.until(lambda: rig.sent_to("V1") == [rid], "the paced delivery", timeout_s=10)

    run(body)


async def send_and_ack(conn: Any, vin: str, request_id: str, sha1: bytes, session: str, now: int) -> None:
    """Another instance's two events for an online, idle vehicle: it sends the row, then the
    vehicle's PUBACK ends it (nothing out again)."""
    seen = await pgd.load_many(conn, [vin], now, 3)
    out = pgd.Marker(request_id, sha1, session, now, 1)
    sent = pgd.Save(vin, seen[vin], marker=(out,), sender="sdv-fanout-other", sends=True)
    assert await pgd.save_many(conn, now, [sent]) == [(pgd.SAVED, [])]
    seen = await pgd.load_many(conn, [vin], now + 1, 3)
    acked = pgd.Save(vin, seen[vin], marker=(None,), ends=[(request_id, sha1, Outcome.DELIVERED, 1, b"")])
    assert await pgd.save_many(conn, now + 1, [acked]) == [(pgd.SAVED, [True])]


def test_a_send_decided_on_a_row_another_instance_sent_and_ended_since_the_load_is_not_saved(dsn: str) -> None:
    """A vehicle idle at the load, whose row another instance sent and saw PUBACKed before this
    save (its delivery recorded and gone again: the same empty state), is CHANGED: the send
    decided on that row is not written, so the vehicle never gets the row a second time."""

    async def body() -> None:
        conn = await asyncpg.connect(dsn)
        other = await asyncpg.connect(dsn)
        try:
            now = int(time.time() * 1000)
            data = b"payload"
            sha1 = sha1_of(data)
            await batches.store_batch(conn, ["V1"], "task_aba_1", data, now)
            await other.fetchval("SELECT sdv_vin_save('V1', $1, 1::int2, 'live', 0::int2, NULL, NULL, NULL, NULL, "
                                 "NULL, NULL, NULL, NULL, NULL, NULL, '{}', '{}', '{}', '{}', '{}')", now)  # fmt: skip
            loaded = await pgd.load_many(conn, ["V1"], now, 3)
            assert loaded["V1"].marker is None and [r.request_id for r, _ in loaded["V1"].rows] == ["task_aba_1"]
            await send_and_ack(other, "V1", "task_aba_1", sha1, "live", now + 10)
            # This instance's event, decided on the first load, sends that row.
            again = pgd.Marker("task_aba_1", sha1, "live", now + 40, 1)
            mine = pgd.Save("V1", loaded["V1"], marker=(again,), sender="i0", sends=True)
            assert await pgd.save_many(conn, now + 40, [mine]) == [(pgd.CHANGED, [])]
            assert await conn.fetchval("SELECT count(*) FROM vin_state") == 0
        finally:
            await conn.close()
            await other.close()

    asyncio.run(body())


def sent_total() -> float:
    return REGISTRY.get_sample_value("sdv_fanout_deliveries_sent_total") or 0.0


def test_an_event_that_loaded_a_row_another_instance_then_sent_and_saw_acked_does_not_send_it_again(dsn: str) -> None:
    """An online vehicle's event loads its row; before its save, another instance sends that row and
    the vehicle's PUBACK ends it (the vehicle is idle again, as at the load): the event's save is
    refused, it runs again on what is stored now and sends nothing (the vehicle got the row once);
    the send it had decided is not counted as sent (sdv_fanout_deliveries_sent_total)."""
    data = b"fw"
    sha1 = sha1_of(data)
    live: list[str] = []  # the vehicle's stored session
    interleaved: list[bool] = []

    def sender() -> str:
        # Asked for between this instance's load and its save: the other instance's events run
        # then, on a connection of their own (this loop is blocked meanwhile).
        if not interleaved:
            interleaved.append(True)

            async def other() -> None:
                conn = await asyncpg.connect(dsn)
                try:
                    await send_and_ack(conn, "V1", "task_once_1", sha1, live[0], int(time.time() * 1000))
                finally:
                    await conn.close()

            thread = threading.Thread(target=asyncio.run, args=(other(),))
            thread.start()
            thread.join(30)
        return "sdv-fanout-i0"

    async def body() -> None:
        async with Rig(dsn, sender=sender) as rig:
            rig.instances[0].subscribed(S("V1"), "V1")  # online, nothing to send yet
            await rig.idle()
            live.append(await rig.conn.fetchval("SELECT session FROM presence WHERE vin = 'V1'"))
            sends_before = sent_total()
            await rig.batch(["V1"], "task_once_1", data)
            await rig.until(lambda: bool(interleaved), "the new batch's event")
            await rig.idle()
            assert rig.sent == []
            assert sent_total() == sends_before
            assert await outcomes.outcome_of(rig.conn, "V1", "task_once_1", sha1) is Outcome.DELIVERED
            assert await rig.conn.fetchval("SELECT count(*) FROM vin_state") == 0

    run(body)


def test_a_failed_recheck_after_the_save_still_reports_what_the_save_wrote(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look for new work after a batch's save (the lost wake-up's recheck) fails: the PUBACK
    the save ended is still reported, once (its outcome is not lost with the recheck)."""

    async def body() -> None:
        async with Rig(dsn) as rig:
            d = await rig.one_out("task_r_1", b"one")
            failed: list[bool] = []

            async def lost(*args: object) -> list[str]:
                failed.append(True)
                raise ConnectionResetError("connection lost")

            monkeypatch.setattr(pgd, "with_work", lost)
            d.acked(S("V1"), "V1", "task_r_1", sha1_of(b"one"))
            await rig.until(lambda: bool(failed), "the recheck")
            await rig.idle()
            assert rig.outcomes == [("V1", "task_r_1", Outcome.DELIVERED, 1)]
            assert await rig.conn.fetchval("SELECT count(*) FROM rows") == 0

    run(body)


def test_a_stop_handles_the_vehicle_events_already_queued(dsn: str) -> None:
    """A PUBACK queued when the dispatcher stops is handled before it stops (the broker will not
    give it again): its row ends delivered."""

    async def body() -> None:
        async with Rig(dsn) as rig:
            d = await rig.one_out("task_stop_1", b"one")
            d.acked(S("V1"), "V1", "task_stop_1", sha1_of(b"one"))
            await d.stop()
            assert await outcomes.outcome_of(rig.conn, "V1", "task_stop_1", sha1_of(b"one")) is Outcome.DELIVERED

    run(body)
