"""TLS on both links: EMQX → our gRPC port (TLS and mutual TLS), and our delivery client → the broker."""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import Any

import grpc
import pytest

from exhook_server._proto import exhook_v3_pb2 as pb
from tests.certs import Pki, make_pki
from tests.emqx_sim import Mosquitto, free_port
from tests.harness import poll


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


def loaded(channel: grpc.Channel) -> Any:
    stub = channel.unary_unary(
        "/emqx.exhook.v3.HookProvider/OnProviderLoaded",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.LoadedResponse.FromString,
    )
    return stub(pb.ProviderLoadedRequest(), timeout=10)


def test_tls_handshake(make_server: Any, pki: Pki) -> None:
    """With a server certificate, a client trusting the CA completes the handshake; plaintext is refused."""
    srv = make_server(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key))
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{srv.port}", creds) as ch:
        assert loaded(ch).hooks
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch, pytest.raises(grpc.RpcError):
        loaded(ch)


def test_mutual_tls_requires_a_client_certificate(make_server: Any, pki: Pki) -> None:
    """With a client CA configured, a client with a signed certificate gets in and one without is refused."""
    srv = make_server(
        tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key), tls_client_ca_file=str(pki.ca)
    )
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pki.client_key.read_bytes(),
        certificate_chain=pki.client_cert.read_bytes(),
    )
    with grpc.secure_channel(f"127.0.0.1:{srv.port}", with_cert) as ch:
        assert loaded(ch).hooks
    without = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{srv.port}", without) as ch, pytest.raises(grpc.RpcError) as err:
        loaded(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


class TlsMosquitto(Mosquitto):
    """mosquitto with one TLS listener (certificates from the test PKI)."""

    def __init__(self, tmp_dir: Path, pki: Pki) -> None:
        super().__init__(tmp_dir, free_port())
        self.pki = pki

    def _config(self) -> str:
        return (
            super()
            ._config()
            .replace(
                f"listener {self.port} 127.0.0.1",
                f"listener {self.port} 127.0.0.1\ncafile {self.pki.ca}\ncertfile {self.pki.server_cert}\n"
                f"keyfile {self.pki.server_key}\nrequire_certificate false\n"
                # As root, mosquitto drops to its own user before reading certificates, which then
                # cannot enter pytest's private tmp dir: keep the privileges of whoever runs the tests.
                f"user {getpass.getuser()}",
            )
        )


def test_delivery_over_mqtts(make_server: Any, pki: Pki, tmp_path: Path) -> None:
    """mqtts:// with our CA: the delivery client connects to a TLS broker with credentials."""
    broker = TlsMosquitto(tmp_path, pki)
    broker.start()
    try:
        srv = make_server(
            mqtt_url=f"mqtts://localhost:{broker.port}",
            mqtt_ca_file=str(pki.ca),
            mqtt_username="fanout",
            mqtt_password="secret",
        )
        delivery = srv.server.delivery
        poll(lambda: delivery.connected, timeout_s=20)
        assert "u'fanout'" in broker.log()  # connected over TLS, with our username
    finally:
        broker.stop()
