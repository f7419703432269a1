"""The product against real EMQX brokers: a v2 broker (5.8.9) and a v3 broker (5.9.1).

One broker per version (shared with the other real-EMQX files: the `emqx_brokers` fixture) and one
`sdv-fanout serve` subprocess per version for the whole module, registered through EMQX's REST API
and unregistered at its end (the test that restarts EMQX has a broker and server of its own): on
5.8.9 a group of two processes on LMDB (events forwarded between them), on 5.9.1 two instances on
PostgreSQL (`--processes 2 --store-url`: the kernel spreads EMQX's pool connections over both, each
handles whatever hook it gets, the database decides). Vehicles are real MQTT 5 clients
(testkit/vehicle.py) and the platform publishes real batches. Each test uses its own VINs, so tests
share the server without seeing each other's rows. Everything is on loopback and every process is
stopped at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from storage.lmdb.batches import sha1_of
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import Store
from testkit.emqx_real import EmqxBroker, Platform, available_versions, running_emqx, where_looked
from testkit.emqx_shared import SharedBrokers, unregister_exhook
from testkit.emqx_sim import free_port
from testkit.harness import BIN, SubprocessServer, Throttle, poll
from testkit.vehicle import Fleet, Vehicle

pytestmark = pytest.mark.slow
if not available_versions():  # one line in the summary, saying where releases were looked for
    pytest.skip(f"no real EMQX release: {where_looked()}", allow_module_level=True)

EXHOOK = "sdv-fanout"
#: (EMQX version, server processes, store): the v2 broker talks to a group of two on LMDB, the v3
#: broker to two instances on PostgreSQL.
SETUPS = [("5.8.9", 2, "lmdb"), ("5.9.1", 2, "postgresql")]
DEADLINE_S = 30.0


class Fanout:
    """`sdv-fanout serve` on a fixed loopback port (so it can restart in place), registered with EMQX."""

    def __init__(self, broker: EmqxBroker, workdir: Path, processes: int, store_url: str = "") -> None:
        self.broker = broker
        self.processes = processes
        self.port = free_port()
        self.data_dir = workdir / "lmdb"
        self.store_url = store_url
        self.env = {"SDV_FANOUT_MQTT_URL": broker.url, "SDV_FANOUT_PROCESSES": str(processes)}
        if store_url:
            self.env["SDV_FANOUT_STORE_URL"] = store_url
            # The database remembers what was out when every instance stopped (LMDB's memory does
            # not): a delivery whose PUBACK was lost meanwhile goes again after the in-flight
            # timeout, not at the vehicle's first heartbeat (test_server_restart_mid_fanout_...).
            self.env["SDV_FANOUT_INFLIGHT_TIMEOUT_S"] = "5"
        self.srv = self._start()
        broker.register_exhook(EXHOOK, f"http://127.0.0.1:{self.port}", pool_size=4, request_timeout="3s")

    def _start(self) -> SubprocessServer:
        return SubprocessServer(self.data_dir, "--listen", f"127.0.0.1:{self.port}", env=self.env)

    def ensure_running(self) -> None:
        """Start the broker and the server again if an earlier test left them dead."""
        if not self.broker.running:
            self.broker.start()
        if self.srv.proc.poll() is not None:
            self.srv.kill()
            self.srv = self._start()

    def halt(self, how: str) -> None:
        """SIGTERM (drain; it must exit 0) or kill -9."""
        if how == "sigterm":
            assert self.srv.terminate() == 0, self.srv.log()[-3000:]
        else:
            self.srv.kill()

    def start_again(self) -> None:
        """A new server on the same port and data dir."""
        self.srv = self._start()

    def _sql(self, query: str, *args: Any) -> Any:
        async def ask() -> Any:
            conn = await asyncpg.connect(self.store_url)
            try:
                return await conn.fetchval(query, *args)
            finally:
                await conn.close()

        return asyncio.run(ask())

    def rows(self, vins: list[str]) -> int:
        """Pending rows of these VINs, read while the server runs (LMDB read-only, or SQL)."""
        if self.store_url:
            return int(self._sql("SELECT count(*) FROM rows WHERE vin = ANY($1::text[])", vins))
        with Store(self.data_dir, readonly=True) as store:
            return sum(len(store.pending(v)) for v in vins)

    def outcome(self, vin: str, request_id: str, sha1: bytes) -> Outcome | None:
        if self.store_url:
            code = self._sql(
                "SELECT code FROM outcomes WHERE vin = $1 AND request_id = $2 AND sha1 = $3", vin, request_id, sha1
            )
            return None if code is None else Outcome(code)
        with Store(self.data_dir, readonly=True) as store:
            return store.outcome(vin, request_id, sha1)

    def inspect(self, vin: str) -> list[str]:
        """`sdv-fanout inspect VIN --json`: the request ids still pending, in delivery order."""
        where = ["--store-url", self.store_url] if self.store_url else ["--data-dir", str(self.data_dir)]
        out = subprocess.run(
            [str(BIN / "sdv-fanout"), "inspect", vin, *where, "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return [p["request_id"] for p in json.loads(out.stdout)["pending"]]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.srv.events() if e.get("event") == name]

    def stop(self) -> None:
        if self.srv.proc.poll() is None:
            self.srv.terminate()
        else:
            self.srv.kill()

    def leave(self) -> None:
        """Leave the broker as found: our ExHook entry goes first (EMQX never retries a server that
        is gone), then the server."""
        try:
            if self.broker.running:
                unregister_exhook(self.broker, EXHOOK)
        finally:
            self.stop()


@pytest.fixture(scope="module", params=SETUPS, ids=[f"emqx{v}-p{n}-{s}" for v, n, s in SETUPS])
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, emqx_brokers: SharedBrokers
) -> Iterator[Fanout]:
    version, processes, store = request.param
    if version not in available_versions():
        pytest.skip(f"no EMQX {version}: {where_looked()}")
    store_url = ""
    if store == "postgresql":
        store_url = request.getfixturevalue("pg_cluster").new_database(f"emqx_{version.replace('.', '_')}")
    fanout = Fanout(emqx_brokers.get(version), tmp_path_factory.mktemp(f"emqx{version}"), processes, store_url)
    try:
        yield fanout
    finally:
        fanout.leave()


_vin_prefixes = itertools.count()


def rig_of(fanout: Fanout) -> Iterator[tuple[Fanout, Fleet, Platform, str]]:
    """`fanout`, a fleet and a platform client of its broker, and a VIN prefix of the test's own."""
    fleet = Fleet(fanout.broker)
    platform = Platform(fanout.broker, clientid=f"sdv-platform-{next(_vin_prefixes)}")
    try:
        yield fanout, fleet, platform, f"T{next(_vin_prefixes):03d}V"
    finally:
        platform.close()
        fleet.close()


