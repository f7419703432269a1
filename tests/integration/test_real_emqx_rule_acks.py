"""Acks through EMQX's rule engine on real brokers: 5.8.9 (a group of two server processes) and 5.9.1 (one).

The server runs with `ack_topic_prefix` and the broker with the rule `sdv-fanout ack-rule` prints,
created through the REST API; vehicles and the platform are real MQTT clients. The fixtures and
helpers of test_real_emqx.py are reused: one broker (shared: `emqx_brokers`) and one server per
version for the module, which deletes its rule at its end.
"""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exhook_server.acks import rule_body
from exhook_server.config import Config
from testkit.emqx_real import EmqxBroker, Platform, find_release, where_looked
from testkit.emqx_shared import SharedBrokers
from testkit.harness import ROOT, SubprocessServer, poll
from testkit.mqtt import Client as MqttClient
from testkit.vehicle import Fleet, Vehicle
from tests.integration import test_real_emqx
from tests.integration.test_real_emqx import (
    DEADLINE_S,
    EXHOOK,
    SETUPS,
    Fanout,
    all_have,
    fleet_gets_each_once_one_at_a_time,
    snooped_puback_ends_nothing,
    vins_of,
)

pytestmark = test_real_emqx.pytestmark
#: The module's broker and server (our `setup`), a fleet, a platform client and a VIN prefix per test.
rig = test_real_emqx.rig

ACK_PREFIX = "$SDV-FANOUT/acked"
#: Short, so that a missing rule shows within a test; acks on loopback take milliseconds.
INFLIGHT_TIMEOUT_S = 4.0


class RuleFanout(Fanout):
    """The server of test_real_emqx.py with acks through the rule, and the rule itself on the broker."""

    rule_id = ""

    def _start(self) -> SubprocessServer:
        self.env.update(
            SDV_FANOUT_ACK_TOPIC_PREFIX=ACK_PREFIX,
            SDV_FANOUT_INFLIGHT_TIMEOUT_S=str(INFLIGHT_TIMEOUT_S),
            SDV_FANOUT_MQTT_USERNAME="sdv-fanout",  # the user deploy/emqx/acl.conf names
        )
        return super()._start()

    def create_rule(self) -> str:
        """POST the rule for the server's settings; its id."""
        return str(self.broker.api("POST", "/rules", rule_body(Config(ack_topic_prefix=ACK_PREFIX)))["id"])

    def leave(self) -> None:
        """The rule goes too: the broker is left as found."""
        try:
            if self.rule_id and self.broker.running:
                self.broker.api("DELETE", f"/rules/{self.rule_id}")
        finally:
            super().leave()

    def delivery_clients(self) -> list[str]:
        """The clientids of the server's delivery clients (one per server process), from EMQX."""
        found = self.broker.api("GET", "/clients?like_clientid=sdv-fanout-&limit=100")["data"]
        catchup = Config().catchup_session_clientid  # the catch-up session shares the prefix
        return sorted(c["clientid"] for c in found if c.get("connected", True) and c["clientid"] != catchup)

    def rule_acks(self) -> dict[str, float]:
        """sdv_fanout_rule_acks_total by outcome, for the whole group, from /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.srv.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "sdv_fanout_rule_acks_total":
                    out[sample.labels["outcome"]] = out.get(sample.labels["outcome"], 0.0) + sample.value
        return out


@pytest.fixture(scope="module", params=SETUPS, ids=[f"emqx{v}-p{n}-{s}" for v, n, s in SETUPS])
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, emqx_brokers: SharedBrokers
) -> Iterator[RuleFanout]:
    version, processes, store = request.param
    if find_release(version) is None:
        pytest.skip(f"no EMQX {version}: {where_looked()}")
    store_url = ""
    if store == "postgresql":
        store_url = request.getfixturevalue("pg_cluster").new_database(f"rule_acks_{version.replace('.', '_')}")
    workdir = tmp_path_factory.mktemp(f"emqx{version}-rule-acks")
    fanout = RuleFanout(emqx_brokers.get(version), workdir, processes, store_url)
    try:
        fanout.rule_id = fanout.create_rule()
        poll(lambda: len(fanout.delivery_clients()) == processes, DEADLINE_S)
        yield fanout
    finally:
        fanout.leave()


class Client(MqttClient):
    """A bare MQTT 5 client (the forger): publishes and subscribes at QoS 1, reports reason codes."""

    def __init__(self, broker: EmqxBroker, clientid: str, username: str | None = None) -> None:
        super().__init__(broker, clientid, username=username or "")
        self.connect()

    def subscribe(self, topic: str) -> int:  # type: ignore[override]
        """Subscribe at QoS 1; the SUBACK reason code."""
        [code] = super().subscribe(topic)
        return code


def holding_vehicle(fleet: Fleet, prefix: str) -> tuple[str, Vehicle]:
    """One online vehicle of the test's own that holds its PUBACKs until `ack_held()`."""
    [vin] = vins_of(prefix, 1)
    v = fleet.vehicle(vin, auto_ack=False)
    v.connect()
    v.subscribe()
    return vin, v


