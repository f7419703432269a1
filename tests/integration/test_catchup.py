"""The catch-up session on a real EMQX (5.8.9, shared: `emqx_brokers`): batches published while
every server process is stopped (SIGSTOP, then kill -9) are stored once and delivered once to
real vehicles after the processes continue or start again, in LMDB mode (a group of two
processes) and in PostgreSQL mode (two instances); the session moves with the PostgreSQL lead when
the leader is killed; a batch both the hook and the session saw is stored and delivered once.

The ExHook is registered with request_timeout 1 s: a stopped server costs each publish one second,
after which EMQX applies failed_action `ignore`, PUBACKs the platform and routes the batch to the
catch-up session. Every server of a test has a catch-up client id of its own, whose session the
test discards at the end (EMQX would keep it for a week and queue the next tests' batches there),
with the ExHook entry it registered.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.catchup import (
    DEADLINE_S,
    EXHOOK,
    REQUEST_TIMEOUT,
    Rig,
    batch,
    discard_session,
    hold_acks,
    hooks_reach,
    ids,
    pg_rows,
    release_acks,
    session_held,
)
from testkit.emqx_real import EmqxBroker, Platform, find_release, where_looked
from testkit.emqx_shared import SharedBrokers, unregister_exhook
from testkit.emqx_sim import free_port
from testkit.harness import SubprocessServer, Throttle, poll, signal_all, stop
from testkit.vehicle import Fleet, Vehicle

pytestmark = pytest.mark.slow

VERSION = "5.8.9"


@pytest.fixture(scope="module")
def broker(emqx_brokers: SharedBrokers) -> EmqxBroker:
    if find_release(VERSION) is None:
        pytest.skip(f"no EMQX {VERSION}: {where_looked()}")
    return emqx_brokers.get(VERSION)


@pytest.fixture
def rig(request: pytest.FixtureRequest, broker: EmqxBroker, tmp_path: Path) -> Iterator[Rig]:
    store = getattr(request, "param", "lmdb")
    store_url = ""
    if store == "postgresql":
        store_url = request.getfixturevalue("pg_cluster").new_database(f"catchup_{next(ids)}")
    r = Rig(broker, tmp_path, store_url)
    try:
        poll(r.session_held, DEADLINE_S, interval_s=0.1)
        yield r
    finally:
        r.close()


@pytest.fixture
def fleet(broker: EmqxBroker) -> Iterator[tuple[Fleet, Platform]]:
    f = Fleet(broker)
    platform = Platform(broker, clientid=f"sdv-platform-catchup-{next(ids)}")
    try:
        yield f, platform
    finally:
        platform.close()
        f.close()


def each_gets_each(vehicles: list[Vehicle], rids: list[str]) -> None:
    """Wait until every vehicle has every request, heartbeating as vehicles do (after a restart
    that is how the server finds them again); then each got each exactly once."""
    beat = Throttle(1.0)

    def done() -> bool:
        missing = [v for v in vehicles if not set(rids) <= set(v.request_ids())]
        if missing and beat.due():
            for v in missing:
                v.heartbeat("heartbeat")
        return not missing

    poll(done, DEADLINE_S, interval_s=0.05)
    for v in vehicles:
        assert Counter(v.request_ids()) == Counter(rids), (v.vin, v.request_ids())


def stored_once(rig: Rig | list[SubprocessServer], rids: list[str]) -> None:
    """Each request stored by exactly one `batch_stored` (a second sighting is a duplicate)."""
    runs = rig.runs if isinstance(rig, Rig) else rig
    stored = Counter(e["request_id"] for run in runs for e in run.events() if e.get("event") == "batch_stored")
    assert {rid: stored[rid] for rid in rids} == dict.fromkeys(rids, 1)


@pytest.mark.parametrize("rig", ["lmdb", "postgresql"], indirect=True)
def test_batches_published_while_every_process_is_stopped_or_killed_are_stored_and_delivered_once(
    rig: Rig, fleet: tuple[Fleet, Platform]
) -> None:
    """SIGSTOP every process, publish 3 batches (EMQX gives up on each hook call after 1 s and
    routes it to the catch-up session), SIGCONT: each stored once, delivered once. Then kill -9,
    publish 3 more (EMQX queues them in the offline session), start again: the same."""
    f, platform = fleet
    vins = [f"CU{next(ids):03d}V{i}" for i in range(3)]
    vehicles = f.online(vins)
    platform.publish("$SDV-FANOUT", batch(vins, "cu_first"))  # the hook stores it: the fleet is known
    each_gets_each(vehicles, ["cu_first"])
    poll(lambda: rig.rows(vins) == 0, DEADLINE_S)  # its acks taken (a stopped server would miss them)

    signal_all(rig.srv, signal.SIGSTOP)
    try:
        stopped = [f"cu_stopped_{n}" for n in range(3)]
        for rid in stopped:
            assert platform.publish("$SDV-FANOUT", batch(vins, rid)) == 0  # routed: one subscriber
    finally:
        signal_all(rig.srv, signal.SIGCONT)
    each_gets_each(vehicles, ["cu_first", *stopped])
    # The acks' deletes committed (LMDB commits them lazily: a kill -9 before that would rightly
    # deliver those requests again).
    poll(lambda: rig.rows(vins) == 0, DEADLINE_S)

    hold_acks(vehicles)
    rig.srv.kill()
    killed = [f"cu_killed_{n}" for n in range(3)]
    for rid in killed:
        assert platform.publish("$SDV-FANOUT", batch(vins, rid)) == 0  # queued in the offline session
    rig.start()
    hooks_reach(rig.srv, vehicles)
    release_acks(vehicles)
    each_gets_each(vehicles, ["cu_first", *stopped, *killed])
    poll(lambda: rig.rows(vins) == 0, DEADLINE_S)
    stored_once(rig, ["cu_first", *stopped, *killed])
    assert len(rig.events("catchup_ingested")) >= len(stopped) + len(killed)


def test_postgresql_the_session_moves_with_the_lead_when_the_leader_is_killed(
    broker: EmqxBroker, fleet: tuple[Fleet, Platform], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two instances on one database, the ExHook registered at the leader, which holds the session.
    kill -9 of the leader: EMQX routes the next 3 batches to the session, the other instance takes
    the lead within seconds and the session with it (same client id, EMQX resumes it), and each
    batch is stored once and delivered once."""
    store_url = request.getfixturevalue("pg_cluster").new_database(f"catchup_{next(ids)}")
    clientid = f"sdv-fanout-catchup-test{next(ids)}"
    env = {
        "SDV_FANOUT_MQTT_URL": broker.url,
        "SDV_FANOUT_STORE_URL": store_url,
        "SDV_FANOUT_PROCESSES": "1",
        "SDV_FANOUT_CATCHUP_CLIENTID": clientid,
        "SDV_FANOUT_INFLIGHT_TIMEOUT_S": "5",
    }
    ports = [free_port(), free_port()]
    servers = [
        SubprocessServer(tmp_path / f"lmdb{i}", "--listen", f"127.0.0.1:{p}", env=env) for i, p in enumerate(ports)
    ]
    try:
        [leader] = poll(lambda: [i for i, s in enumerate(servers) if s.logged("catchup_holding")], DEADLINE_S)
        other = servers[1 - leader]
        poll(lambda: session_held(broker, clientid), DEADLINE_S, interval_s=0.1)
        broker.register_exhook(
            EXHOOK,
            f"http://127.0.0.1:{ports[leader]}",
            pool_size=2,
            request_timeout=REQUEST_TIMEOUT,
            auto_reconnect="1s",
        )
        f, platform = fleet
        vins = [f"CF{next(ids):03d}V{i}" for i in range(3)]
        vehicles = f.online(vins)
        platform.publish("$SDV-FANOUT", batch(vins, "cf_first"))
        each_gets_each(vehicles, ["cf_first"])
        poll(lambda: pg_rows(store_url, vins) == 0, DEADLINE_S)  # its acks taken

        hold_acks(vehicles)
        servers[leader].kill()
        rids = [f"cf_after_{n}" for n in range(3)]
        for rid in rids:
            assert platform.publish("$SDV-FANOUT", batch(vins, rid)) == 0
        poll(lambda: other.logged("catchup_holding"), DEADLINE_S)
        # EMQX's calls reach the survivor (a Service would route them there): acks and heartbeats.
        broker.register_exhook(
            EXHOOK, f"http://127.0.0.1:{ports[1 - leader]}", pool_size=2, request_timeout=REQUEST_TIMEOUT
        )
        release_acks(vehicles)
        each_gets_each(vehicles, ["cf_first", *rids])
        stored_once(servers, ["cf_first", *rids])
        assert {e["request_id"] for e in other.events() if e.get("event") == "batch_stored"} >= set(rids)
    finally:
        try:
            unregister_exhook(broker, EXHOOK)
        finally:
            for s in servers:
                stop(s)
        discard_session(broker, clientid)


