"""Wire conformance: an independent client, written from the doc's field tables, calls all 21 RPCs.

Requests are encoded by tests/wire.py (no generated classes, no google.protobuf) and
sent as raw bytes over a loopback channel to both `emqx.exhook.v2` and
`emqx.exhook.v3`; answers are decoded the same way and checked field by field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from testkit.harness import InProcessServer
from tests import wire

PACKAGES = ("v2", "v3")

#: Table 1.2: rpc -> (request message, answer kind).
RPCS: dict[str, tuple[str, str]] = {
    "OnProviderLoaded": ("ProviderLoadedRequest", "loaded"),
    "OnProviderUnloaded": ("ProviderUnloadedRequest", "empty"),
    "OnClientConnect": ("ClientConnectRequest", "empty"),
    "OnClientConnack": ("ClientConnackRequest", "empty"),
    "OnClientConnected": ("ClientConnectedRequest", "empty"),
    "OnClientDisconnected": ("ClientDisconnectedRequest", "empty"),
    "OnClientAuthenticate": ("ClientAuthenticateRequest", "ignore"),
    "OnClientAuthorize": ("ClientAuthorizeRequest", "ignore"),
    "OnClientSubscribe": ("ClientSubscribeRequest", "empty"),
    "OnClientUnsubscribe": ("ClientUnsubscribeRequest", "empty"),
    "OnSessionCreated": ("SessionCreatedRequest", "empty"),
    "OnSessionSubscribed": ("SessionSubscribedRequest", "empty"),
    "OnSessionUnsubscribed": ("SessionUnsubscribedRequest", "empty"),
    "OnSessionResumed": ("SessionResumedRequest", "empty"),
    "OnSessionDiscarded": ("SessionDiscardedRequest", "empty"),
    "OnSessionTakenover": ("SessionTakenoverRequest", "empty"),
    "OnSessionTerminated": ("SessionTerminatedRequest", "empty"),
    "OnMessagePublish": ("MessagePublishRequest", "ignore"),  # on an ordinary topic
    "OnMessageDelivered": ("MessageDeliveredRequest", "empty"),
    "OnMessageDropped": ("MessageDroppedRequest", "empty"),
    "OnMessageAcked": ("MessageAckedRequest", "empty"),
}
assert len(RPCS) == 21

#: The 19 hook names of section 1.2 (`hk2func/1`); any other name fails the whole load in EMQX.
VALID_HOOK_NAMES = frozenset(
    {
        "client.connect",
        "client.connack",
        "client.connected",
        "client.disconnected",
        "client.authenticate",
        "client.authorize",
        "client.subscribe",
        "client.unsubscribe",
        "session.created",
        "session.subscribed",
        "session.unsubscribed",
        "session.resumed",
        "session.discarded",
        "session.takenover",
        "session.terminated",
        "message.publish",
        "message.delivered",
        "message.acked",
        "message.dropped",
    }
)
assert len(VALID_HOOK_NAMES) == 19

IGNORE, STOP_AND_RETURN = 1, 2  # ValuedResponse.ResponsedType (table 1.6)
SUBSCRIBE = 1  # ClientAuthorizeRequest.AuthorizeReqType
BAD_UTF8 = b"\xff\xfe\x00bad"

# -- realistic request parts, shaped like what EMQX sends -------------------------------------------


def meta(package: str) -> dict[str, Any]:
    return {
        "node": "emqx@127.0.0.1",
        "version": "5.8.9" if package == "v2" else "5.9.1",
        "sysdescr": "EMQX",
        "cluster_name": "emqxcl",
    }


def clientinfo(password: str | bytes = "") -> dict[str, Any]:
    return {
        "node": "emqx@127.0.0.1",
        "clientid": "VIN1",
        "username": "vehicle",
        "password": password,
        "peerhost": "10.0.0.7",
        "sockport": 1883,
        "protocol": "mqtt",
        "mountpoint": "",
        "is_superuser": False,
        "anonymous": False,
        "cn": "VIN1",
        "dn": "CN=VIN1,O=OEM",
        "peerport": 53412,
    }


CONNINFO = {
    "node": "emqx@127.0.0.1",
    "clientid": "VIN1",
    "username": "vehicle",
    "peerhost": "10.0.0.7",
    "sockport": 1883,
    "proto_name": "MQTT",
    "proto_ver": "5",
    "keepalive": 60,
    "peerport": 53412,
}


def props(package: str, value: str | bytes = "7200") -> list[dict[str, Any]]:
    """MQTT v5 properties; v2 (5.8.x) carried User-Property stringified inside props."""
    out: list[dict[str, Any]] = [
        {"name": "Session-Expiry-Interval", "value": value},
        {"name": "Receive-Maximum", "value": "32"},
    ]
    if package == "v2":
        out.append({"name": "User-Property", "value": '[{<<"region">>,<<"eu">>}]'})
    return out


USER_PROPS = [{"name": "region", "value": "eu"}, {"name": "region", "value": "us"}]

TOPIC_FILTERS = [
    {"name": "vehicle/VIN1/cmd", "subopts": {"qos": 1, "rh": 0, "rap": 0, "nl": 0}},
    {"name": "$share/g1/fleet/+/status", "subopts": {"qos": 2, "rh": 2, "rap": 1, "nl": 1}},
]

HEADERS = {"username": "platform", "protocol": "mqtt", "peerhost": "127.0.0.1"}


def message(topic: str = "t/1", payload: bytes = b"hello", headers: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "node": "emqx@127.0.0.1",
        "id": "0006191D5E2A1B3CF4430100000A0001",
        "qos": 1,
        "from": "sdv-platform",
        "topic": topic,
        "payload": payload,
        "timestamp": 1718000000123,
        "headers": dict(HEADERS if headers is None else headers),
    }


def request(method: str, package: str) -> dict[str, Any]:
    """A realistic request for `method`, with the v3-only fields only on v3."""
    v3 = package == "v3"
    m = meta(package)
    ci = clientinfo()
    values: dict[str, dict[str, Any]] = {
        "OnProviderLoaded": {
            "broker": {
                "version": m["version"],
                "sysdescr": "EMQX",
                "uptime": 123456,
                "datetime": "2024-06-10T08:00:00.123456789+00:00",
            },
            "meta": m,
        },
        "OnProviderUnloaded": {"meta": m},
        "OnClientConnect": {"conninfo": CONNINFO, "props": props(package), "meta": m},
        "OnClientConnack": {"conninfo": CONNINFO, "result_code": "success", "props": props(package), "meta": m},
        "OnClientConnected": {"clientinfo": ci, "meta": m},
        "OnClientDisconnected": {"clientinfo": ci, "reason": "normal", "meta": m},
        "OnClientAuthenticate": {"clientinfo": clientinfo(password="s3cret"), "result": True, "meta": m},
        "OnClientAuthorize": {
            "clientinfo": ci,
            "type": SUBSCRIBE,
            "topic": "vehicle/VIN1/cmd",
            "result": True,
            "meta": m,
        },
        "OnClientSubscribe": {"clientinfo": ci, "props": props(package), "topic_filters": TOPIC_FILTERS, "meta": m},
        "OnClientUnsubscribe": {
            "clientinfo": ci,
            "props": props(package),
            "topic_filters": [{"name": "vehicle/VIN1/cmd"}],
            "meta": m,
        },
        "OnSessionCreated": {"clientinfo": ci, "meta": m},
        "OnSessionSubscribed": {
            "clientinfo": ci,
            "topic": "$share/g1/fleet/+/status",
            "subopts": {"qos": 2, "rh": 2, "rap": 1, "nl": 1},
            "meta": m,
        },
        "OnSessionUnsubscribed": {"clientinfo": ci, "topic": "vehicle/VIN1/cmd", "meta": m},
        "OnSessionResumed": {"clientinfo": ci, "meta": m},
        "OnSessionDiscarded": {"clientinfo": ci, "meta": m},
        "OnSessionTakenover": {"clientinfo": ci, "meta": m},
        "OnSessionTerminated": {"clientinfo": ci, "reason": "{shutdown,normal}", "meta": m},
        "OnMessagePublish": {"message": message(), "meta": m},
        "OnMessageDelivered": {"clientinfo": ci, "message": message(), "meta": m},
        "OnMessageDropped": {"message": message(), "reason": "no_subscribers", "meta": m},
        "OnMessageAcked": {"clientinfo": ci, "message": message(), "meta": m},
    }
    req = values[method]
    if v3:
        if method in ("OnClientConnect", "OnClientConnack", "OnClientSubscribe", "OnClientUnsubscribe"):
            req["user_props"] = USER_PROPS
        if method == "OnMessagePublish":
            req["props"] = [{"name": "Message-Expiry-Interval", "value": "60"}]
            req["user_props"] = USER_PROPS
    return req


def encode_request(method: str, package: str, values: dict[str, Any] | None = None) -> bytes:
    return wire.encode_message(RPCS[method][0], request(method, package) if values is None else values, package=package)


# -- MQTT topic-filter matching (MQTT 3.1.1 section 4.7, as `emqx_topic:match`) ---------------------


def is_valid_filter(topic_filter: str) -> bool:
    """Non-empty; `#` only as the whole last level; `+` only as a whole level."""
    levels = topic_filter.split("/")
    if not topic_filter:
        return False
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def topic_matches(topic_filter: str, topic: str) -> bool:
    """`+` matches one level, `#` the rest (parent included); `$` topics never match a leading wildcard."""
    f_levels, t_levels = topic_filter.split("/"), topic.split("/")
    if topic.startswith("$") and f_levels[0] in ("+", "#"):
        return False
    for i, level in enumerate(f_levels):
        if level == "#":
            return True
        if i >= len(t_levels) or (level != "+" and level != t_levels[i]):
            return False
    return len(f_levels) == len(t_levels)


# -- fixtures and answer checks ------------------------------------------------------------------------

Call = Callable[[str, str, bytes], bytes]


@pytest.fixture
def call(server: InProcessServer) -> Iterator[Call]:
    """call(package, method, request_bytes) -> response bytes, over a raw loopback channel."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")

    def do_call(package: str, method: str, body: bytes) -> bytes:
        stub = channel.unary_unary(
            f"/emqx.exhook.{package}.HookProvider/{method}", request_serializer=None, response_deserializer=None
        )
        answer = stub(body, timeout=10)
        assert isinstance(answer, bytes)
        return answer

    yield do_call
    channel.close()