@pytest.fixture
def rig(setup: Fanout) -> Iterator[tuple[Fanout, Fleet, Platform, str]]:
    """The module's broker and server, a fleet and a platform client, and a VIN prefix of this test's own."""
    setup.ensure_running()
    yield from rig_of(setup)


@pytest.fixture
def own_rig(
    setup: Fanout, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Fanout, Fleet, Platform, str]]:
    """`rig`, but on a broker and a server of the test's own, set up as the module's: for a test
    that restarts the broker, which the shared one must not go through."""
    version = setup.broker.version
    store_url = ""
    if setup.store_url:
        store_url = request.getfixturevalue("pg_cluster").new_database(f"emqx_own_{version.replace('.', '_')}")
    with running_emqx(version, tmp_path) as broker:
        fanout = Fanout(broker, tmp_path, setup.processes, store_url)
        try:
            yield from rig_of(fanout)
        finally:
            fanout.stop()  # the broker goes with its entry


def vins_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def all_have(vehicles: list[Vehicle], rids: list[str]) -> bool:
    """Has every vehicle received every one of rids (at least once)?"""
    return all(set(rids) <= set(v.request_ids()) for v in vehicles)


def fleet_gets_each_once_one_at_a_time(
    fanout: Fanout, vehicles: list[Vehicle], vins: list[str], rids: list[str]
) -> None:
    """Wait until every vehicle has every request and no row is left; then each got each request
    exactly once, in order, never two unacknowledged at a time."""
    poll(lambda: all_have(vehicles, rids), DEADLINE_S)
    poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)
    for v in vehicles:
        assert v.request_ids() == rids, v.vin
        assert v.max_unacked == 1, v.vin


