"""Acks through EMQX's rule engine (`ack_topic_prefix`): each delivery's PUBACK as a small MQTT message.

An operator-created rule (`rule_body`) stands in for the costly `message.acked` hook call: it selects
the acked message's topic, the acker and the SHA-1 of the payload, and republishes them as compact
JSON to `<ack_topic_prefix>/<delivery clientid>`, where that delivery client is subscribed.
`RuleAcks` turns each such message into the call the hook makes (`Dispatcher.acked`); anything
else is counted (`sdv_fanout_rule_acks_total{outcome}`), logged and dropped, never raised.
"""

from __future__ import annotations

import enum
import re
import time
from typing import Any, NamedTuple

import orjson
import structlog

from exhook_server import metrics
from exhook_server.config import Config
from exhook_server.dispatch.commands import Session
from exhook_server.dispatch.port import Dispatch
from exhook_server.errors import ConfigError
from exhook_server.topics import RequestTopics

log = structlog.get_logger("sdv_fanout.acks")

#: The rule's column names, one letter each: the message is sent once per delivery.
SHA1, TOPIC, ACKER, PUBLISHER = "h", "t", "c", "f"
#: A real ack message is ~150 B; anything much larger is not one, and is not parsed.
MAX_ACK_BYTES = 4096
#: At most one log line per this many seconds for rejected ack messages (each is counted).
_LOG_EVERY_S = 1.0
_HEX40 = re.compile(r"[0-9a-f]{40}")
#: What a clientid prefix or topic filter may hold to be written into the rule as is: no
#: quote ends the SQL string, no regex metacharacter changes the prefix match.
_PLAIN = re.compile(r"[A-Za-z0-9_-]*")


class AckProblem(enum.StrEnum):
    """Why an ack message was ignored. Values are stable: the metric label and the log field."""

    TOO_LARGE = "too_large"
    INVALID_JSON = "invalid_json"
    WRONG_TYPE = "wrong_type"
    MISSING_FIELD = "missing_field"
    BAD_SHA1 = "bad_sha1"
    NOT_A_DELIVERY = "not_a_delivery"
    NOT_OURS = "not_ours"


class AckIgnored(ValueError):
    """An ack message that acknowledges nothing; `problem` says why."""

    def __init__(self, problem: AckProblem, detail: str = "") -> None:
        super().__init__(f"{problem.value}: {detail}" if detail else problem.value)
        self.problem = problem


class RuleAck(NamedTuple):
    """One PUBACK of one of our deliveries, as the rule reported it (one per delivery: a tuple,
    cheaper to build than a frozen dataclass)."""

    vin: str
    request_id: str
    sha1: bytes
    acker: str


def parse_ack(payload: bytes, topics: RequestTopics, publisher_prefix: str) -> RuleAck:
    """The PUBACK an ack message reports; AckIgnored when it reports none of ours.

    The same checks as the hook: the acked topic is a delivery topic, its publisher one of our
    delivery clients, and the SHA-1 (lower-case hex, as EMQX's `sha()` gives it) names the
    payload the dispatcher compares with the row's.
    """
    if len(payload) > MAX_ACK_BYTES:
        raise AckIgnored(AckProblem.TOO_LARGE, f"{len(payload)} bytes")
    try:
        doc = orjson.loads(payload)  # a fifth of json.loads' time on an ack message
    except orjson.JSONDecodeError as exc:  # invalid UTF-8 included
        raise AckIgnored(AckProblem.INVALID_JSON, str(exc)) from None
    if not isinstance(doc, dict):
        raise AckIgnored(AckProblem.WRONG_TYPE, f"a JSON {type(doc).__name__}, not an object")
    fields = []
    for key in (SHA1, TOPIC, ACKER, PUBLISHER):
        value = doc.get(key)
        if value is None:
            raise AckIgnored(AckProblem.MISSING_FIELD, key)
        if not isinstance(value, str):
            raise AckIgnored(AckProblem.WRONG_TYPE, f"{key} is not a string")
        fields.append(value)
    digest, topic, acker, publisher = fields
    if not _HEX40.fullmatch(digest):
        raise AckIgnored(AckProblem.BAD_SHA1, "not 40 lower-case hex digits")
    parsed = topics.parse_delivery(topic)
    if parsed is None:
        raise AckIgnored(AckProblem.NOT_A_DELIVERY, topic)
    if not publisher.startswith(publisher_prefix):
        raise AckIgnored(AckProblem.NOT_OURS, publisher)
    return RuleAck(parsed[0], parsed[1], bytes.fromhex(digest), acker)