def loaded_specs(answer: bytes) -> dict[str, list[str]]:
    """LoadedResponse -> {hook name: topic filters}, checked at the raw field level first."""
    raw = wire.decode(answer)
    assert set(raw) <= {1}, f"LoadedResponse has unknown fields {sorted(raw)}"
    specs: dict[str, list[str]] = {}
    for spec_bytes in raw.get(1, []):
        spec = wire.decode(spec_bytes)
        assert set(spec) <= {1, 2}, f"HookSpec has unknown fields {sorted(spec)}"
        [name] = [n.decode() for n in spec.get(1, [b""])]
        assert name not in specs, f"hook {name!r} listed twice"
        specs[name] = [t.decode() for t in spec.get(2, [])]
    return specs


def assert_answer(kind: str, answer: bytes) -> None:
    if kind == "empty":
        assert answer == b"", "EmptySuccess must have no fields"
    elif kind == "ignore":
        raw = wire.decode(answer)
        assert raw[1] == [IGNORE]
        assert set(raw) <= {1, 3, 4}
    else:
        specs = loaded_specs(answer)
        assert specs and set(specs) <= VALID_HOOK_NAMES


# -- every RPC of both services --------------------------------------------------------------------

NOTIFY = [m for m, (_, kind) in RPCS.items() if kind == "empty"]


