"""Several server processes on one port and one LMDB environment (`processes` > 1).

Every test runs the real `sdv-fanout serve` with SDV_FANOUT_PROCESSES=2 and talks to it over
separate gRPC connections, which the kernel spreads over the processes (SO_REUSEPORT).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from storage.lmdb.store import Store
from testkit.emqx_sim import FakeEmqx, Mosquitto
from testkit.harness import ExHookClient, SubprocessServer, alive, poll

pytestmark = pytest.mark.slow

GROUP = {"SDV_FANOUT_PROCESSES": "2"}
#: With this many connections, all of them landing on one of two processes has odds 2**-15.
CONNECTIONS = 16


def metric(srv: SubprocessServer, name: str) -> float:
    """A counter summed over the group, from the parent's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def rows(data_dir: Path) -> int:
    with Store(data_dir, readonly=True) as store:
        return store.row_count()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SubprocessServer]:
    srv = SubprocessServer(tmp_path / "lmdb", env=GROUP)
    yield srv
    if srv.proc.poll() is None:
        assert srv.terminate() == 0
    else:
        srv.kill()  # already gone: only reaps and closes its log


def test_every_process_ingests_and_all_batches_land_in_one_store(group: SubprocessServer, tmp_path: Path) -> None:
    """Batches over many connections are stored by both processes into the one shared environment."""
    assert len(group.pids) == 2
    clients = [ExHookClient(group.port) for _ in range(CONNECTIONS)]
    try:
        with ThreadPoolExecutor(CONNECTIONS) as pool:
            answers = list(
                pool.map(
                    lambda i: clients[i % CONNECTIONS].batch([f"VIN{i:03d}", "SHARED"], f"task_mp_{i}", f"p{i % 3}"),
                    range(64),
                )
            )
    finally:
        for c in clients:
            c.close()
    assert all(a.type == a.STOP_AND_RETURN for a in answers)
    assert rows(tmp_path / "lmdb") == 128
    stored_by = {e.get("process") for e in group.events() if e.get("event") == "batch_stored"}
    assert stored_by == {0, 1}
    assert metric(group, "sdv_fanout_rows_stored_total") == 128


def test_vehicles_get_deliveries_whichever_process_owns_them(tmp_path: Path) -> None:
    """Hooks reaching a process that does not own the VIN are forwarded; every row is delivered and acked."""
    with Mosquitto(tmp_path).start() as broker:
        srv = SubprocessServer(tmp_path / "lmdb", env={**GROUP, "SDV_FANOUT_MQTT_URL": broker.url})
        try:
            # One EMQX channel: all hooks reach one process, which owns only part of the VINs.
            emqx = FakeEmqx(srv.port, broker.port)
            emqx.load()
            vins = [f"LSVMP{n:012d}" for n in range(60)]
            fleet = [emqx.vehicle(vin) for vin in vins]
            for v in fleet:
                v.connect()
                v.subscribe()
            for n in range(3):
                emqx.publish_batch(vins, f"task_mp_{n}", f"payload {n}")
            poll(lambda: all(len(v.received) >= 3 for v in fleet), timeout_s=60)
            poll(lambda: rows(tmp_path / "lmdb") == 0, timeout_s=30)
            for v in fleet:
                assert [r.topic.rsplit("/", 1)[1] for r in v.received] == ["task_mp_0", "task_mp_1", "task_mp_2"]
            assert metric(srv, "sdv_fanout_dispatch_forwarded_total") > 0
            # The Admin API answers for the whole group, whichever process takes the call.
            for _ in range(4):
                admin = ExHookClient(srv.admin_port)
                try:
                    stats = _admin(admin, "GetStats", {})
                    vehicle = _admin(admin, "GetVehicle", {"vin": vins[7]})
                finally:
                    admin.close()
                assert int(stats["online_vehicles"]) == 60
                assert vehicle["online"] is True
            emqx.close()
        finally:
            srv.terminate()


def test_a_policy_is_in_force_in_every_process_when_its_publish_is_answered(tmp_path: Path) -> None:
    """A paused policy set through one process holds the rows of a batch published right after it
    in the other process too (it delivers the VINs it owns), with no policy reload to help
    (policy_refresh_s 3,600): each vehicle gets the newer free request first; the resume reaches
    every process the same way and the held request follows."""
    with Mosquitto(tmp_path).start() as broker:
        env = {**GROUP, "SDV_FANOUT_MQTT_URL": broker.url, "SDV_FANOUT_POLICY_REFRESH_S": "3600"}
        srv = SubprocessServer(tmp_path / "lmdb", env=env)
        try:
            # One EMQX channel: every hook reaches one process; the other owns part of the VINs.
            emqx = FakeEmqx(srv.port, broker.port)
            emqx.load()
            vins = [f"LSVPO{n:012d}" for n in range(16)]
            fleet = [emqx.vehicle(vin) for vin in vins]
            for v in fleet:
                v.connect()
                v.subscribe()

            def policy(**fields: object) -> None:
                body = json.dumps({"request_id": "task_held_1", **fields}).encode()
                reply = emqx.publish("$SDV-FANOUT/policy", body)
                assert reply is not None and reply.message.headers["allow_publish"] == "false"

            policy(paused=True)
            emqx.publish_batch(vins, "task_held_1", "held")
            emqx.publish_batch(vins, "task_free_1", "free")
            poll(lambda: all(len(v.received) >= 1 for v in fleet), timeout_s=60)
            assert metric(srv, "sdv_fanout_dispatch_forwarded_total") > 0
            policy()  # cleared: resumed
            poll(lambda: all(len(v.received) >= 2 for v in fleet), timeout_s=60)
            for v in fleet:
                assert [r.topic.rsplit("/", 1)[1] for r in v.received] == ["task_free_1", "task_held_1"], v.clientid
            emqx.close()
        finally:
            srv.terminate()


