"""Publishes deliveries to the broker over MQTT 5 (paho-mqtt 2.x); the only module that speaks MQTT.

paho runs its network loop in its own thread and reconnects with backoff.
Connection changes are handed to the event loop (`on_state`), where dispatch
clears in-flight state on loss and sends again when the link is back.
`publish` never blocks: paho queues the message and its in-flight window
(kept small: large windows collapse throughput) paces the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from exhook_server.config import Config
from exhook_server.topics import RequestTopics

log = structlog.get_logger("sdv_fanout.delivery")


class MqttDelivery:
    """The delivery client: one MQTT connection, QoS 1 publishes on the request topics."""

    def __init__(
        self,
        cfg: Config,
        loop: asyncio.AbstractEventLoop,
        on_state: Callable[[bool], None],
        *,
        clientid: str | None = None,
    ) -> None:
        self._cfg = cfg
        self._loop = loop
        self._on_state = on_state
        self._topics = RequestTopics(cfg.request_topic_prefix)
        #: Acks are matched by the prefix; the rest keeps replicas apart.
        self.clientid = clientid or f"{cfg.mqtt_clientid_prefix}{socket.gethostname()}-{os.getpid()}"
        url = urlsplit(cfg.mqtt_url)
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or (8883 if url.scheme == "mqtts" else 1883)
        self._connected = threading.Event()
        self._stopping = False
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.clientid,
            protocol=mqtt.MQTTv5,
        )
        if cfg.mqtt_username:
            client.username_pw_set(cfg.mqtt_username, cfg.mqtt_password or None)
        if url.scheme == "mqtts":
            context = ssl.create_default_context(cafile=cfg.mqtt_ca_file or None)
            client.tls_set_context(context)
        client.max_inflight_messages_set(cfg.mqtt_max_inflight)
        client.max_queued_messages_set(0)
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        self._client = client
        self._props: Properties | None = None
        if cfg.mqtt_message_expiry_s:
            self._props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            self._props.MessageExpiryInterval = cfg.mqtt_message_expiry_s

    def start(self) -> None:
        """Connect in the background; paho retries with backoff until the broker answers."""
        self._client.connect_async(self._host, self._port, keepalive=self._cfg.mqtt_keepalive_s, clean_start=True)
        self._client.loop_start()
        log.info("mqtt_connecting", host=self._host, port=self._port, clientid=self.clientid)

    def stop(self) -> None:
        """Disconnect cleanly and stop paho's thread."""
        self._stopping = True
        self._client.disconnect()
        self._client.loop_stop()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def publish(self, vin: str, request_id: str, payload: bytes) -> bool:
        """Queue one QoS 1 delivery; False (nothing queued) while disconnected."""
        if not self._connected.is_set():
            return False
        info = self._client.publish(self._topics.delivery(vin, request_id), payload, qos=1, properties=self._props)
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    # -- paho thread ---------------------------------------------------------------
    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.error("mqtt_connect_refused", reason=str(reason))
            return
        self._connected.set()
        log.info("mqtt_connected", host=self._host, port=self._port, clientid=self.clientid)
        self._notify(True)

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        was = self._connected.is_set()
        self._connected.clear()
        if was:
            if self._stopping:
                log.info("mqtt_disconnected", reason="shutdown")
            else:
                log.warning("mqtt_disconnected", reason=str(reason))
            self._notify(False)

    def _notify(self, up: bool) -> None:
        # RuntimeError: the event loop is already closed, we are shutting down.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_state, up)
