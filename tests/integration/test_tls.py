"""TLS on both links: EMQX → our gRPC port (TLS and mutual TLS), and our delivery client → the broker."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.emqx_sim import Mosquitto, free_port
from testkit.harness import BIN, admin_stats, poll
from tests.certs import Pki, make_pki


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


def mutual_tls_server(make_server: Any, pki: Pki) -> Any:
    return make_server(
        tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key), tls_client_ca_file=str(pki.ca)
    )


def test_admin_listener_has_the_same_mutual_tls(make_server: Any, pki: Pki) -> None:
    """The admin port asks for the same client certificate as the ExHook port; plaintext gets nothing."""
    srv = mutual_tls_server(make_server, pki)
    target = f"127.0.0.1:{srv.server.admin_port}"
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pki.client_key.read_bytes(),
        certificate_chain=pki.client_cert.read_bytes(),
    )
    with grpc.secure_channel(target, with_cert) as ch:
        assert admin_stats(ch).schema_version >= 1
    without = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(target, without) as ch, pytest.raises(grpc.RpcError) as err:
        admin_stats(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError):
        admin_stats(ch)


def sdv_fanout(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it, with only these SDV_FANOUT_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SDV_FANOUT_")}
    return subprocess.run(
        [str(BIN / "sdv-fanout"), *args], capture_output=True, text=True, timeout=60, env={**clean, **env}
    )


def test_cli_server_reaches_a_mutual_tls_admin_listener(make_server: Any, pki: Pki) -> None:
    """stats/inspect --server present the cli_tls_* certificate; without one, or for another name, they fail."""
    srv = mutual_tls_server(make_server, pki)
    admin = f"127.0.0.1:{srv.server.admin_port}"
    client = ["--cli-tls-ca-file", str(pki.ca), "--cli-tls-cert-file", str(pki.client_cert)]
    client += ["--cli-tls-key-file", str(pki.client_key)]
    by_flags = sdv_fanout("stats", "--server", admin, *client, "--json")
    assert by_flags.returncode == 0, by_flags.stderr
    assert json.loads(by_flags.stdout)["schema_version"] >= 1
    # In the pod: the server's own settings (TLS on) and the CLI's, from the environment; no flags.
    pod = {
        "SDV_FANOUT_ADMIN_LISTEN": f"0.0.0.0:{srv.server.admin_port}",
        "SDV_FANOUT_TLS_CERT_FILE": str(pki.server_cert),
        "SDV_FANOUT_TLS_KEY_FILE": str(pki.server_key),
        "SDV_FANOUT_TLS_CLIENT_CA_FILE": str(pki.ca),
        "SDV_FANOUT_CLI_TLS_CA_FILE": str(pki.ca),
        "SDV_FANOUT_CLI_TLS_CERT_FILE": str(pki.client_cert),
        "SDV_FANOUT_CLI_TLS_KEY_FILE": str(pki.client_key),
    }
    in_pod = sdv_fanout("inspect", "TLSCLI1", "--server", "--json", **pod)
    assert in_pod.returncode == 0, in_pod.stderr
    assert json.loads(in_pod.stdout)["vin"] == "TLSCLI1" and json.loads(in_pod.stdout)["online"] is False
    no_cert = sdv_fanout("stats", "--server", admin, "--cli-tls-ca-file", str(pki.ca))
    assert no_cert.returncode == 2 and "UNAVAILABLE" in no_cert.stderr
    wrong_name = sdv_fanout("stats", "--server", admin, *client, "--cli-tls-server-name", "sdv-fanout.sdv.svc")
    assert wrong_name.returncode == 2 and "UNAVAILABLE" in wrong_name.stderr


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