class RuleAcks:
    """The delivery client's ack subscription, feeding the dispatcher (event-loop thread)."""

    def __init__(self, cfg: Config, dispatcher: Dispatch) -> None:
        self._dispatch = dispatcher
        self._topics = RequestTopics(cfg.request_topic_prefix)
        self._publisher_prefix = cfg.mqtt_clientid_prefix
        self._ok = metrics.RULE_ACKS.labels("ok")
        self._ignored = {p: metrics.RULE_ACKS.labels(p.value) for p in AckProblem}
        self._quiet_until = 0.0
        self._unlogged = 0

    def received(self, payload: bytes) -> None:
        """One message on our ack topic: the dispatcher's `acked`, or counted and dropped."""
        try:
            ack = parse_ack(payload, self._topics, self._publisher_prefix)
        except AckIgnored as exc:
            self._ignored[exc.problem].inc()
            self._log_ignored(exc, payload)
            return
        self._ok.inc()
        self._dispatch.acked(Session("", ack.acker, ""), ack.vin, ack.request_id, ack.sha1)

    def _log_ignored(self, exc: AckIgnored, payload: bytes) -> None:
        # Only someone who may publish to the ack topics sends these (the ACL should let nobody):
        # log it, but one line a second at most however fast they come.
        now = time.monotonic()
        if now < self._quiet_until:
            self._unlogged += 1
            return
        log.warning(
            "rule_ack_ignored",
            reason=exc.problem.value,
            detail=str(exc),
            payload=payload[:200].decode(errors="replace"),
            not_logged_before=self._unlogged,
        )
        self._quiet_until = now + _LOG_EVERY_S
        self._unlogged = 0


def rule_sql(cfg: Config) -> str:
    """The rule's SQL for these settings: every PUBACK of a delivery topic whose message one of
    our delivery clients published, as the payload's SHA-1, the topic, the acker and the publisher."""
    topic_filter = RequestTopics(cfg.request_topic_prefix).filter
    for name, text in (("request_topic_prefix", topic_filter.replace("/", "").replace("+", "")),
                       ("mqtt_clientid_prefix", cfg.mqtt_clientid_prefix)):  # fmt: skip
        if not _PLAIN.fullmatch(text):
            raise ConfigError(f"{name} holds characters the generated rule cannot quote; write the rule by hand")
    return (
        f"SELECT sha(payload) AS {SHA1}, topic AS {TOPIC}, clientid AS {ACKER}, from_clientid AS {PUBLISHER} "
        f"FROM \"$events/message_acked\" WHERE topic =~ '{topic_filter}' "
        f"AND regex_match(from_clientid, '^{cfg.mqtt_clientid_prefix}')"
    )


def rule_body(cfg: Config, *, direct_dispatch: bool = True) -> dict[str, Any]:
    """`POST /api/v5/rules` for these settings (EMQX 5.1 to 6.x take the same shape).

    An empty payload template makes EMQX send the selected columns as JSON, escaped by EMQX
    itself (a quote in a request id cannot break it). `direct_dispatch` hands the message to
    its subscriber without another round of publish hooks and rules; EMQX 5.8 and 5.9 do it,
    5.1 stores the flag and then fails every action, so pass False for brokers before 5.8.
    """
    if not cfg.rule_ack_topic_prefix:
        raise ConfigError("ack_topic_prefix is empty: acks come through the message.acked hook, no rule is needed")
    args: dict[str, Any] = {
        "topic": f"{cfg.rule_ack_topic_prefix}/${{{PUBLISHER}}}",
        "qos": 1,
        "retain": False,
        "payload": "",
    }
    if direct_dispatch:
        args["direct_dispatch"] = True
    return {
        "name": "sdv-fanout-acks",
        "enable": True,
        "description": "PUBACKs of sdv-fanout deliveries, to the delivery client that sent them (ack_topic_prefix)",
        "sql": rule_sql(cfg),
        "actions": [{"function": "republish", "args": args}],
    }