def ack_message(topic: str, payload: bytes, acker: str, publisher: str) -> bytes:
    """What the rule would republish for the PUBACK of `payload` on `topic`."""
    return json.dumps({"h": hashlib.sha1(payload).hexdigest(), "t": topic, "c": acker, "f": publisher}).encode()


# ---------------------------------------------------------------------------------------------


def test_rule_acks_deliver_a_fleet_exactly_once_one_at_a_time(rig: Any) -> None:
    """With acks through the rule, 20 vehicles get 3 requests each once, in order, one unacknowledged at
    a time; the rule's messages delete every row, and EMQX got no message.acked hook from us."""
    fanout, fleet, platform, prefix = rig
    hooks = {h["name"] for h in fanout.broker.exhook_hooks(EXHOOK)}
    assert "message.publish" in hooks and "message.acked" not in hooks
    ok0 = fanout.rule_acks().get("ok", 0.0)
    vins = vins_of(prefix, 20)
    vehicles = fleet.online(vins, hold_s=0.02)
    rids = [f"task_rule_{n}" for n in range(3)]
    for rid in rids:
        assert platform.batch(vins, rid, f"payload of {rid}") in (0x00, 0x10)
    fleet_gets_each_once_one_at_a_time(fanout, vehicles, vins, rids)
    assert fanout.rule_acks()["ok"] - ok0 == len(vins) * len(rids)
    assert fanout.events("rule_acks_expected"), "the server says at start-up that it needs the rule"


def test_a_puback_from_another_client_ends_no_delivery(rig: Any) -> None:
    """Through the rule (its message names the acking client, `c`): the same as on the hook path,
    test_real_emqx.snooped_puback_ends_nothing."""
    snooped_puback_ends_nothing(*rig)


def test_ack_of_a_replaced_row_delivers_the_new_payload(rig: Any) -> None:
    """A row replaced while its delivery is in flight survives that delivery's ack (another SHA-1) and
    goes again with the new payload; the second ack deletes it."""
    fanout, fleet, platform, prefix = rig
    vin, v = holding_vehicle(fleet, prefix)
    platform.batch([vin], "task_repl", "old")
    poll(lambda: v.request_ids() == ["task_repl"], DEADLINE_S)
    platform.batch([vin], "task_repl", "new")
    assert fanout.rows([vin]) == 1
    v.auto_ack = True
    assert v.ack_held() == 1
    poll(lambda: len(v.received) == 2, DEADLINE_S)
    poll(lambda: fanout.rows([vin]) == 0, DEADLINE_S)
    assert [d.payload for d in v.received] == [b"old", b"new"]


def test_forged_and_garbled_ack_messages_are_counted_and_delete_nothing(rig: Any) -> None:
    """Garbage on a delivery client's ack topic is counted by reason; a well-formed ack with another
    payload's SHA-1 deletes nothing and frees no slot; the real ack still works."""
    fanout, fleet, platform, prefix = rig
    vin, v = holding_vehicle(fleet, prefix)
    platform.batch([vin], "task_forged_1", "real")
    platform.batch([vin], "task_forged_2", "next")
    poll(lambda: v.request_ids() == ["task_forged_1"], DEADLINE_S)
    before = fanout.rule_acks()
    topic = f"agent/{vin}/proxy/request/task_forged_1"
    forger = Client(fanout.broker, f"forger-{prefix}")
    try:
        for cid in fanout.delivery_clients():
            for garbage in (
                b"not json",
                b"[]",
                ack_message(topic, b"real", vin, cid).replace(b'"h": "', b'"h": "X'),
                ack_message("agent/x/elsewhere/y", b"real", vin, cid),
                ack_message(topic, b"forged", vin, cid),  # well-formed: names a payload nobody stored
            ):
                assert forger.publish(f"{ACK_PREFIX}/{cid}", garbage) == 0  # the default ACL lets it in
    finally:
        forger.close()
    n = len(fanout.delivery_clients())
    want = {"invalid_json": n, "wrong_type": n, "bad_sha1": n, "not_a_delivery": n, "ok": n}
    poll(lambda: all(fanout.rule_acks().get(k, 0) - before.get(k, 0) >= m for k, m in want.items()), DEADLINE_S)
    assert fanout.rows([vin]) == 2 and v.request_ids() == ["task_forged_1"]
    v.auto_ack = True
    v.ack_held()
    poll(lambda: fanout.rows([vin]) == 0, DEADLINE_S)
    assert v.request_ids() == ["task_forged_1", "task_forged_2"]
    assert fanout.srv.proc.poll() is None