@pytest.mark.parametrize("method", NOTIFY)
@pytest.mark.parametrize("package", PACKAGES)
def test_notify_hook_answers_empty_success(call: Call, package: str, method: str) -> None:
    """Every notify hook answers EmptySuccess, i.e. zero bytes on the wire, on both packages."""
    assert call(package, method, encode_request(method, package)) == b""


@pytest.mark.parametrize("method", ["OnClientAuthenticate", "OnClientAuthorize"])
@pytest.mark.parametrize("package", PACKAGES)
def test_authn_and_authz_answer_ignore(call: Call, package: str, method: str) -> None:
    """Authenticate and authorize answer ValuedResponse IGNORE (type field 1 = 1) with no opinion."""
    answer = wire.decode(call(package, method, encode_request(method, package)))
    assert answer[1] == [IGNORE]
    assert 3 not in answer and 4 not in answer


@pytest.mark.parametrize("package", PACKAGES)
def test_publish_on_ordinary_topic_answers_ignore(call: Call, server: InProcessServer, package: str) -> None:
    """OnMessagePublish on a non-batch topic (t/1) answers IGNORE and stores nothing."""
    answer = wire.decode(call(package, "OnMessagePublish", encode_request("OnMessagePublish", package)))
    assert answer[1] == [IGNORE]
    assert 4 not in answer
    assert server.store.stats().rows == 0