def snooped_puback_ends_nothing(fanout: Fanout, fleet: Fleet, platform: Platform, prefix: str) -> None:
    """A client subscribed to every vehicle's requests (EMQX's default ACL lets a loopback client
    read anything) gets a vehicle's delivery and PUBACKs it at once: the row stays out, neither
    delivered nor followed by the vehicle's next request, and the server says why; the vehicle's
    own PUBACK then ends it and the next request goes."""
    [vin] = vins_of(prefix, 1)
    v = fleet.vehicle(vin, auto_ack=False)
    v.connect()
    v.subscribe()
    snoop = fleet.vehicle(f"{prefix}S", clientid=f"snoop-{prefix}")  # acks whatever it gets
    snoop.connect()
    snoop.subscribe("+/+/proxy/request/+")  # a wildcard: no vehicle's presence, only its traffic
    platform.batch([vin], "task_snoop_1", "one")
    platform.batch([vin], "task_snoop_2", "two")
    poll(lambda: "task_snoop_1" in snoop.request_ids() and v.request_ids() == ["task_snoop_1"], DEADLINE_S)

    def ignored() -> list[dict[str, Any]]:
        return [e for e in fanout.events("ack_ignored") if e.get("vin") == vin]

    [event] = poll(ignored, DEADLINE_S)
    assert (event["reason"], event["acker"], event["request_id"]) == ("not_the_vehicle", snoop.clientid, "task_snoop_1")
    assert fanout.rows([vin]) == 2 and fanout.outcome(vin, "task_snoop_1", sha1_of(b"one")) is None
    assert v.request_ids() == ["task_snoop_1"]  # still one in flight: the first
    v.auto_ack = True
    assert v.ack_held() == 1
    poll(lambda: fanout.rows([vin]) == 0, DEADLINE_S)
    assert v.request_ids() == ["task_snoop_1", "task_snoop_2"]
    assert fanout.outcome(vin, "task_snoop_1", sha1_of(b"one")) is Outcome.DELIVERED


# ---------------------------------------------------------------------------------------------


def test_a_puback_from_another_client_ends_no_delivery(rig: Any) -> None:
    """On the message.acked hook path: see `snooped_puback_ends_nothing`."""
    snooped_puback_ends_nothing(*rig)


def test_seed_batches_reach_an_online_fleet_exactly_once_one_at_a_time(rig: Any) -> None:
    """Three `$SDV-FANOUT` batches for 30 online vehicles: each gets each request once, in order,
    never two unacknowledged at a time, and the PUBACKs leave no row behind."""
    fanout, fleet, platform, prefix = rig
    vins = vins_of(prefix, 30)
    vehicles = fleet.online(vins, hold_s=0.03)
    rids = [f"task_seed_{n}" for n in range(3)]
    for rid in rids:
        assert platform.batch(vins, rid, f"payload of {rid}") in (0x00, 0x10)
    fleet_gets_each_once_one_at_a_time(fanout, vehicles, vins, rids)
    for v in vehicles:
        assert [d.payload for d in v.received] == [f"payload of {rid}".encode() for rid in rids]


