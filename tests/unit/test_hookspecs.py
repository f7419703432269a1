"""OnProviderLoaded's hook list: EMQX rejects the whole server for one unknown name."""

from __future__ import annotations

from exhook_server.config import Config
from exhook_server.hooks import MESSAGE_HOOKS, VALID_HOOKS, hook_specs


def test_every_registered_hook_is_one_emqx_knows() -> None:
    """Each hook name is one of the 19 EMQX 5/6 hook points."""
    assert len(VALID_HOOKS) == 19
    specs = hook_specs(Config())
    assert specs and all(name in VALID_HOOKS for name, _ in specs)


def test_auth_hooks_are_never_registered() -> None:
    """An IGNORE to client.authenticate has locked every client out on a real EMQX: never ask for it."""
    assert not {name for name, _ in hook_specs(Config())} & {"client.authenticate", "client.authorize"}


def test_message_hooks_carry_topic_filters() -> None:
    """Message hooks name topic filters, so EMQX does not call us for every publish in the fleet."""
    for name, topics in hook_specs(Config()):
        if name in MESSAGE_HOOKS:
            assert topics, name


def test_topic_filters_follow_configured_topics() -> None:
    """Custom batch topics are what we register."""
    cfg = Config(
        batch_topic="fleet/batch",
        data_topic_prefix="fleet/data",
        trigger_topic="fleet/trigger",
        cancel_topic="fleet/cancel",
        policy_topic="fleet/policy",
        response_topic_prefix="car/{VIN}/answer",
    )
    [(_, topics)] = [s for s in hook_specs(cfg) if s[0] == "message.publish"]
    assert set(topics) == {
        "fleet/batch",
        "fleet/data/#",
        "fleet/trigger",
        "fleet/cancel",
        "fleet/policy",
        "ecp/+/online",
        "ecp/+/heartbeat",
        "car/+/answer/+",
    }
    # Responses off: no filter for them.
    [(_, topics)] = [s for s in hook_specs(Config(response_topic_prefix="")) if s[0] == "message.publish"]
    assert not any("response" in t for t in topics)


def test_acks_are_filtered_to_delivery_topics() -> None:
    """message.acked is asked for the delivery topics only, following request_topic_prefix."""
    specs = dict(hook_specs(Config(request_topic_prefix="car/{VIN}/cmd")))
    assert specs["message.acked"] == ["car/+/cmd/+"]


def test_each_hook_is_registered_once() -> None:
    """EMQX keeps one spec per hook name; a duplicate would be ambiguous."""
    names = [name for name, _ in hook_specs(Config())]
    assert len(names) == len(set(names))