@pytest.mark.parametrize("package", PACKAGES)
def test_provider_loaded_lists_only_valid_hook_names(call: Call, package: str) -> None:
    """OnProviderLoaded answers a LoadedResponse whose every HookSpec name is one of the 19 EMQX hooks."""
    specs = loaded_specs(call(package, "OnProviderLoaded", encode_request("OnProviderLoaded", package)))
    assert specs, "no hooks registered"
    assert set(specs) <= VALID_HOOK_NAMES, sorted(set(specs) - VALID_HOOK_NAMES)


@pytest.mark.parametrize("package", PACKAGES)
def test_provider_loaded_publish_filters_cover_the_batch_topics(call: Call, package: str) -> None:
    """The message.publish HookSpec's valid topic filters match the three batch topics and not ordinary ones."""
    specs = loaded_specs(call(package, "OnProviderLoaded", encode_request("OnProviderLoaded", package)))
    filters = specs["message.publish"]
    assert filters, "empty topics would send every publish in the cluster to us"
    assert all(is_valid_filter(f) for f in filters), filters
    for topic in ("$SDV-FANOUT", "$SDV-FANOUT/trigger", "$SDV-FANOUT/data/1718000000000", "$SDV-FANOUT/data/x"):
        assert any(topic_matches(f, topic) for f in filters), (topic, filters)
    for topic in ("t/1", "vehicle/VIN1/cmd", "$SYS/brokers"):
        assert not any(topic_matches(f, topic) for f in filters), (topic, filters)


def test_topic_matcher_follows_mqtt_wildcard_rules() -> None:
    """The test's own matcher: `+` is one level, `#` the rest, and `$` topics escape leading wildcards."""
    assert topic_matches("a/+/c", "a/b/c") and not topic_matches("a/+/c", "a/b/x/c")
    assert topic_matches("a/#", "a") and topic_matches("a/#", "a/b/c") and not topic_matches("a/#", "b/a")
    assert topic_matches("#", "a/b") and not topic_matches("#", "$SDV-FANOUT")
    assert not topic_matches("+/data/x", "$SDV-FANOUT/data/x") and topic_matches("$SDV-FANOUT/+/x", "$SDV-FANOUT/d/x")
    assert topic_matches("$SDV-FANOUT", "$SDV-FANOUT") and not topic_matches("$SDV-FANOUT", "$SDV-FANOUT/x")
    assert not is_valid_filter("a/#/b") and not is_valid_filter("a+/b") and is_valid_filter("$SDV-FANOUT/data/#")


