"""deploy/emqx/acl.conf names the topics of the default settings: a changed default topic must
change the ACL too (tests/integration/test_emqx_acl.py checks what the broker does with the file)."""

from __future__ import annotations

import re

from exhook_server.acks import rule_body
from exhook_server.catchup import topic_filters
from exhook_server.config import Config
from exhook_server.hooks import vehicle_event_filters
from testkit.harness import ROOT

ACL = (ROOT / "deploy" / "emqx" / "acl.conf").read_text()
#: The rules, comments left out: one rule per line, each ending in a dot.
RULES = [ln for ln in ACL.splitlines() if ln.strip() and not ln.lstrip().startswith("%%")]


def rule(perm: str, who: str, action: str) -> list[str]:
    """The topics of the one rule with this permission, who and action (placeholders as written)."""
    found = [ln for ln in RULES if ln.startswith(f"{{{perm}, {who}, {action}, [")]
    assert len(found) == 1, (perm, who, action, found)
    return re.findall(r'"([^"]*)"', found[0].split("[", 1)[1])


def as_acl(template: str) -> str:
    return template.replace("{VIN}", "${clientid}")


def test_the_file_denies_whatever_it_does_not_name() -> None:
    assert RULES[-1] == "{deny, all}."
    assert all(ln.endswith(".") for ln in RULES)


def test_vehicles_are_granted_exactly_their_own_default_topics() -> None:
    cfg = Config()
    assert rule("allow", "all", "subscribe") == [as_acl(cfg.request_topic_prefix) + "/+"]
    own = [as_acl(t) for t in cfg.heartbeat_topics] + [as_acl(cfg.response_topic_prefix) + "/+"]
    assert rule("allow", "all", "publish") == own


def test_the_server_and_the_platform_are_granted_the_default_topics() -> None:
    cfg = Config()
    deliveries = cfg.request_topic_prefix.replace("{VIN}", "+") + "/+"
    server = '{username, "sdv-fanout"}'
    assert rule("allow", server, "publish") == [deliveries, cfg.status_topic_prefix + "/#"]
    ack_topic = str(rule_body(Config(ack_topic_prefix="$SDV-FANOUT/acked"))["actions"][0]["args"]["topic"])
    heartbeats, answers = vehicle_event_filters(cfg)
    wanted = [ack_topic.replace("${f}", "${clientid}"), *topic_filters(cfg), *heartbeats, *answers]
    assert rule("allow", server, "subscribe") == wanted
    platform = '{username, "sdv-platform"}'
    batches = [cfg.batch_topic, cfg.trigger_topic, cfg.data_topic_prefix + "/+", cfg.cancel_topic, cfg.policy_topic]
    assert rule("allow", platform, "publish") == batches
    answers = cfg.response_topic_prefix.replace("{VIN}", "+") + "/+"
    assert rule("allow", platform, "subscribe") == [cfg.status_topic_prefix + "/#", answers]
