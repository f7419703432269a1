"""Topic names: what MQTT brokers accept in one, and templates with one `{VIN}` level.

The rules are the strictest of MQTT 5 (§1.5.4 UTF-8 strings, §4.7.3 topic names) and of the brokers
we deliver through: mosquitto drops a publisher that sends control characters (U+0001-U+001F,
U+007F-U+009F) or Unicode non-characters; EMQX refuses NUL, wildcards and invalid UTF-8. Such a
request id or VIN would break the delivery link every vehicle shares, so ingest refuses it
(`level_problem`) and the settings refuse templates that break them (`template_problem`).
"""

from __future__ import annotations

import re

#: MQTT 5 §4.7.3: a topic name is at most 65,535 bytes of UTF-8.
MAX_TOPIC_BYTES = 65_535
#: EMQX refuses topics deeper than its `mqtt.max_topic_levels` (128 by default).
MAX_TOPIC_LEVELS = 128

#: Unicode non-characters: U+FDD0-U+FDEF and the last two code points of every plane.
_NONCHARS = "\ufdd0-\ufdef" + "".join(f"{chr(plane << 16 | 0xFFFE)}{chr(plane << 16 | 0xFFFF)}" for plane in range(17))
#: What no topic name may hold (NUL, C0 and C1 controls, lone surrogates, non-characters).
_BAD_IN_NAME = re.compile(f"[\x00-\x1f\x7f-\x9f\ud800-\udfff{_NONCHARS}]")
#: What no single level may hold on top of that: the separator and the wildcards.
_BAD_IN_LEVEL = re.compile(f"[/+#\x00-\x1f\x7f-\x9f\ud800-\udfff{_NONCHARS}]")


def _describe(char: str) -> str:
    if char in "/+#":
        return f"{char!r} (a topic separator or wildcard)"
    return f"U+{ord(char):04X} (a control character, surrogate or non-character MQTT brokers refuse)"


def level_problem(text: str) -> str | None:
    """Why `text` cannot be one topic level (an id inside a delivery topic), or None if it can."""
    if not text:
        return "empty"
    bad = _BAD_IN_LEVEL.search(text)
    return f"contains {_describe(bad.group())}" if bad else None


def is_level(text: str) -> bool:
    """`level_problem(text) is None`, as one regex search (the ingest fast path joins many ids)."""
    return bool(text) and _BAD_IN_LEVEL.search(text) is None


def name_problem(topic: str) -> str | None:
    """Why `topic` cannot be an MQTT topic name, or None if it can."""
    if not topic:
        return "empty"
    bad = _BAD_IN_NAME.search(topic)
    if bad:
        return f"contains {_describe(bad.group())}"
    if "+" in topic or "#" in topic:
        return "contains wildcards ('+' or '#')"
    if len(topic.encode()) > MAX_TOPIC_BYTES:
        return f"longer than {MAX_TOPIC_BYTES} bytes"
    if topic.count("/") + 1 > MAX_TOPIC_LEVELS:
        return f"deeper than {MAX_TOPIC_LEVELS} levels"
    return None


def template_problem(template: str, *, levels_after: int = 0) -> str | None:
    """Why a topic template with one `{VIN}` level is unusable, or None.

    `{VIN}` must be a whole level: `+` only stands for whole levels in a filter.
    `levels_after` counts levels the server appends (the request id), so the
    rendered topics stay within EMQX's level limit.
    """
    if template.count("{VIN}") != 1:
        return "must contain {VIN} exactly once"
    if "{VIN}" not in template.split("/"):
        return "{VIN} must be a whole topic level"
    return name_problem(template.replace("{VIN}", "v") + "/v" * levels_after)


class TopicTemplate:
    """A topic such as `agent/{VIN}/proxy/request` where `{VIN}` is exactly one level."""

    def __init__(self, template: str) -> None:
        self.template = template
        head, _, tail = template.partition("{VIN}")
        self._re = re.compile(re.escape(head) + r"([^/+#]+)" + re.escape(tail))
        #: The MQTT filter matching every VIN (`{VIN}` → `+`).
        self.filter = template.replace("{VIN}", "+")

    def render(self, vin: str) -> str:
        return self.template.replace("{VIN}", vin)

    def vin(self, topic: str) -> str | None:
        """The VIN of a topic that matches the template exactly, else None."""
        m = self._re.fullmatch(topic)
        return m.group(1) if m else None


class RequestTopics:
    """Delivery topics `<prefix>/<request_id>` and the vehicles' subscription `<prefix>/+`."""

    def __init__(self, prefix_template: str) -> None:
        self.prefix = TopicTemplate(prefix_template)
        self.subscription = TopicTemplate(prefix_template + "/+")
        #: What vehicles subscribe to, for any VIN: `agent/+/proxy/request/+`.
        self.filter = self.prefix.filter + "/+"

    def delivery(self, vin: str, request_id: str) -> str:
        return f"{self.prefix.render(vin)}/{request_id}"

    def parse_delivery(self, topic: str) -> tuple[str, str] | None:
        """(VIN, request_id) of a delivery topic, else None."""
        head, sep, request_id = topic.rpartition("/")
        if not sep or not request_id:
            return None
        vin = self.prefix.vin(head)
        return (vin, request_id) if vin else None

    def subscribed_vin(self, topic: str) -> str | None:
        """The VIN of a subscription to exactly `<prefix>/+` (shared subscriptions do not count)."""
        return self.subscription.vin(topic)


def filter_matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic-filter matching (`+` one level, `#` the rest); a `$` topic needs a `$` filter."""
    if topic.startswith("$") and not topic_filter.startswith("$"):
        return False
    levels, wanted = topic.split("/"), topic_filter.split("/")
    for i, want in enumerate(wanted):
        if want == "#":
            return True
        if i >= len(levels) or (want != "+" and want != levels[i]):
            return False
    return len(levels) == len(wanted)
