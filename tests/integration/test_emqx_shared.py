"""testkit/emqx_shared.py on a real EMQX 5.8.9 (the `emqx_brokers` of the other real-EMQX files): a
broker is handed out again only as it booted, with the client sessions of earlier files gone."""

from __future__ import annotations

import pytest

from testkit.emqx_real import available_versions, where_looked
from testkit.emqx_shared import SharedBrokers
from testkit.mqtt import Client

VERSION = "5.8.9"
pytestmark = pytest.mark.skipif(VERSION not in available_versions(), reason=f"no EMQX {VERSION}: {where_looked()}")


def test_a_broker_left_as_found_is_handed_out_again_without_the_sessions_left_over(
    emqx_brokers: SharedBrokers,
) -> None:
    """A persistent session left behind is discarded, and the same broker is handed out again."""
    broker = emqx_brokers.get(VERSION)
    client = Client(broker, "shared-emqx-leftover", session_expiry_s=3600)
    client.connect(clean_start=False)
    client.close()
    assert [c["clientid"] for c in broker.api("GET", "/clients")["data"]] == ["shared-emqx-leftover"]
    assert emqx_brokers.unclean(broker) is None
    assert broker.api("GET", "/clients")["data"] == []
    assert emqx_brokers.get(VERSION) is broker


def test_a_broker_changed_since_its_boot_is_unclean_until_put_back(emqx_brokers: SharedBrokers) -> None:
    """An API key or an ExHook entry a file left makes the broker unclean; deleted, it is clean again."""
    broker = emqx_brokers.get(VERSION)
    broker.create_api_key("shared-emqx-leftover")
    try:
        assert emqx_brokers.unclean(broker) == "changed since boot: /api_key"
    finally:
        broker.api("DELETE", "/api_key/shared-emqx-leftover")
    entry = {"name": "shared-emqx-leftover", "enable": False, "url": "http://127.0.0.1:9"}
    broker.api("POST", "/exhooks", entry)
    try:
        assert emqx_brokers.unclean(broker) == "changed since boot: /exhooks"
    finally:
        broker.unregister_exhook("shared-emqx-leftover")
    assert emqx_brokers.unclean(broker) is None