# -- the batch path ------------------------------------------------------------------------------


@pytest.mark.parametrize("package", PACKAGES)
def test_batch_publish_is_stopped_echoed_whole_and_stored(call: Call, server: InProcessServer, package: str) -> None:
    """A valid $SDV-FANOUT batch answers STOP_AND_RETURN echoing the message with allow_publish=false, and is stored."""
    payload = b'{"ids":["VIN1"],"request_id":"task_a_1","data":"x"}'
    sent = message(topic="$SDV-FANOUT", payload=payload)
    values = {**request("OnMessagePublish", package), "message": sent}

    raw = wire.decode(call(package, "OnMessagePublish", encode_request("OnMessagePublish", package, values)))
    assert raw[1] == [STOP_AND_RETURN]
    assert 3 not in raw, "bool_result and message are one oneof"
    [echo_bytes] = raw[4]
    echo = wire.decode_message("Message", echo_bytes)
    for name in ("topic", "qos", "payload", "from", "id"):
        assert echo[name] == sent[name], name
    assert echo["headers"]["allow_publish"] == "false"
    assert echo["headers"] == {**HEADERS, "allow_publish": "false"}

    [row] = server.store.pending("VIN1")
    assert row.request_id == "task_a_1"
    assert server.store.blob(row.sha1) == b"x"


# -- non-UTF-8 octets in `string` fields EMQX fills from client data -------------------------------


@pytest.mark.parametrize("package", PACKAGES)
def test_non_utf8_password_is_accepted(call: Call, package: str) -> None:
    """OnClientAuthenticate with non-UTF-8 ClientInfo.password bytes still answers IGNORE, not a gRPC error."""
    values = {**request("OnClientAuthenticate", package), "clientinfo": clientinfo(password=BAD_UTF8)}
    answer = wire.decode(call(package, "OnClientAuthenticate", encode_request("OnClientAuthenticate", package, values)))
    assert answer[1] == [IGNORE]


PROPERTY_CASES = [
    (package, method, field)
    for package in PACKAGES
    for method in ("OnClientConnect", "OnClientConnack", "OnClientSubscribe", "OnClientUnsubscribe", "OnMessagePublish")
    for field in ("props", "user_props")
    if package == "v3" or (field == "props" and method != "OnMessagePublish")
]


@pytest.mark.parametrize(("package", "method", "field"), PROPERTY_CASES)
def test_non_utf8_property_value_is_accepted(call: Call, package: str, method: str, field: str) -> None:
    """A Property.value holding non-UTF-8 bytes (e.g. Correlation-Data) still gets the normal answer."""
    values = request(method, package)
    values[field] = [{"name": "Correlation-Data", "value": b"\x80\xc3(\xff" + BAD_UTF8}, *values.get(field, [])]
    assert_answer(RPCS[method][1], call(package, method, encode_request(method, package, values)))


# -- EMQX 5.0-5.3 (v2, old layout) ------------------------------------------------------------------


def legacy_clientinfo() -> bytes:
    """ClientInfo as 5.0-5.3 sent it: no peerport (field 13)."""
    ci = clientinfo()
    del ci["peerport"]
    return wire.encode_message("ClientInfo", ci)


def legacy_topic_filter(name: str, qos: int) -> bytes:
    """5.0-5.3 TopicFilter{name = 1, qos = 2 (uint32)}."""
    return wire.encode([(1, wire.LEN, name), (2, wire.VARINT, qos)])


