"""Topic templates with one `{VIN}` level: render them, turn them into filters, read the VIN back."""

from __future__ import annotations

import re


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