def test_plugin_pair_delivers_the_data_payload_whichever_comes_first(rig: Any) -> None:
    """The plugin format: data then trigger, and a trigger that arrives before its data, both deliver
    the raw data payload to every vehicle."""
    fanout, fleet, platform, prefix = rig
    vins = vins_of(prefix, 10)
    vehicles = fleet.online(vins, hold_s=0.01)
    blob_a, blob_b = b"\x00\xffbinary-a", b"\x01raw-b"
    platform.data(f"{prefix}-data-a", blob_a)
    platform.trigger(vins, "task_pair_1", f"{prefix}-data-a")
    platform.trigger(vins, "task_pair_2", f"{prefix}-data-b")  # its data comes later
    platform.data(f"{prefix}-data-b", blob_b)
    poll(lambda: all_have(vehicles, ["task_pair_1", "task_pair_2"]), DEADLINE_S)
    for v in vehicles:
        got = {d.request_id: d.payload for d in v.received}
        assert got == {"task_pair_1": blob_a, "task_pair_2": blob_b}, v.vin
        assert len(v.received) == 2, v.vin
    poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)


def test_late_subscriber_gets_its_queue_oldest_first(rig: Any) -> None:
    """Requests stored while the vehicles were offline arrive after they subscribe, oldest first."""
    fanout, fleet, platform, prefix = rig
    vins = vins_of(prefix, 10)
    rids = ["task_late_b", "task_late_a", "task_late_c"]
    for rid in rids:
        platform.batch(vins, rid, rid)
    assert fanout.rows(vins) == 30
    vehicles = fleet.online(vins)
    poll(lambda: all_have(vehicles, rids), DEADLINE_S)
    assert [v.request_ids() for v in vehicles] == [rids] * len(vins)
    poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)


def test_ack_deletes_the_row_that_inspect_shows(rig: Any) -> None:
    """A delivered request stays pending (as `inspect` shows) until the vehicle's PUBACK deletes it."""
    fanout, fleet, platform, prefix = rig
    [vin] = vins_of(prefix, 1)
    v = fleet.vehicle(vin, auto_ack=False)
    v.connect()
    v.subscribe()
    platform.batch([vin], "task_ack_1", "x")
    platform.batch([vin], "task_ack_2", "y")
    poll(lambda: v.request_ids() == ["task_ack_1"], DEADLINE_S)
    assert fanout.inspect(vin) == ["task_ack_1", "task_ack_2"]
    assert v.ack_held() == 1
    v.auto_ack = True
    poll(lambda: v.request_ids() == ["task_ack_1", "task_ack_2"], DEADLINE_S)
    poll(lambda: fanout.rows([vin]) == 0, DEADLINE_S)
    assert fanout.inspect(vin) == []


def test_heartbeat_makes_a_vehicle_online(rig: Any) -> None:
    """A vehicle whose subscription we do not recognise gets nothing until it publishes
    `ecp/<VIN>/online`; then its request arrives."""
    fanout, fleet, platform, prefix = rig
    quiet_vin, probe_vin = vins_of(prefix, 2)
    quiet = fleet.vehicle(quiet_vin)
    quiet.connect()
    quiet.subscribe(f"agent/{quiet_vin}/proxy/#")  # routes deliveries, but is not the request filter
    [probe] = fleet.online([probe_vin])
    platform.batch([quiet_vin, probe_vin], "task_hb_1", "x")
    # The same batch reached the recognised vehicle: had we taken `quiet` for online, it would have it too.
    poll(lambda: probe.request_ids() == ["task_hb_1"], DEADLINE_S)
    assert quiet.received == []
    assert fanout.rows([quiet_vin]) == 1
    quiet.heartbeat("online")
    poll(lambda: quiet.request_ids() == ["task_hb_1"], DEADLINE_S)
    poll(lambda: fanout.rows([quiet_vin]) == 0, DEADLINE_S)


