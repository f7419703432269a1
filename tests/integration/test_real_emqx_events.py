"""Vehicle events over MQTT (the default `emqx sync` provisions) on real EMQX 5.8.9 and 5.9.1.

One broker per version for the module (shared with test_emqx_acl.py: `emqx_brokers`), running
deploy/emqx/acl.conf verbatim with authorization.no_match = deny (the ACL is what vouches for a
heartbeat's or answer's VIN), and one `sdv-fanout serve` group provisioned by `sdv-fanout emqx
sync` with the EMQX API configured (all of which it removes at its end): heartbeats and answers
through the shared subscription, PUBACKs through the ack rule. On 5.8.9
two processes on LMDB, on 5.9.1 two on PostgreSQL (where a third instance joins and leaves the
events group mid-fanout). Vehicles, the platform and forgers are real MQTT clients.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exhook_server import emqx_sync
from exhook_server.config import Config
from testkit.emqx_real import (
    EmqxBroker,
    Platform,
    _descendants,
    file_authorization,
    find_release,
    where_looked,
)
from testkit.emqx_shared import SharedBrokers
from testkit.emqx_sim import free_port
from testkit.harness import BIN, ROOT, SubprocessServer, poll
from testkit.vehicle import Fleet, Vehicle
from tests.integration import test_real_emqx
from tests.integration.test_real_emqx import DEADLINE_S, EXHOOK, SETUPS, Fanout, fleet_gets_each_once_one_at_a_time
from tests.integration.test_real_emqx_rule_acks import Client

pytestmark = test_real_emqx.pytestmark

#: Longer than any wait of this module: a heartbeat PUBACK that waited for a stopped server's hook
#: would not come within DEADLINE_S.
REQUEST_TIMEOUT_S = 120
#: The name of the module's EMQX API key (the server's and `emqx sync`'s).
API_KEY = "sdv-fanout-events"


class EventsFanout(Fanout):
    """The server with the EMQX API configured (vehicle_events = auto: mqtt), provisioned by `emqx sync`."""

    def __init__(self, broker: EmqxBroker, workdir: Path, processes: int, store_url: str = "") -> None:
        key, secret = broker.create_api_key(API_KEY)
        self.broker = broker
        self.port = free_port()
        self.data_dir = workdir / "lmdb"
        self.store_url = store_url
        self.env = {
            "SDV_FANOUT_MQTT_URL": broker.url,
            "SDV_FANOUT_MQTT_USERNAME": "sdv-fanout",  # the user deploy/emqx/acl.conf names
            "SDV_FANOUT_PROCESSES": str(processes),
            "SDV_FANOUT_EMQX_API_URL": f"http://127.0.0.1:{broker.api_port}",
            "SDV_FANOUT_EMQX_API_KEY": key,
            "SDV_FANOUT_EMQX_API_SECRET": secret,
            "SDV_FANOUT_EMQX_EXHOOK_URL": f"http://127.0.0.1:{self.port}",
            "SDV_FANOUT_EMQX_EXHOOK_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
            "SDV_FANOUT_AWAIT_RESPONSE": "false",
        }
        if store_url:
            self.env["SDV_FANOUT_STORE_URL"] = store_url
            self.env["SDV_FANOUT_INFLIGHT_TIMEOUT_S"] = "5"
        self.srv = self._start()
        self.sync()

    def sync(self) -> str:
        """`sdv-fanout emqx sync` with the server's settings; its output."""
        out = subprocess.run(
            [str(BIN / "sdv-fanout"), "emqx", "sync"],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def leave(self) -> None:
        """What `emqx sync` added and our API key go too: the broker is left as found."""
        super().leave()
        if self.broker.running:
            for rule in self.broker.api("GET", "/rules")["data"]:
                if rule.get("name") == emqx_sync.RULE_ID:
                    self.broker.api("DELETE", f"/rules/{rule['id']}")
            self.broker.api("DELETE", f"/api_key/{API_KEY}")

    def cfg(self) -> Config:
        return Config(emqx_api_url=self.env["SDV_FANOUT_EMQX_API_URL"], mqtt_url=self.broker.url)

    def metric(self, name: str, **labels: str) -> float:
        """A counter summed over the group, from /metrics."""
        return metric(self.srv, name, **labels)

    def pids(self) -> list[int]:
        """The group's processes: the parent and its children."""
        return [self.srv.proc.pid, *(pid for pid, _ in _descendants(self.srv.proc.pid))]


@pytest.fixture(scope="module", params=SETUPS, ids=[f"emqx{v}-p{n}-{s}" for v, n, s in SETUPS])
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, emqx_brokers: SharedBrokers
) -> Iterator[EventsFanout]:
    version, processes, store = request.param
    if find_release(version) is None:
        pytest.skip(f"no EMQX {version}: {where_looked()}")
    store_url = ""
    if store == "postgresql":
        store_url = request.getfixturevalue("pg_cluster").new_database(f"events_{version.replace('.', '_')}")
    workdir = tmp_path_factory.mktemp(f"emqx{version}-events")
    broker = emqx_brokers.get(version, env=file_authorization(ROOT / "deploy" / "emqx" / "acl.conf"))
    fanout = EventsFanout(broker, workdir, processes, store_url)
    try:
        poll(lambda: fanout.metric("sdv_fanout_events_subscribed") == processes, DEADLINE_S)
        yield fanout
    finally:
        fanout.leave()


