"""Our paho clients close the socket of a TLS handshake that fails (paho leaves it to the GC)."""

from __future__ import annotations

import gc
import socket
import ssl
import threading
import warnings
from collections.abc import Iterator

import pytest
from paho.mqtt.enums import CallbackAPIVersion

from exhook_server import paho_tls


@pytest.fixture
def resetting_listener() -> Iterator[int]:
    """A loopback port that accepts TCP and closes at once: every TLS handshake fails."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def handshake_fails(client_class: type, port: int) -> list[warnings.WarningMessage]:
    """Connect a TLS client to `port` three times; the ResourceWarnings collected afterwards."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(3):
            client = client_class(CallbackAPIVersion.VERSION2, client_id="tls-probe")
            client.tls_set_context(ssl.create_default_context())
            with pytest.raises((OSError, ssl.SSLError)):
                client.connect("127.0.0.1", port)
            client._reset_sockets()
            del client
        gc.collect()
    return [w for w in seen if issubclass(w.category, ResourceWarning)]


def test_a_failed_handshake_leaves_no_socket_behind(resetting_listener: int) -> None:
    assert handshake_fails(paho_tls.Client, resetting_listener) == []


def test_plain_paho_leaks_it(resetting_listener: int) -> None:
    """The defect this class exists for, shown on paho itself: if paho fixes it, drop the class."""
    import paho.mqtt.client as mqtt

    assert handshake_fails(mqtt.Client, resetting_listener), "paho closes it now: paho_tls.Client can go"