def test_persistent_session_resume_is_redelivered_by_the_broker_not_resent(rig: Any) -> None:
    """A persistent session that drops before its PUBACK gets the request again from the broker
    session on resume, and then the next one: no second copy from us."""
    fanout, fleet, platform, prefix = rig
    [vin] = vins_of(prefix, 1)
    v = fleet.vehicle(vin, auto_ack=False, session_expiry_s=300)
    assert v.connect(clean_start=True) is False
    v.subscribe()
    platform.batch([vin], "task_res_1", "first")
    platform.batch([vin], "task_res_2", "second")
    poll(lambda: v.request_ids() == ["task_res_1"], DEADLINE_S)
    v.drop()
    v.auto_ack = True
    assert v.connect(clean_start=False) is True
    poll(lambda: fanout.rows([vin]) == 0, DEADLINE_S)
    assert v.request_ids() == ["task_res_1", "task_res_1", "task_res_2"]
    assert [d.dup for d in v.received] == [False, True, False]


@pytest.mark.parametrize("clean_start", [False, True], ids=["takeover", "discard"])
def test_second_connection_of_a_clientid_takes_over_the_request(rig: Any, clean_start: bool) -> None:
    """A second connection of the same clientid (session takeover, or a clean start discarding the
    session) gets the unacknowledged request and the next one; the first connection is kicked."""
    fanout, fleet, platform, prefix = rig
    [vin] = vins_of(prefix, 1)
    first = fleet.vehicle(vin, auto_ack=False, session_expiry_s=300)
    first.connect()
    first.subscribe()
    platform.batch([vin], "task_tk_1", "one")
    platform.batch([vin], "task_tk_2", "two")
    poll(lambda: first.request_ids() == ["task_tk_1"], DEADLINE_S)
    second = fleet.vehicle(vin, session_expiry_s=300)
    assert second.connect(clean_start=clean_start) is (not clean_start)
    if clean_start:
        second.subscribe()  # a new session has no subscriptions
    poll(lambda: second.request_ids() == ["task_tk_1", "task_tk_2"], DEADLINE_S)
    poll(lambda: not first.connected, DEADLINE_S)
    assert first.disconnect_reason == 0x8E  # Session taken over
    poll(lambda: fanout.rows([vin]) == 0, DEADLINE_S)
    assert first.request_ids() == ["task_tk_1"]
    assert second.request_ids() == ["task_tk_1", "task_tk_2"]


def test_bad_request_id_is_rejected_without_stalling_the_fleet(rig: Any) -> None:
    """A batch whose request_id holds U+0085 is refused (`bad_request_id`) and stores nothing; the
    vehicles still get every other request."""
    fanout, fleet, platform, prefix = rig
    vins = vins_of(prefix, 20)
    vehicles = fleet.online(vins, hold_s=0.01)
    platform.batch(vins, "task_ok_1", "one")
    platform.batch(vins, "task_bad_\u0085_1", "bad")
    platform.batch(vins, "task_ok_2", "two")
    poll(lambda: all_have(vehicles, ["task_ok_1", "task_ok_2"]), DEADLINE_S)
    poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)
    assert [v.request_ids() for v in vehicles] == [["task_ok_1", "task_ok_2"]] * len(vins)
    rejected = [e for e in fanout.events("batch_rejected") if e.get("reason") == "bad_request_id"]
    assert len(rejected) == 1


def test_broker_restart_mid_fanout_delivers_everything(own_rig: Any) -> None:
    """EMQX restarts while 20 vehicles each hold their first of 4 requests unacknowledged; once they
    reconnect, every request arrives (the one in flight at the restart at most twice)."""
    fanout, fleet, platform, prefix = own_rig
    vins = vins_of(prefix, 20)
    vehicles = fleet.online(vins, auto_ack=False)
    rids = [f"task_brk_{n}" for n in range(4)]
    for rid in rids:
        platform.batch(vins, rid, rid)
    poll(lambda: all(v.request_ids() == rids[:1] for v in vehicles), DEADLINE_S)
    platform.close()
    fanout.broker.stop()
    assert fanout.rows(vins) == len(vins) * len(rids)  # one in flight and three queued per vehicle
    fanout.broker.start()
    fanout.broker.wait_exhook(EXHOOK)
    for v in vehicles:
        v.auto_ack = True
        v.connect()
        v.subscribe()
    poll(lambda: all_have(vehicles, rids), DEADLINE_S)
    poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)
    for v in vehicles:
        assert sorted(set(v.request_ids())) == rids, v.vin
        assert max(Counter(v.request_ids()).values()) <= 2, (v.vin, v.request_ids())
    assert fanout.srv.proc.poll() is None