def legacy_subopts(qos: int, share: str) -> bytes:
    """5.0-5.3 SubOpts{qos = 1, share = 2 (string), rh = 3, rap = 4, nl = 5}."""
    return wire.encode(
        [(1, wire.VARINT, qos), (2, wire.LEN, share), (3, wire.VARINT, 0), (4, wire.VARINT, 0), (5, wire.VARINT, 0)]
    )


@pytest.mark.parametrize("method", ["OnClientSubscribe", "OnClientUnsubscribe"])
def test_v2_legacy_topic_filter_with_qos_field_2_is_accepted(call: Call, method: str) -> None:
    """EMQX 5.0-5.3 topic filters carrying qos in the now-reserved field 2 are accepted on v2."""
    values = {
        "clientinfo": legacy_clientinfo(),
        "props": [],
        "topic_filters": [legacy_topic_filter("vehicle/VIN1/cmd", 1), legacy_topic_filter("fleet/+/status", 2)],
        "meta": meta("v2"),
    }
    assert call("v2", method, encode_request(method, "v2", values)) == b""


def test_v2_legacy_subopts_with_share_field_2_is_accepted(call: Call) -> None:
    """EMQX 5.0-5.3 OnSessionSubscribed with SubOpts.share in the now-reserved field 2 is accepted on v2."""
    values = {
        "clientinfo": legacy_clientinfo(),
        "topic": "fleet/+/status",
        "subopts": legacy_subopts(1, "g1"),
        "meta": meta("v2"),
    }
    assert call("v2", "OnSessionSubscribed", encode_request("OnSessionSubscribed", "v2", values)) == b""


# -- forward compatibility -----------------------------------------------------------------------------

#: Fields a future EMQX might add: one of every wire type, numbers no table uses.
FUTURE_FIELDS = wire.encode(
    [(99, wire.LEN, b"future"), (100, wire.VARINT, 7), (101, wire.I32, 0xDEADBEEF), (102, wire.I64, 1 << 40)]
)


@pytest.mark.parametrize("method", list(RPCS))
@pytest.mark.parametrize("package", PACKAGES)
def test_unknown_top_level_fields_are_ignored(call: Call, package: str, method: str) -> None:
    """A request with extra unknown field numbers (99-102, every wire type) gets the normal answer."""
    body = encode_request(method, package) + FUTURE_FIELDS
    assert_answer(RPCS[method][1], call(package, method, body))


@pytest.mark.parametrize("package", PACKAGES)
def test_unknown_nested_fields_are_ignored(call: Call, package: str) -> None:
    """Unknown fields inside ClientInfo and RequestMeta do not break OnClientAuthenticate."""
    values = {
        "clientinfo": wire.encode_message("ClientInfo", clientinfo(password="pw")) + FUTURE_FIELDS,
        "result": False,
        "meta": wire.encode_message("RequestMeta", meta(package)) + FUTURE_FIELDS,
    }
    answer = wire.decode(call(package, "OnClientAuthenticate", encode_request("OnClientAuthenticate", package, values)))
    assert answer[1] == [IGNORE]


@pytest.mark.parametrize("package", PACKAGES)
def test_batch_with_unknown_message_fields_is_still_stored(call: Call, server: InProcessServer, package: str) -> None:
    """A batch whose Message carries unknown fields is stored and echoed with its known fields intact."""
    sent = message(topic="$SDV-FANOUT", payload=b'{"ids":["VIN1"],"request_id":"task_a_1","data":"x"}')
    values = {"message": wire.encode_message("Message", sent) + FUTURE_FIELDS, "meta": meta(package)}
    raw = wire.decode(call(package, "OnMessagePublish", encode_request("OnMessagePublish", package, values)))
    assert raw[1] == [STOP_AND_RETURN]
    echo = wire.decode_message("Message", raw[4][0])
    assert (echo["topic"], echo["qos"], echo["payload"]) == (sent["topic"], sent["qos"], sent["payload"])
    assert [r.request_id for r in server.store.pending("VIN1")] == ["task_a_1"]
