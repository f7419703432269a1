"""Our paho MQTT clients' common part: a client whose failed TLS handshake closes its socket,
and the broker address and credentials from the settings.

paho wraps the TCP socket and runs the handshake inside ``connect``/``reconnect``; when the
handshake fails (broker gone, reset, certificate refused) the wrapped socket is left to the
garbage collector. Every reconnect attempt against an unhealthy TLS broker then leaks one
descriptor until a collection. Our clients inherit this class instead of ``mqtt.Client``.
"""

from __future__ import annotations

import socket
import ssl
from typing import NamedTuple
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt

from exhook_server.config import Config


class Client(mqtt.Client):
    """``mqtt.Client`` with a handshake that never leaks its socket."""

    def _ssl_wrap_socket(self, tcp_sock: socket.socket) -> ssl.SSLSocket:
        context = self._ssl_context
        if context is None or not context.check_hostname:  # not our contexts: paho's own path
            return super()._ssl_wrap_socket(tcp_sock)
        try:
            ssl_sock = context.wrap_socket(tcp_sock, server_hostname=self._host, do_handshake_on_connect=False)
        except BaseException:
            tcp_sock.close()
            raise
        try:
            ssl_sock.settimeout(self._connect_timeout)
            ssl_sock.do_handshake()  # the context checks the host name
        except BaseException:
            ssl_sock.close()
            raise
        return ssl_sock


class Broker(NamedTuple):
    """Where `mqtt_url` points: host, port (the scheme's default when absent) and whether TLS."""

    host: str
    port: int
    tls: bool


def broker(cfg: Config) -> Broker:
    """The broker of `cfg.mqtt_url` (mqtt:// or mqtts://)."""
    url = urlsplit(cfg.mqtt_url)
    tls = url.scheme == "mqtts"
    return Broker(url.hostname or "127.0.0.1", url.port or (8883 if tls else 1883), tls)


def authenticate(client: mqtt.Client, cfg: Config, tls: bool) -> None:
    """Give `client` our username and password, and with `tls` a context trusting `mqtt_ca_file`
    (else the system's store) that checks the broker's host name."""
    if cfg.mqtt_username:
        client.username_pw_set(cfg.mqtt_username, cfg.mqtt_password or None)
    if tls:
        client.tls_set_context(ssl.create_default_context(cafile=cfg.mqtt_ca_file or None))