def test_shipped_acl_refuses_forged_acks_while_the_rule_still_delivers(rig: Any) -> None:
    """With deploy/emqx/acl.conf verbatim (and no_match = deny), a client's forged ack is refused (0x87)
    and only the delivery user subscribes to its own ack topic; the server's deliveries and the rule's
    republish pass, the platform's batches (username sdv-platform) are stored and every row is acked."""
    fanout, fleet, _, prefix = rig
    broker = fanout.broker
    default = next(s for s in broker.api("GET", "/authorization/sources")["sources"] if s["type"] == "file")
    settings = broker.api("GET", "/authorization/settings")
    rules = (ROOT / "deploy/emqx/acl.conf").read_text()
    broker.api("PUT", "/authorization/settings", {**settings, "no_match": "deny"})
    broker.api("PUT", "/authorization/sources/file", {**default, "rules": rules})
    broker.api("DELETE", "/authorization/cache")  # decisions cached under the permissive default
    [cid, *_] = fanout.delivery_clients()
    forger = Client(broker, f"forger-{prefix}")
    mine = Client(broker, f"sdv-fanout-probe-{prefix}", username="sdv-fanout")
    platform = Platform(broker, clientid=f"sdv-platform-acl-{prefix}", username="sdv-platform")
    try:
        assert forger.publish(f"{ACK_PREFIX}/{cid}", b"{}") == 0x87
        assert forger.subscribe(f"{ACK_PREFIX}/#") == 0x87
        assert mine.publish(f"{ACK_PREFIX}/{cid}", b"{}") == 0x87
        assert mine.subscribe(f"{ACK_PREFIX}/{cid}") == 0x87  # another delivery client's topic
        assert mine.subscribe(f"{ACK_PREFIX}/sdv-fanout-probe-{prefix}") == 0x01
        vins = vins_of(prefix, 5)
        vehicles = fleet.online(vins)
        assert platform.batch(vins, "task_acl_1", "one") < 0x80
        assert platform.batch(vins, "task_acl_2", "two") < 0x80
        poll(lambda: all_have(vehicles, ["task_acl_1", "task_acl_2"]), DEADLINE_S)
        poll(lambda: fanout.rows(vins) == 0, DEADLINE_S)
    finally:
        forger.close()
        mine.close()
        platform.close()
        broker.api("PUT", "/authorization/sources/file", default)
        broker.api("PUT", "/authorization/settings", settings)
        broker.api("DELETE", "/authorization/cache")


def test_missing_rule_is_reported_and_its_deliveries_go_again_once_it_is_back(rig: Any) -> None:
    """With the rule disabled, a delivery's ack never comes: the server warns `rule_acks_missing` after
    inflight_timeout_s; once the rule is enabled again the delivery goes again and its ack deletes it."""
    fanout, fleet, platform, prefix = rig
    if fanout.broker.version != "5.9.1":
        pytest.skip("one broker shows it; the wait is inflight_timeout_s")
    rule = f"/rules/{fanout.rule_id}"
    [vin] = vins_of(prefix, 1)
    [v] = fleet.online([vin])
    warned = len(fanout.events("rule_acks_missing"))
    fanout.broker.api("PUT", rule, {"enable": False})
    try:
        platform.batch([vin], "task_norule", "x")
        poll(lambda: v.request_ids() == ["task_norule"], DEADLINE_S)
        poll(lambda: len(fanout.events("rule_acks_missing")) > warned, INFLIGHT_TIMEOUT_S + 10)
        assert fanout.rows([vin]) == 1
    finally:
        fanout.broker.api("PUT", rule, {"enable": True})
    poll(lambda: fanout.rows([vin]) == 0, DEADLINE_S)
    # Sent again every inflight_timeout_s until an ack came through: twice at least, nothing else.
    assert set(v.request_ids()) == {"task_norule"} and len(v.request_ids()) >= 2