def test_answers_cancel_and_expiry_through_the_broker(rig: Any) -> None:
    """Through a real EMQX: a request awaiting answers holds each vehicle's slot until its answer
    (published on the response topic, which EMQX still routes to a platform subscriber), carries
    its Message-Expiry-Interval, and a cancel stops the next request for one vehicle."""
    fanout, fleet, platform, prefix = rig
    vins = vins_of(prefix, 3)
    spy = fleet.vehicle(f"{prefix}SPY")
    spy.connect()
    spy.subscribe(f"agent/+/proxy/response/task_diag_{prefix}")
    vehicles = fleet.online(vins)
    expires = int(time.time() * 1000) + 60_000
    diag, cfg = f"task_diag_{prefix}", f"task_cfg_{prefix}"
    platform.batch(vins, diag, "diag", await_response=True, expires_at=expires)
    platform.batch(vins, cfg, "cfg")
    poll(lambda: all_have(vehicles, [diag]), DEADLINE_S)
    for v in vehicles:
        [got] = v.received
        assert got.expiry_s is not None and 50 <= got.expiry_s <= 60, got
    platform.cancel(cfg, [vins[2]])
    vehicles[0].respond(diag, b"ok-0")
    vehicles[1].respond(diag, b"ok-1")
    poll(lambda: all_have(vehicles[:2], [diag, cfg]), DEADLINE_S)
    vehicles[2].respond(diag, b"ok-2")
    poll(lambda: len(spy.received) == 3, DEADLINE_S)  # routed on to the platform, too
    poll(lambda: fanout.outcome(vins[2], diag, sha1_of(b"diag")) is Outcome.RESPONDED, DEADLINE_S)
    assert fanout.outcome(vins[2], cfg, sha1_of(b"cfg")) is Outcome.CANCELLED
    poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)
    assert vehicles[2].request_ids() == [diag]
    assert [v.request_ids() for v in vehicles[:2]] == [[diag, cfg]] * 2
    assert fanout.events("response_ignored") == []


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_server_restart_mid_fanout_loses_nothing(rig: Any, how: str) -> None:
    """This server stops (SIGTERM drain or kill -9) while 20 vehicles each hold the first of 4
    requests; they PUBACK it while we are down, and once we are back on the same port and data
    their heartbeats bring every request (the first at most twice)."""
    fanout, fleet, platform, prefix = rig
    vins = vins_of(prefix, 20)
    vehicles = fleet.online(vins, auto_ack=False)
    rids = [f"task_srv_{n}" for n in range(4)]
    for rid in rids:
        platform.batch(vins, rid, rid)
    poll(lambda: all(v.request_ids() == rids[:1] for v in vehicles), DEADLINE_S)
    fanout.halt(how)
    assert fanout.rows(vins) == len(vins) * len(rids)  # one in flight and three queued per vehicle
    for v in vehicles:
        v.auto_ack = True
        assert v.ack_held() == 1  # EMQX cannot tell us: the ack is lost, the row stays
    fanout.start_again()
    beat = Throttle(1.0)

    def done() -> bool:
        missing = [v for v in vehicles if not set(rids) <= set(v.request_ids())]
        if missing and beat.due():
            for v in missing:  # vehicles heartbeat; after a restart, that is how we find them again
                v.heartbeat("heartbeat")
        return not missing

    poll(done, DEADLINE_S, interval_s=0.05)
    poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)
    for v in vehicles:
        assert max(Counter(v.request_ids()).values()) <= 2, (v.vin, v.request_ids())