def test_admin_answers_on_the_admin_port_only(group: SubprocessServer) -> None:
    """Every connection to the group's admin port is answered; every one to the ExHook port gets UNIMPLEMENTED."""
    import grpc

    assert group.admin_port and group.admin_port != group.port
    for _ in range(CONNECTIONS):  # separate connections: the kernel spreads them over both processes
        admin, exhook = ExHookClient(group.admin_port), ExHookClient(group.port)
        try:
            assert int(_admin(admin, "GetStats", {})["schema_version"]) >= 1
            with pytest.raises(grpc.RpcError) as refused:
                _admin(exhook, "GetStats", {})
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            admin.close()
            exhook.close()
    [started] = [e for e in group.events() if e.get("event") == "server_group_started"]
    assert started["admin"] == f"127.0.0.1:{group.admin_port}"


def _admin(client: ExHookClient, method: str, request: dict[str, object]) -> dict[str, object]:
    from google.protobuf import json_format

    from exhook_server._proto import admin_pb2

    req = getattr(admin_pb2, f"{method}Request")()
    json_format.ParseDict(request, req)
    response_cls = {"GetStats": admin_pb2.Stats, "GetVehicle": admin_pb2.Vehicle}[method]
    stub = client.channel.unary_unary(
        f"/sdv.fanout.v1.Admin/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_cls.FromString,
    )
    return json.loads(
        json_format.MessageToJson(
            stub(req, timeout=10), always_print_fields_with_no_presence=True, preserving_proto_field_name=True
        )
    )  # type: ignore[no-any-return]


def test_a_dead_server_process_stops_the_group(group: SubprocessServer) -> None:
    """kill -9 of one process: the parent stops the other and exits 1, so the pod restarts whole."""
    victim, other = group.pids
    os.kill(victim, signal.SIGKILL)
    assert group.proc.wait(30) == 1
    poll(lambda: not alive(other))
    died = [e for e in group.events() if e.get("event") == "server_process_died"]
    assert died and died[0]["pid"] == victim


def test_map_grows_while_two_processes_write(tmp_path: Path) -> None:
    """A map grown by one process is adopted by the other; no batch fails."""
    srv = SubprocessServer(tmp_path / "lmdb", env={**GROUP, "SDV_FANOUT_MAP_SIZE_BYTES": str(256 << 10)})
    clients = [ExHookClient(srv.port) for _ in range(CONNECTIONS)]
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(
                    lambda i: clients[i % CONNECTIONS].batch([f"VIN{i}"], f"task_big_{i}", os.urandom(48 << 10)),
                    range(48),
                )
            )
        assert all(a.type == a.STOP_AND_RETURN for a in answers)
        assert any(e.get("event") == "lmdb_map_grown" for e in srv.events())
    finally:
        for c in clients:
            c.close()
        assert srv.terminate() == 0
    with Store(tmp_path / "lmdb", readonly=True) as store:
        stats = store.stats()
    assert (stats.rows, stats.blobs) == (48, 48)
    assert stats.map_size_bytes > 256 << 10


def test_a_taken_metrics_port_stops_the_group_cleanly(tmp_path: Path) -> None:
    """A taken metrics_listen is found before any child starts: exit 2 naming it, nothing left
    holding the data dir (tests/integration/test_startup_errors.py covers every listener)."""
    import socket
    import subprocess

    from testkit.harness import BIN

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run(
            [str(BIN / "sdv-fanout"), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "lmdb")],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                **GROUP,
                "SDV_FANOUT_MQTT_URL": "",
                "SDV_FANOUT_ADMIN_LISTEN": "127.0.0.1:0",
                "SDV_FANOUT_METRICS_LISTEN": f"127.0.0.1:{taken.getsockname()[1]}",
            },
        )
    assert out.returncode == 2 and "metrics_listen" in out.stderr
    # The children held the data dir's lock too: a new server can take it only once they are gone.
    srv = SubprocessServer(tmp_path / "lmdb", env=GROUP)
    assert srv.terminate() == 0
