"""The simulator's rule engine runs the ack rule `emqx sync` installs as EMQX does: its output is
what exhook_server.acks reads as a PUBACK of ours, and only for the PUBACKs the rule selects."""

from __future__ import annotations

import hashlib
import json

import pytest

from exhook_server.acks import parse_ack, rule_body
from exhook_server.config import Config
from exhook_server.topics import RequestTopics
from testkit.emqx_rules import AckRule, UnsupportedRule

CFG = Config(mqtt_url="mqtt://127.0.0.1:1883", vehicle_events="mqtt")


@pytest.mark.parametrize("direct_dispatch", [True, False])
def test_the_ack_rule_republishes_a_delivery_puback_to_its_publisher(direct_dispatch: bool) -> None:
    rule = AckRule.parse(rule_body(CFG, direct_dispatch=direct_dispatch))
    out = rule.output("VIN1", "agent/VIN1/proxy/request/task_1", b"fw", "sdv-fanout-host-1")
    assert out is not None
    topic, payload = out
    assert topic == f"{CFG.rule_ack_topic_prefix}/sdv-fanout-host-1"
    assert payload.startswith(b'{"t":"agent/VIN1/proxy/request/task_1","h":')  # EMQX's order, compact
    assert json.loads(payload) == {
        "c": "VIN1",
        "f": "sdv-fanout-host-1",
        "h": hashlib.sha1(b"fw").hexdigest(),
        "t": "agent/VIN1/proxy/request/task_1",
    }
    ack = parse_ack(payload, RequestTopics(CFG.request_topic_prefix), CFG.mqtt_clientid_prefix)
    assert (ack.vin, ack.request_id, ack.sha1, ack.acker) == ("VIN1", "task_1", hashlib.sha1(b"fw").digest(), "VIN1")


def test_the_rule_selects_only_deliveries_of_our_clients() -> None:
    rule = AckRule.parse(rule_body(CFG))
    assert rule.output("VIN1", "ecp/VIN1/online", b"", "sdv-fanout-host-1") is None
    assert rule.output("VIN1", "agent/VIN1/proxy/request/task_1", b"fw", "someone-else") is None


def test_a_rule_the_simulator_cannot_run_is_refused() -> None:
    body = rule_body(CFG)
    with pytest.raises(UnsupportedRule):
        AckRule.parse({**body, "sql": body["sql"].replace("sha(payload)", "md5(payload)")})
    with pytest.raises(UnsupportedRule):
        AckRule.parse({**body, "actions": [{"function": "console"}]})
