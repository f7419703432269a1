"""Vehicle events over MQTT (vehicle_events = mqtt): heartbeats and answers from our shared subscription.

Each server process is one member of `$share/<events_share_group>/...` on the heartbeat topics (QoS 0:
a lost heartbeat is followed by the next) and the response topics (QoS 1, PUBACKed once handed to
dispatch: EMQX gives an answer a member that left without acknowledging to another member). A message
is attributed to the VIN in its topic, which EMQX lets only that vehicle's client publish on
(deploy/emqx/acl.conf); its connection is unknown (`Session("", vin, "")`, which the dispatch rules
match with any connection of that client). The MQTT side is `subscriber.Subscriber`, on the event loop.
"""

from __future__ import annotations

import os
import socket

import structlog

from exhook_server import metrics
from exhook_server.config import Config
from exhook_server.dispatch.commands import Session
from exhook_server.dispatch.port import Dispatch
from exhook_server.hooks import vehicle_event_filters
from exhook_server.subscriber import Subscriber
from exhook_server.topics import RequestTopics, TopicTemplate

log = structlog.get_logger("sdv_fanout.events")


def subscriptions(cfg: Config) -> list[tuple[str, int]]:
    """The shared-subscription filters of one member, with their QoS."""
    heartbeats, responses = vehicle_event_filters(cfg)
    group = cfg.events_share_group
    return [(f"$share/{group}/{f}", 0) for f in heartbeats] + [(f"$share/{group}/{f}", 1) for f in responses]


class VehicleEvents:
    """One member of the events group, held while `hold` runs (cancel it to leave)."""

    def __init__(self, cfg: Config, dispatcher: Dispatch, clientid: str | None = None) -> None:
        self._dispatch = dispatcher
        self.clientid = clientid or f"{cfg.mqtt_clientid_prefix}events-{socket.gethostname()}-{os.getpid()}"
        self._heartbeats = [TopicTemplate(t) for t in cfg.heartbeat_topics]
        self._responses = RequestTopics(cfg.response_topic_prefix) if cfg.response_topic_prefix else None
        self._max_response = cfg.max_response_bytes
        self._counts = {k: metrics.VEHICLE_EVENTS.labels(k) for k in ("heartbeat", "answer", "ignored")}
        self._subscriber = Subscriber(
            cfg, self.clientid, subscriptions(cfg), self.handle, self._state, gather_s=cfg.events_gather_ms / 1000
        )

    async def hold(self) -> None:
        """Be a member until cancelled (reconnecting after any loss)."""
        log.info("events_subscribing", clientid=self.clientid, topics=[t for t, _ in self._subscriber.filters])
        try:
            await self._subscriber.run()
        finally:
            metrics.EVENTS_SUBSCRIBED.set(0)
            log.info("events_left", clientid=self.clientid)

    def _state(self, up: bool) -> None:
        metrics.EVENTS_SUBSCRIBED.set(1 if up else 0)
        if up:
            log.info("events_subscribed", clientid=self.clientid)

    def handle(self, topic: str, payload: bytes) -> None:
        """One vehicle message: a heartbeat or an answer of the VIN in its topic, else counted."""
        for template in self._heartbeats:
            vin = template.vin(topic)
            if vin is not None:
                self._counts["heartbeat"].inc()
                metrics.HEARTBEATS.inc()
                self._dispatch.heartbeat(Session("", vin, ""), vin)
                return
        if self._responses is not None and (parsed := self._responses.parse_delivery(topic)) is not None:
            vin, request_id = parsed
            self._counts["answer"].inc()
            self._dispatch.responded(Session("", vin, ""), vin, request_id, payload[: self._max_response], len(payload))
            return
        self._counts["ignored"].inc()
