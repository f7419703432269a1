"""EMQX's rule engine as the simulator plays it: the ack rule `sdv-fanout emqx sync` installs, on mosquitto.

`RuleEngine.add(body)` takes a `POST /api/v5/rules` body of the ack rule's form only (`UnsupportedRule`
otherwise). `acked(...)` is EMQX's `message_acked` event: each matching rule's output is published
before it returns, as EMQX's republish does (no ACL), over one MQTT connection of its own, re-made
after a broker restart; an output the broker was not there to take is lost, as on EMQX (`lost`).
The output is the selected columns as compact JSON, keys in descending order: byte for byte what
EMQX 5.8.9 and 5.9.1 send (tests/integration/test_sim_vs_real.py compares them).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from testkit import mqtt

#: The SQL form `exhook_server.acks.rule_sql` writes.
_SQL = re.compile(
    r"SELECT (?P<columns>.+?) FROM \"\$events/message_acked\" "
    r"WHERE topic =~ '(?P<filter>[^']*)' AND regex_match\(from_clientid, '(?P<publisher>[^']*)'\)"
)
_COLUMN = re.compile(r"\s*(?P<expr>sha\(payload\)|topic|clientid|from_clientid) AS (?P<alias>\w+)\s*")
_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


class UnsupportedRule(ValueError):
    """A rule the simulator does not know how to run (so a test cannot silently lose its output)."""


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching as `emqx_topic:match/2`: `+`/`#` first level never match `$...` topics."""
    fwords, twords = topic_filter.split("/"), topic.split("/")
    if topic.startswith("$") and fwords[0] in ("+", "#"):
        return False
    for i, word in enumerate(fwords):
        if word == "#":
            return True
        if i >= len(twords) or (word != "+" and word != twords[i]):
            return False
    return len(fwords) == len(twords)


@dataclass(frozen=True)
class AckRule:
    """One `$events/message_acked` rule with its republish action."""

    name: str
    topic_filter: str
    publisher: re.Pattern[str]
    columns: tuple[tuple[str, str], ...]  # (expression, alias)
    topic: str  # republish topic template (`${alias}` placeholders)
    qos: int

    @classmethod
    def parse(cls, body: dict[str, Any]) -> AckRule:
        sql = _SQL.fullmatch(str(body.get("sql", "")).strip())
        actions = body.get("actions") or []
        if sql is None or len(actions) != 1 or actions[0].get("function") != "republish":
            raise UnsupportedRule(f"not an ack rule the simulator runs: {body.get('sql')!r} {actions!r}")
        columns = []
        for part in sql["columns"].split(","):
            col = _COLUMN.fullmatch(part)
            if col is None:
                raise UnsupportedRule(f"column {part.strip()!r} is not simulated")
            columns.append((col["expr"], col["alias"]))
        args = actions[0].get("args") or {}
        if args.get("payload", "") != "":
            raise UnsupportedRule("only the empty payload template (the selected columns as JSON) is simulated")
        return cls(
            str(body.get("name", "")),
            sql["filter"],
            re.compile(sql["publisher"]),
            tuple(columns),
            str(args["topic"]),
            int(args.get("qos", 0)),
        )

    def output(self, acker: str, topic: str, payload: bytes, publisher: str) -> tuple[str, bytes] | None:
        """(topic, payload) the rule republishes for this PUBACK, None when its WHERE is false."""
        if not topic_matches(self.topic_filter, topic) or self.publisher.search(publisher) is None:
            return None
        fields = {
            "sha(payload)": hashlib.sha1(payload).hexdigest(),
            "topic": topic,
            "clientid": acker,
            "from_clientid": publisher,
        }
        selected = {alias: fields[expr] for expr, alias in self.columns}
        out_topic = _PLACEHOLDER.sub(lambda m: str(selected.get(m[1], "undefined")), self.topic)
        ordered = dict(sorted(selected.items(), reverse=True))  # EMQX 5.8.9 and 5.9.1: {"t":..,"h":..,"f":..,"c":..}
        return out_topic, json.dumps(ordered, separators=(",", ":")).encode()


class RuleEngine:
    """The installed rules of one simulated broker and their republish connection."""

    def __init__(self, mqtt_port: int, clientid: str = "emqx-rule-engine") -> None:
        self.rules: list[AckRule] = []
        #: Every (topic, payload) republished, in order (what a subscriber of `#` would see).
        self.published: list[tuple[str, bytes]] = []
        #: Outputs the broker was not there to take (it was restarting).
        self.lost: list[tuple[str, bytes]] = []
        self._client = mqtt.Client(mqtt_port, clientid)
        self._lock = threading.Lock()

    def add(self, body: dict[str, Any]) -> AckRule:
        """Install a rule (`POST /rules`); the first one opens the republish connection."""
        rule = AckRule.parse(body)
        with self._lock:
            self.rules.append(rule)
            if not self._client.connected:
                self._client.connect()
        return rule

    def acked(self, acker: str, topic: str, payload: bytes, publisher: str) -> None:
        """The `message_acked` event: each matching rule's output, published at its QoS."""
        for rule in self.rules:
            out = rule.output(acker, topic, payload, publisher)
            if out is None:
                continue
            with self._lock:  # one connection, outputs in event order
                for attempt in range(2):
                    try:
                        if attempt or not self._client.connected:
                            self._client.connect()  # the broker restarted since
                        self._client.publish(out[0], out[1], qos=rule.qos)
                    except (mqtt.MqttError, TimeoutError):
                        continue  # the broker went away meanwhile: once more on a new connection
                    self.published.append(out)
                    break
                else:
                    self.lost.append(out)  # the broker is down: as on EMQX, the output is gone

    def close(self) -> None:
        if self._client.connected:
            self._client.close()
