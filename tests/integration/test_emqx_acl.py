"""deploy/emqx/acl.conf on real EMQX brokers (5.1.6, 5.8.9, 5.9.1), loaded verbatim as the file
authorization source: a vehicle is refused every wildcard, `$share`, `$queue` and foreign topic it
might try, and receives nothing of anyone else's traffic; each party is allowed what it needs.

No sdv-fanout server runs here: MQTT clients play its parts (username `sdv-fanout`), the platform's
(username `sdv-platform`) and the vehicles' (clientid = VIN), so the broker's answers (SUBACK and
PUBACK reason codes, what arrives where) are all that is measured. 5.8.9 and 5.9.1 run as
docs/operations.md says (`authorization.no_match = deny`); 5.1.6 keeps EMQX's default `allow`, so
the file alone is shown to deny. One broker per version for the module (5.8.9's and 5.9.1's shared
with test_real_emqx_events.py: `emqx_brokers`); the probes of a client go
in one SUBSCRIBE (each filter gets its own reason code) and a few publishes on one connection.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.emqx_real import EmqxBroker, available_versions, file_authorization, where_looked
from testkit.emqx_shared import SharedBrokers
from testkit.harness import ROOT, poll
from testkit.mqtt import Client

pytestmark = pytest.mark.slow
if not available_versions():
    pytest.skip(f"no real EMQX release: {where_looked()}", allow_module_level=True)

ACL = ROOT / "deploy" / "emqx" / "acl.conf"
#: (EMQX version, authorization.no_match): the documented `deny`, and once EMQX's default.
BROKERS = [("5.1.6", "allow"), ("5.8.9", "deny"), ("5.9.1", "deny")]
REFUSED = 0x87  # "not authorized", in SUBACK and PUBACK alike
DEADLINE_S = 15.0

#: Filters a vehicle (VIN {A}) might subscribe to for another vehicle's ({B}) requests, answers or
#: heartbeats, the platform's batches, receipts or the ack messages: each must be refused.
VEHICLE_FILTERS = [
    "#",
    "+/#",
    "+",
    "+/+/+/+/+",
    "agent/#",
    "agent/+/#",
    "agent/+/proxy/request/+",
    "+/+/proxy/request/+",
    "agent/+/proxy/request/#",
    "agent/{B}/proxy/request/+",
    "agent/{B}/proxy/request/#",
    "agent/{B}/#",
    "agent/{A}/#",
    "agent/{A}/proxy/+/+",
    "agent/+/proxy/response/+",
    "agent/{B}/proxy/response/+",
    "ecp/#",
    "ecp/+/online",
    "ecp/{B}/heartbeat",
    "$share/x/#",
    "$share/x/+/#",
    "$share/x/agent/+/proxy/request/+",
    "$share/x/agent/{B}/proxy/request/+",
    "$share/{A}/agent/+/proxy/request/+",
    "$share/x/agent/+/proxy/response/+",
    "$queue/#",
    "$queue/agent/+/proxy/request/+",
    "$queue/agent/{B}/proxy/request/+",
    "$exclusive/agent/+/proxy/request/+",
    "$SDV-FANOUT",
    "$SDV-FANOUT/#",
    "$SDV-FANOUT/+",
    "$SDV-FANOUT/status/#",
    "$SDV-FANOUT/status/+",
    "$SDV-FANOUT/acked/#",
    "$SDV-FANOUT/acked/+",
    "$SDV-FANOUT/trigger",
    "$SDV-FANOUT/data/+",
    "$SDV-FANOUT/cancel",
    "$SDV-FANOUT/policy",
    "$share/x/$SDV-FANOUT/#",
    "$share/x/$SDV-FANOUT/status/#",
    "$queue/$SDV-FANOUT/#",
    "$SYS/#",
    "$delayed/#",
]
#: Topics a vehicle might publish to in another's name: each must be refused.
VEHICLE_PUBLISHES = [
    "agent/{B}/proxy/request/task_x_1",  # a forged request to another vehicle
    "agent/{A}/proxy/request/task_x_1",  # ... or to itself
    "ecp/{B}/online",  # another vehicle's heartbeats
    "ecp/{B}/heartbeat",
    "agent/{B}/proxy/response/task_x_1",  # another vehicle's answer
    "$SDV-FANOUT",  # batches, cancels
    "$SDV-FANOUT/trigger",
    "$SDV-FANOUT/data/d1",
    "$SDV-FANOUT/cancel",
    "$SDV-FANOUT/policy",  # a campaign policy (pause, abort criteria) for someone else's request
    "$SDV-FANOUT/status/task_x_1",  # a forged receipt
    "$SDV-FANOUT/acked/sdv-fanout-acl",  # a forged ack message
    "$delayed/1/agent/{B}/proxy/request/task_x_1",
    "$delayed/1/$SDV-FANOUT",
]
#: The server's catch-up session and its delivery client's ack topic (clientid `sdv-fanout-acl`).
SERVER_FILTERS = [
    "$SDV-FANOUT",
    "$SDV-FANOUT/trigger",
    "$SDV-FANOUT/data/+",
    "$SDV-FANOUT/cancel",
    "$SDV-FANOUT/policy",
]
_ids = itertools.count()


class Probe:
    """A bare MQTT 5 client: SUBACK and PUBACK reason codes, and every message it receives."""

    def __init__(self, broker: EmqxBroker, clientid: str, username: str | None = None) -> None:
        self.c = Client(broker, clientid, username=username or "")
        self.c.connect()

    @property
    def received(self) -> list[str]:
        return [m.topic for m in self.c.received]

    def subscribe(self, filters: list[str]) -> dict[str, int]:
        """One SUBSCRIBE of every filter at QoS 1: filter -> its SUBACK reason code."""
        return dict(zip(filters, self.c.subscribe(*filters), strict=True))

    def publish(self, topic: str, payload: bytes = b"{}") -> int | None:
        """Publish at QoS 1: the PUBACK reason code."""
        return self.c.publish(topic, payload)

    def close(self) -> None:
        self.c.close()


@pytest.fixture(scope="module", params=BROKERS, ids=[f"emqx{v}-no_match-{m}" for v, m in BROKERS])
def broker(request: pytest.FixtureRequest, emqx_brokers: SharedBrokers) -> EmqxBroker:
    version, no_match = request.param
    if version not in available_versions():
        pytest.skip(f"no EMQX {version}: {where_looked()}")
    return emqx_brokers.get(version, env=file_authorization(ACL, no_match=no_match))


@pytest.fixture
def clients(broker: EmqxBroker) -> Iterator[Any]:
    """`open(clientid, username=None)` -> a connected Probe, closed after the test."""
    opened: list[Probe] = []

    def open_(clientid: str, username: str | None = None) -> Probe:
        opened.append(Probe(broker, clientid, username))
        return opened[-1]

    yield open_
    for p in opened:
        p.close()


def vins() -> tuple[str, str]:
    n = next(_ids)
    return f"VINA{n:03d}", f"VINB{n:03d}"


def not_refused(codes: dict[str, int]) -> dict[str, int]:
    return {what: code for what, code in codes.items() if code != REFUSED}


def test_the_broker_uses_the_file_as_it_is(broker: EmqxBroker) -> None:
    """The only authorization source is deploy/emqx/acl.conf, rule for rule."""
    [source] = broker.api("GET", "/authorization/sources")["sources"]
    assert source["type"] == "file" and source["enable"] is True
    assert source["rules"] == ACL.read_text()


def test_a_vehicle_reads_and_writes_nothing_but_its_own_topics(clients: Any) -> None:
    """Every filter of the probe list is refused for vehicle A, and so is every publish in another's
    name; then a delivery, an answer, a heartbeat, receipts and batches flow between the others, and
    A receives only what was sent to it."""
    a_vin, b_vin = vins()
    a = clients(a_vin)
    names = {"A": a_vin, "B": b_vin}
    assert not_refused(a.subscribe([f.format(**names) for f in VEHICLE_FILTERS])) == {}
    assert not_refused({t: a.publish(t.format(**names)) for t in VEHICLE_PUBLISHES}) == {}

    b = clients(b_vin)
    server = clients("sdv-fanout-acl", "sdv-fanout")
    platform = clients("sdv-platform-acl", "sdv-platform")
    assert b.subscribe([f"agent/{b_vin}/proxy/request/+"]) == {f"agent/{b_vin}/proxy/request/+": 1}
    assert set(server.subscribe([*SERVER_FILTERS, "$SDV-FANOUT/acked/sdv-fanout-acl"]).values()) == {1}
    assert set(platform.subscribe(["$SDV-FANOUT/status/#", "agent/+/proxy/response/+"]).values()) == {1}
    a_own = f"agent/{a_vin}/proxy/request/+"
    assert a.subscribe([a_own]) == {a_own: 1}

    flows = [
        (server, f"agent/{b_vin}/proxy/request/task_acl_1", b),
        (server, "$SDV-FANOUT/status/task_acl_1", platform),
        (b, f"agent/{b_vin}/proxy/response/task_acl_1", platform),
        (platform, "$SDV-FANOUT", server),
        (platform, "$SDV-FANOUT/trigger", server),
        (platform, "$SDV-FANOUT/data/d1", server),
        (platform, "$SDV-FANOUT/cancel", server),
        (platform, "$SDV-FANOUT/policy", server),
    ]
    for sender, topic, _ in flows:
        assert sender.publish(topic) == 0, topic  # 0x00: allowed, and someone subscribed
    for who in (f"ecp/{b_vin}/online", f"ecp/{b_vin}/heartbeat"):
        assert b.publish(who) < 0x80, who  # allowed (0x10: nobody subscribes to heartbeats)
    for _, topic, receiver in flows:
        poll(lambda topic=topic, receiver=receiver: topic in receiver.received, DEADLINE_S)
    mine = f"agent/{a_vin}/proxy/request/task_acl_2"
    assert server.publish(mine) == 0
    poll(lambda: mine in a.received, DEADLINE_S)  # published after everything above
    assert a.received == [mine]


def test_each_party_gets_what_it_needs_and_nothing_more(clients: Any) -> None:
    """The vehicle, sdv-fanout's clients and the platform are each granted their own topics only: the
    server neither publishes batches, heartbeats or answers nor reads receipts or another client's
    acks; the platform neither delivers, writes receipts or acks, nor reads requests."""
    a_vin, b_vin = vins()
    a = clients(a_vin)
    own = [f"agent/{a_vin}/proxy/request/+", f"agent/{a_vin}/proxy/request/#"]
    assert set(a.subscribe(own).values()) == {1}
    answers = [f"ecp/{a_vin}/online", f"ecp/{a_vin}/heartbeat", f"agent/{a_vin}/proxy/response/task_x_1"]
    assert {t: a.publish(t) for t in answers} == dict.fromkeys(answers, 0x10)  # allowed, nobody listens

    server = clients("sdv-fanout-acl2", "sdv-fanout")
    granted = [*SERVER_FILTERS, "$SDV-FANOUT/data/#", "$SDV-FANOUT/acked/sdv-fanout-acl2"]
    # Vehicle events over MQTT: every vehicle's heartbeats and answers, through the shared group.
    events = ["$share/sdv-fanout/ecp/+/online", "$share/sdv-fanout/ecp/+/heartbeat"]
    events += ["$share/sdv-fanout/agent/+/proxy/response/+"]
    assert set(server.subscribe(granted).values()) == {1}
    assert server.subscribe(events) == dict.fromkeys(events, 1)
    for topic in (f"agent/{b_vin}/proxy/request/task_x_1", "$SDV-FANOUT/status/task_x_1"):
        assert server.publish(topic) == 0x10, topic
    refused = ["#", "$SDV-FANOUT/#", "$SDV-FANOUT/status/#", "$SDV-FANOUT/acked/+", "$SDV-FANOUT/acked/sdv-fanout-x"]
    refused += ["agent/+/proxy/request/+", "ecp/#"]
    assert not_refused(server.subscribe(refused)) == {}
    forged = ["$SDV-FANOUT", "$SDV-FANOUT/cancel", f"ecp/{b_vin}/online", f"agent/{b_vin}/proxy/response/task_x_1"]
    assert not_refused({t: server.publish(t) for t in [*forged, "$SDV-FANOUT/acked/sdv-fanout-acl2"]}) == {}

    platform = clients("sdv-platform-acl2", "sdv-platform")
    assert set(platform.subscribe(["$SDV-FANOUT/status/#", "agent/+/proxy/response/+"]).values()) == {1}
    for topic in ("$SDV-FANOUT", "$SDV-FANOUT/trigger", "$SDV-FANOUT/data/d1", "$SDV-FANOUT/cancel"):
        assert platform.publish(topic) < 0x80, topic
    refused = ["#", "agent/+/proxy/request/+", "$SDV-FANOUT/#", "$SDV-FANOUT/acked/#", "ecp/#"]
    assert not_refused(platform.subscribe(refused)) == {}
    forged = [f"agent/{b_vin}/proxy/request/task_x_1", "$SDV-FANOUT/status/task_x_1", "$SDV-FANOUT/acked/x"]
    forged += [f"ecp/{b_vin}/online", "$SDV-FANOUT/other"]
    assert not_refused({t: platform.publish(t) for t in forged}) == {}


@pytest.mark.parametrize("clientid", ["+", "#", "+/+", "x/+", "VINA/proxy/request/+"])
def test_a_clientid_with_a_wildcard_or_separator_gets_nothing(clients: Any, clientid: str) -> None:
    """`${clientid}` in a rule must not become a wildcard: a client named `+` would otherwise read
    every vehicle's requests and heartbeat for any of them."""
    _, b_vin = vins()
    weird = clients(clientid)
    filters = ["agent/+/proxy/request/+", f"agent/{b_vin}/proxy/request/+", "+/+/proxy/request/+", "agent/#"]
    assert not_refused(weird.subscribe(filters)) == {}
    topics = [f"ecp/{b_vin}/online", f"agent/{b_vin}/proxy/response/task_x_1"]
    assert not_refused({t: weird.publish(t) for t in topics}) == {}
