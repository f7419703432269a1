"""The ExHook port's gRPC health per service name (exhook_server/health.py), on real parts: ""
and the hook services say whether batches can be stored now (PostgreSQL down past
store_down_grace_s: NOT_SERVING), sdv_fanout.Delivery whether the broker link is up,
sdv_fanout.Process that the process serves (what liveness asks: it stays SERVING)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from exhook_server import hooks
from exhook_server.health import DELIVERY_SERVICE, PROCESS_SERVICE
from testkit.emqx_sim import Mosquitto, free_port
from testkit.harness import InProcessServer, poll
from testkit.pg_cluster import PgCluster, find_bindir

STORE = ("", *hooks.SERVICE_NAMES)


@pytest.fixture
def health_of() -> Iterator[Callable[[InProcessServer], Callable[[str], str]]]:
    """health_of(server)(service): the status name the server's port answers for `service`."""
    channels: list[grpc.Channel] = []

    def of(server: InProcessServer) -> Callable[[str], str]:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        channels.append(channel)
        stub = health_pb2_grpc.HealthStub(channel)

        def check(service: str) -> str:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            except grpc.RpcError as exc:
                return f"rpc {exc.code().name}"
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

        return check

    yield of
    for channel in channels:
        channel.close()


def test_store_only_server_stores_but_does_not_deliver(make_server: Any, health_of: Any) -> None:
    """mqtt_url = "": the store is open (every store service SERVING), nothing is delivered
    (Delivery NOT_SERVING), the process serves."""
    check = health_of(make_server(mqtt_url=""))
    assert {s: check(s) for s in STORE} == dict.fromkeys(STORE, "SERVING")
    assert check(DELIVERY_SERVICE) == "NOT_SERVING"
    assert check(PROCESS_SERVICE) == "SERVING"


def test_delivery_follows_the_broker_link(make_server: Any, health_of: Any, tmp_path: Path) -> None:
    """Unreachable broker: NOT_SERVING; once it runs: SERVING; stopped: NOT_SERVING, while the
    store's services stay SERVING throughout."""
    broker = Mosquitto(tmp_path / "broker", verbose=False)
    check = health_of(make_server(mqtt_url=broker.url))
    try:
        assert check(DELIVERY_SERVICE) == "NOT_SERVING"
        broker.start()
        poll(lambda: check(DELIVERY_SERVICE) == "SERVING", timeout_s=30)
        broker.stop()
        poll(lambda: check(DELIVERY_SERVICE) == "NOT_SERVING", timeout_s=30)
        assert {s: check(s) for s in (*STORE, PROCESS_SERVICE)} == dict.fromkeys((*STORE, PROCESS_SERVICE), "SERVING")
    finally:
        broker.stop()


def test_delivery_is_not_serving_with_nobody_at_mqtt_url(make_server: Any, health_of: Any) -> None:
    check = health_of(make_server(mqtt_url=f"mqtt://127.0.0.1:{free_port()}"))
    assert (check(""), check(DELIVERY_SERVICE)) == ("SERVING", "NOT_SERVING")


def test_a_postgresql_outage_past_the_grace_turns_the_store_services_not_serving(
    make_server: Any, health_of: Any
) -> None:
    """The database killed: "" and the hook services NOT_SERVING (after store_down_grace_s), the
    process itself still SERVING (liveness must not restart pods for it)."""
    if find_bindir() is None:
        pytest.skip("no PostgreSQL binaries")
    with PgCluster.create(name="health") as cluster:
        check = health_of(make_server(store_url=cluster.new_database("health"), store_down_grace_s=0.5))
        assert check("") == "SERVING"
        cluster.kill()
        poll(lambda: {check(s) for s in STORE} == {"NOT_SERVING"}, timeout_s=30)
        assert check(PROCESS_SERVICE) == "SERVING"