_prefixes = itertools.count()


@pytest.fixture
def rig(setup: EventsFanout) -> Iterator[tuple[EventsFanout, Fleet, Platform, str]]:
    fleet = Fleet(setup.broker)
    platform = Platform(setup.broker, clientid=f"sdv-platform-ev{next(_prefixes)}", username="sdv-platform")
    try:
        yield setup, fleet, platform, f"E{next(_prefixes):03d}V"
    finally:
        platform.close()
        fleet.close()


def metric(srv: SubprocessServer, name: str, **labels: str) -> float:
    """A metric of a server (its group's sum), from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def vins_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def answer_what_arrived(vehicles: list[Vehicle], answered: set[tuple[str, str]]) -> None:
    """Each vehicle answers each request it received and has not answered yet."""
    for v in vehicles:
        for rid in v.request_ids():
            if (v.vin, rid) not in answered:
                answered.add((v.vin, rid))
                v.respond(rid, f"answer of {v.vin} to {rid}".encode())


# ---------------------------------------------------------------------------------------------


def test_sync_provisions_events_over_mqtt_and_a_fleet_gets_each_request_once_in_order(rig: Any) -> None:
    """EMQX holds no hook for heartbeats, answers or PUBACKs and has the ack rule; 20 vehicles that
    heartbeat get 3 requests each exactly once, oldest first, one unacknowledged at a time; their
    heartbeats reach the server over the shared subscription; a second sync changes nothing."""
    fanout, fleet, platform, prefix = rig
    hooks = emqx_sync.held_hooks(fanout.broker.exhook_hooks(EXHOOK))
    assert hooks == emqx_sync.wanted_hooks(fanout.cfg())
    assert "message.acked" not in hooks and not any("ecp/" in t for t in hooks["message.publish"])
    assert [r["name"] for r in fanout.broker.api("GET", "/rules")["data"]] == [emqx_sync.RULE_ID]
    beats0 = fanout.metric("sdv_fanout_vehicle_events_total", kind="heartbeat")
    vins = vins_of(prefix, 20)
    vehicles = fleet.online(vins, hold_s=0.02)
    for v in vehicles:
        v.heartbeat("heartbeat")
    rids = [f"task_ev_{n}" for n in range(3)]
    for rid in rids:
        assert platform.batch(vins, rid, f"payload of {rid}") < 0x80
    fleet_gets_each_once_one_at_a_time(fanout, vehicles, vins, rids)
    poll(lambda: fanout.metric("sdv_fanout_vehicle_events_total", kind="heartbeat") - beats0 >= len(vins), DEADLINE_S)
    assert "0 change(s) made" in fanout.sync()


def test_heartbeat_puback_does_not_wait_for_a_stopped_server(rig: Any) -> None:
    """With every server process SIGSTOPped, a vehicle's heartbeat is PUBACKed (EMQX calls no hook
    for it; the ExHook request_timeout is far beyond the wait), and reaches the server once it runs."""
    fanout, fleet, _, prefix = rig
    [vin] = vins_of(prefix, 1)
    [v] = fleet.online([vin])
    beats0 = fanout.metric("sdv_fanout_vehicle_events_total", kind="heartbeat")
    pids = fanout.pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            v.heartbeat("heartbeat", timeout_s=DEADLINE_S)  # raises when no PUBACK came
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    poll(lambda: fanout.metric("sdv_fanout_vehicle_events_total", kind="heartbeat") - beats0 >= 3, DEADLINE_S)


def test_forged_heartbeats_answers_and_members_change_nothing(rig: Any) -> None:
    """Under the shipped ACL a vehicle cannot heartbeat or answer as another VIN (PUBACK 0x87), nor
    join the server's events group or publish on its ack topics: the other vehicle's awaited
    answer stays awaited until the vehicle itself answers."""
    fanout, fleet, platform, prefix = rig
    victim_vin, forger_vin = vins_of(prefix, 2)
    [victim] = fleet.online([victim_vin])
    forger = Client(fanout.broker, forger_vin)
    try:
        assert platform.batch([victim_vin], "task_forge", "x", await_response=True) < 0x80
        poll(lambda: victim.request_ids() == ["task_forge"], DEADLINE_S)
        assert forger.publish(f"agent/{victim_vin}/proxy/response/task_forge", b"forged") == 0x87
        assert forger.publish(f"ecp/{victim_vin}/heartbeat", b"{}") == 0x87
        assert forger.publish("$SDV-FANOUT/acked/sdv-fanout-any", b"{}") == 0x87
        group = Config().events_share_group
        assert forger.subscribe(f"$share/{group}/agent/+/proxy/response/+") == 0x87
        assert forger.subscribe(f"$share/{group}/ecp/+/heartbeat") == 0x87
        assert fanout.rows([victim_vin]) == 1
        victim.respond("task_forge", b"real")
        poll(lambda: fanout.rows([victim_vin]) == 0, DEADLINE_S)
        assert fanout.metric("sdv_fanout_responses_total", result="accepted") >= 1
    finally:
        forger.close()


def test_events_members_leaving_and_joining_mid_fanout_lose_nothing(rig: Any) -> None:
    """PostgreSQL: a third instance joins the events group, serves part of a fanout of requests
    awaiting answers, leaves (SIGTERM) and joins again mid-way; every row ends responded."""
    fanout, fleet, platform, prefix = rig
    if not fanout.store_url:
        pytest.skip("two instances share a store on PostgreSQL only")
    env = {**fanout.env, "SDV_FANOUT_PROCESSES": "1"}
    vins = vins_of(prefix, 10)
    vehicles = fleet.online(vins)
    answered: set[tuple[str, str]] = set()
    rids = [f"task_members_{n}" for n in range(4)]

    def extra() -> SubprocessServer:
        srv = SubprocessServer(fanout.data_dir.with_name("extra"), "--listen", f"127.0.0.1:{free_port()}", env=env)
        poll(lambda: srv.logged("events_subscribed"), DEADLINE_S)
        return srv

    joined = extra()
    try:
        for rid in rids:
            assert platform.batch(vins, rid, f"payload of {rid}", await_response=True) < 0x80
        poll(lambda: answer_what_arrived(vehicles, answered) or len(answered) >= len(vins) * 2, DEADLINE_S)
        assert metric(joined, "sdv_fanout_vehicle_events_total", kind="answer") > 0  # it was a member
        assert joined.terminate() == 0, joined.log()[-3000:]
        poll(lambda: answer_what_arrived(vehicles, answered) or len(answered) >= len(vins) * 3, DEADLINE_S)
        joined = extra()
        poll(lambda: answer_what_arrived(vehicles, answered) or fanout.rows(vins) == 0, DEADLINE_S)
    finally:
        joined.terminate()
    for v in vehicles:
        assert v.request_ids() == rids, v.vin