def test_a_batch_both_the_hook_and_the_session_saw_is_stored_and_delivered_once(
    rig: Rig, fleet: tuple[Fleet, Platform]
) -> None:
    """The same bytes through the hook and then, with the ExHook disabled, through the session
    (as when EMQX gave up on a slow hook call that still stored it): with and without batch_id,
    stored once, delivered once; a new batch through the session alone is stored and delivered."""
    f, platform = fleet
    vins = [f"CD{next(ids):03d}V{i}" for i in range(2)]
    vehicles = f.online(vins)
    plain, tagged = batch(vins, "cd_plain"), batch(vins, "cd_tagged", batch_id="cd-tagged-1")
    for payload in (plain, tagged):
        platform.publish("$SDV-FANOUT", payload)
    each_gets_each(vehicles, ["cd_plain", "cd_tagged"])
    poll(lambda: rig.rows(vins) == 0, DEADLINE_S)

    hold_acks(vehicles)
    rig.set_exhook(False)
    try:
        for payload in (plain, tagged, batch(vins, "cd_session_only")):
            assert platform.publish("$SDV-FANOUT", payload) == 0
        poll(lambda: len(rig.events("catchup_ingested")) == 3, DEADLINE_S)
    finally:
        rig.set_exhook(True)
        release_acks(vehicles)
    each_gets_each(vehicles, ["cd_plain", "cd_tagged", "cd_session_only"])
    stored_once(rig, ["cd_plain", "cd_tagged", "cd_session_only"])
    duplicates = {e["request_id"] for e in rig.events("batch_duplicate")}
    assert duplicates == {"cd_plain", "cd_tagged"}
