"""Vehicle events over MQTT (vehicle_events = mqtt): heartbeats and answers from our shared subscription.

Each server process is one member of `$share/<events_share_group>/...` on the heartbeat topics
(QoS 0: a lost heartbeat is followed by the next) and the response topics (QoS 1: EMQX gives an
answer a member that left without acknowledging to another member). A message is attributed
to the VIN in its topic: EMQX lets a vehicle publish only under its own client id's topics
(deploy/emqx/acl.conf), so the VIN is the publisher's client id; its connection is unknown
(`Session("", vin, "")`, which the dispatch rules match with any connection of that client).
paho runs in a thread of its own; messages reach the dispatcher on the event loop in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from typing import Any

import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from exhook_server import metrics, paho_tls
from exhook_server.config import Config
from exhook_server.dispatch.commands import Session
from exhook_server.dispatch.port import Dispatch
from exhook_server.hooks import vehicle_event_filters
from exhook_server.topics import RequestTopics, TopicTemplate

log = structlog.get_logger("sdv_fanout.events")

#: Unacknowledged QoS 1 answers EMQX may send us at once (MQTT 5 Receive Maximum).
RECEIVE_MAXIMUM = 256
#: Messages waiting for the event loop at most; beyond it the MQTT thread waits, TCP holds EMQX back.
_QUEUE_MAX = 10_000
#: Reconnect backoff: doubles from the first delay to the last; a link that was up starts over.
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0
#: One turn of the MQTT thread's loop: also how late a stop is noticed at most.
_LOOP_S = 0.1


def subscriptions(cfg: Config) -> list[tuple[str, int]]:
    """The shared-subscription filters of one member, with their QoS."""
    heartbeats, responses = vehicle_event_filters(cfg)
    group = cfg.events_share_group
    return [(f"$share/{group}/{f}", 0) for f in heartbeats] + [(f"$share/{group}/{f}", 1) for f in responses]


class VehicleEvents:
    """One member of the events group, held while `hold` runs (cancel it to leave)."""

    def __init__(self, cfg: Config, dispatcher: Dispatch, clientid: str | None = None) -> None:
        self._cfg = cfg
        self._dispatch = dispatcher
        self.clientid = clientid or f"{cfg.mqtt_clientid_prefix}events-{socket.gethostname()}-{os.getpid()}"
        self._host, self._port, self._tls = paho_tls.broker(cfg)
        self._subscriptions = subscriptions(cfg)
        self._heartbeats = [TopicTemplate(t) for t in cfg.heartbeat_topics]
        self._responses = RequestTopics(cfg.response_topic_prefix) if cfg.response_topic_prefix else None
        self._max_response = cfg.max_response_bytes
        self._stop = threading.Event()
        self._room = threading.Semaphore(_QUEUE_MAX)
        self._arrived: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counts = {k: metrics.VEHICLE_EVENTS.labels(k) for k in ("heartbeat", "answer", "ignored")}

    async def hold(self) -> None:
        """Be a member until cancelled: connect (again after any loss), hand events to dispatch."""
        self._loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self._serve, name="mqtt-events", daemon=True)
        log.info("events_subscribing", clientid=self.clientid, topics=[t for t, _ in self._subscriptions])
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()
            await asyncio.to_thread(thread.join, _RETRY_MAX_S)
            metrics.EVENTS_SUBSCRIBED.set(0)
            log.info("events_left", clientid=self.clientid)

    # -- the event loop --------------------------------------------------------------------------
    def _drain(self) -> None:
        with self._lock:
            arrived, self._arrived = self._arrived, []
        for topic, payload in arrived:
            self.handle(topic, payload)
        if arrived:
            self._room.release(len(arrived))

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

    # -- the MQTT thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        delay = _RETRY_FIRST_S
        while not self._stop.is_set():
            client = paho_tls.Client(
                CallbackAPIVersion.VERSION2, client_id=self.clientid, protocol=mqtt.MQTTv5, reconnect_on_failure=False
            )
            paho_tls.authenticate(client, self._cfg, self._tls)
            client.on_connect = self._on_connect
            client.on_subscribe = self._on_subscribe
            client.on_message = self._on_message
            client.on_disconnect = self._on_disconnect
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.ReceiveMaximum = RECEIVE_MAXIMUM
            up = False
            try:
                client.connect(self._host, self._port, keepalive=self._cfg.mqtt_keepalive_s, properties=props)
                rc = mqtt.MQTT_ERR_SUCCESS
                while rc == mqtt.MQTT_ERR_SUCCESS and not self._stop.is_set():
                    rc = client.loop(timeout=_LOOP_S)
                    up = up or client.is_connected()
                if self._stop.is_set() and client.is_connected():
                    client.disconnect()  # unacknowledged answers go to another member
            except (OSError, ValueError) as exc:
                log.warning("events_connect_failed", host=self._host, port=self._port, error=str(exc), retry_s=delay)
            finally:
                metrics.EVENTS_SUBSCRIBED.set(0)
                client._reset_sockets()  # paho's own close of its socket pair (it has no public one)
            if self._stop.is_set():
                return
            delay = _RETRY_FIRST_S if up else min(delay * 2, _RETRY_MAX_S)
            self._stop.wait(delay)

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.error("events_connect_refused", clientid=self.clientid, reason=str(reason))
            return
        client.subscribe(self._subscriptions)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        refused = [t for (t, _), r in zip(self._subscriptions, reasons, strict=False) if r.is_failure]
        if refused:
            log.error("events_subscribe_refused", clientid=self.clientid, topics=refused, hint="the broker's ACL")
        else:
            metrics.EVENTS_SUBSCRIBED.set(1)
            log.info("events_subscribed", clientid=self.clientid)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        # paho PUBACKs a QoS 1 answer when this returns: it is then queued for the loop.
        while not self._room.acquire(timeout=_LOOP_S):
            if self._stop.is_set():
                return
        with self._lock:
            self._arrived.append((msg.topic, bytes(msg.payload)))
            first = len(self._arrived) == 1
        loop = self._loop
        if first and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed under us: stopping
                loop.call_soon_threadsafe(self._drain)

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        metrics.EVENTS_SUBSCRIBED.set(0)
        if not self._stop.is_set():
            log.warning("events_disconnected", clientid=self.clientid, reason=str(reason))
