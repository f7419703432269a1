"""Acks through EMQX's rule engine: parsing the ack message, the rule we ship, and what it switches off."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from exhook_server import metrics
from exhook_server.acks import AckIgnored, AckProblem, RuleAcks, parse_ack, rule_body, rule_sql
from exhook_server.config import Config
from exhook_server.dispatch.commands import Session
from exhook_server.errors import ConfigError
from exhook_server.hooks import hook_specs
from exhook_server.topics import RequestTopics
from testkit.harness import ROOT

TOPICS = RequestTopics("agent/{VIN}/proxy/request")
SHA1 = hashlib.sha1(b"payload").hexdigest()
PREFIX = "$SDV-FANOUT/acked"


def message(**fields: Any) -> bytes:
    """An ack message as the rule sends it, with some fields replaced (None drops one)."""
    doc = {"h": SHA1, "t": "agent/VIN1/proxy/request/task_1", "c": "VIN1", "f": "sdv-fanout-host-1"}
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not None}).encode()


def test_an_ack_message_names_the_vin_request_and_payload_sha1() -> None:
    """A well-formed message gives the VIN and request id of the topic and the raw 20-byte SHA-1."""
    ack = parse_ack(message(), TOPICS, "sdv-fanout-")
    assert (ack.vin, ack.request_id, ack.acker) == ("VIN1", "task_1", "VIN1")
    assert ack.sha1 == hashlib.sha1(b"payload").digest()


def test_escaped_characters_in_the_topic_survive() -> None:
    """A request id with a quote and non-ASCII text (EMQX escapes them in its JSON) comes back as sent."""
    raw = '{"t":"agent/V\u00e91/proxy/request/a\\"b c","h":"' + SHA1 + '","f":"sdv-fanout-h","c":"VIN\\"1"}'
    ack = parse_ack(raw.encode(), TOPICS, "sdv-fanout-")
    assert (ack.vin, ack.request_id, ack.acker) == ("V\u00e91", 'a"b c', 'VIN"1')


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b"not json", AckProblem.INVALID_JSON),
        (b"\xff\xfe", AckProblem.INVALID_JSON),
        (b"[1, 2]", AckProblem.WRONG_TYPE),
        (message(h=None), AckProblem.MISSING_FIELD),
        (message(f=None), AckProblem.MISSING_FIELD),
        (message(t=7), AckProblem.WRONG_TYPE),
        (message(h=SHA1.upper()), AckProblem.BAD_SHA1),
        (message(h=SHA1[:-1]), AckProblem.BAD_SHA1),
        (message(t="agent/VIN1/proxy/other/task_1"), AckProblem.NOT_A_DELIVERY),
        (message(t="agent/VIN1/proxy/request/"), AckProblem.NOT_A_DELIVERY),
        (message(f="mallory"), AckProblem.NOT_OURS),
        (message(c="x" * 5000), AckProblem.TOO_LARGE),
    ],
    ids=lambda v: v.value if isinstance(v, AckProblem) else "",
)
def test_malformed_or_foreign_ack_messages_are_refused_with_a_reason(payload: bytes, problem: AckProblem) -> None:
    """Bad JSON, wrong shapes, a bad digest, a non-delivery topic or another publisher: AckIgnored(problem)."""
    with pytest.raises(AckIgnored) as caught:
        parse_ack(payload, TOPICS, "sdv-fanout-")
    assert caught.value.problem is problem


class FakeDispatcher:
    """Records `acked` calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Session, str, str, bytes]] = []

    def acked(self, session: Session, vin: str, request_id: str, sha1: bytes) -> None:
        self.calls.append((session, vin, request_id, sha1))


def counted(outcome: str) -> float:
    return metrics.RULE_ACKS.labels(outcome)._value.get()  # type: ignore[no-any-return]


def test_rule_acks_hand_good_messages_to_dispatch_and_count_the_rest() -> None:
    """A good message becomes one `acked` call; garbage is counted by reason and reaches nobody."""
    dispatcher = FakeDispatcher()
    acks = RuleAcks(Config(ack_topic_prefix=PREFIX), dispatcher)  # type: ignore[arg-type]
    ok0, bad0 = counted("ok"), counted("invalid_json")
    acks.received(message())
    acks.received(b"{")
    acks.received(b"}")
    [(session, vin, rid, digest)] = dispatcher.calls
    assert (session.clientid, vin, rid, digest) == ("VIN1", "VIN1", "task_1", hashlib.sha1(b"payload").digest())
    assert counted("ok") == ok0 + 1
    assert counted("invalid_json") == bad0 + 2


def test_message_acked_is_not_registered_when_acks_come_through_the_rule() -> None:
    """With ack_topic_prefix set, OnProviderLoaded asks for no message.acked; without it, it does."""
    assert "message.acked" in dict(hook_specs(Config()))
    assert "message.acked" not in dict(hook_specs(Config(ack_topic_prefix=PREFIX)))


@pytest.mark.parametrize(
    "prefix",
    ["$SDV-FANOUT/data", "$SDV-FANOUT/data/acks", "agent/x/proxy/request", "ecp", "acks/+", "acks/#", "a\x00"],
)
def test_ack_prefix_that_a_hook_or_the_rule_would_match_is_refused(prefix: str) -> None:
    """An ack topic that would count as data, a delivery or a heartbeat, or is no topic name, fails at start-up."""
    with pytest.raises(ConfigError):
        Config(ack_topic_prefix=prefix, heartbeat_topics=("ecp/{VIN}",))
    Config(ack_topic_prefix=PREFIX, heartbeat_topics=("ecp/{VIN}",))


def test_rule_selects_from_acked_events_of_our_deliveries_only() -> None:
    """The SQL filters the delivery topics and our clientid prefix, following the settings."""
    sql = rule_sql(Config(request_topic_prefix="car/{VIN}/cmd", mqtt_clientid_prefix="fan-"))
    assert "FROM \"$events/message_acked\" WHERE topic =~ 'car/+/cmd/+'" in sql
    assert "regex_match(from_clientid, '^fan-')" in sql
    with pytest.raises(ConfigError):
        rule_sql(Config(mqtt_clientid_prefix="it's.ours-"))


def test_shipped_rule_bodies_match_the_generator() -> None:
    """deploy/emqx/ack-rule.json (5.8+) and ack-rule-5.1.json are what `sdv-fanout ack-rule` prints."""
    cfg = Config(ack_topic_prefix=PREFIX)
    shipped = json.loads((ROOT / "deploy/emqx/ack-rule.json").read_text())
    old = json.loads((ROOT / "deploy/emqx/ack-rule-5.1.json").read_text())
    assert shipped == rule_body(cfg)
    assert old == rule_body(cfg, direct_dispatch=False)
    assert shipped["actions"][0]["args"]["topic"] == "$SDV-FANOUT/acked/${f}"
    assert "direct_dispatch" not in old["actions"][0]["args"]


def test_ack_rule_command_prints_the_rule_for_the_settings_in_force(capsys: pytest.CaptureFixture[str]) -> None:
    """`sdv-fanout ack-rule` prints rule_body for its flags; without ack_topic_prefix it refuses (exit 2)."""
    from exhook_server import cli

    assert cli.main(["ack-rule", "--ack-topic-prefix", "fleet/acks", "--emqx-before-5.8"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == rule_body(Config(ack_topic_prefix="fleet/acks"), direct_dispatch=False)
    assert cli.main(["ack-rule", "--ack-topic-prefix", ""]) == 2
    assert "ack_topic_prefix is empty" in capsys.readouterr().err
