"""A paho MQTT client whose failed TLS handshake closes its socket.

paho wraps the TCP socket and runs the handshake inside ``connect``/``reconnect``; when the
handshake fails (broker gone, reset, certificate refused) the wrapped socket is left to the
garbage collector. Every reconnect attempt against an unhealthy TLS broker then leaks one
descriptor until a collection. Our clients inherit this class instead of ``mqtt.Client``.
"""

from __future__ import annotations

import socket
import ssl

import paho.mqtt.client as mqtt


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
