"""The operator's view: the real `sdv-fanout` process, grpcurl through reflection, stats and inspect."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import BIN, ExHookClient, SubprocessServer

GRPCURL = str(BIN / "grpcurl")


@pytest.fixture(scope="module")
def proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    srv = SubprocessServer(tmp_path_factory.mktemp("cli") / "lmdb")
    try:
        yield srv
    finally:
        srv.terminate()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def grpcurl(port: int, *args: str) -> str:
    out = run(GRPCURL, "-plaintext", *args[:-1], f"127.0.0.1:{port}", *args[-1:])
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_grpcurl_lists_both_exhook_services(proc: SubprocessServer) -> None:
    """Reflection shows v2, v3, health and reflection itself."""
    listed = run(GRPCURL, "-plaintext", f"127.0.0.1:{proc.port}", "list").stdout.split()
    assert {"emqx.exhook.v2.HookProvider", "emqx.exhook.v3.HookProvider", "grpc.health.v1.Health"} <= set(listed)


@pytest.mark.parametrize("package", ["v2", "v3"])
def test_grpcurl_describes_every_rpc(proc: SubprocessServer, package: str) -> None:
    """`describe` shows all 21 RPCs of each service, and the bytes-typed password field."""
    text = run(
        GRPCURL, "-plaintext", f"127.0.0.1:{proc.port}", "describe", f"emqx.exhook.{package}.HookProvider"
    ).stdout
    assert text.count("rpc On") == 21
    field = run(GRPCURL, "-plaintext", f"127.0.0.1:{proc.port}", "describe", f"emqx.exhook.{package}.ClientInfo").stdout
    assert "bytes password = 4;" in field


def test_grpcurl_health_is_serving(proc: SubprocessServer) -> None:
    """The standard gRPC health check answers SERVING, overall and per service."""
    for service in ("", "emqx.exhook.v3.HookProvider"):
        out = grpcurl(proc.port, "-d", json.dumps({"service": service}), "grpc.health.v1.Health/Check")
        assert json.loads(out)["status"] == "SERVING"


def test_grpcurl_can_send_a_batch(proc: SubprocessServer) -> None:
    """An operator can ingest a batch by hand with grpcurl, and `inspect` shows it."""
    import base64

    payload = base64.b64encode(
        json.dumps({"ids": ["GRPCURL1"], "request_id": "task_manual_1", "data": "hi"}).encode()
    ).decode()
    req = {"message": {"topic": "$SDV-FANOUT", "qos": 1, "payload": payload, "from": "ops"}}
    out = json.loads(grpcurl(proc.port, "-d", json.dumps(req), "emqx.exhook.v2.HookProvider/OnMessagePublish"))
    assert out["type"] == "STOP_AND_RETURN" and out["message"]["headers"] == {"allow_publish": "false"}
    shown = json.loads(
        run(str(BIN / "sdv-fanout"), "inspect", "GRPCURL1", "--data-dir", str(proc.data_dir), "--json").stdout
    )
    assert [p["request_id"] for p in shown["pending"]] == ["task_manual_1"]


def test_stats_and_inspect_read_a_running_server(proc: SubprocessServer) -> None:
    """stats and inspect open the live store read-only from another process."""
    c = ExHookClient(proc.port)
    c.batch(["STATS1", "STATS2"], "task_ota_1", "shared")
    c.batch(["STATS1"], "task_ota_2", "shared")
    c.close()
    out = run(str(BIN / "sdv-fanout"), "stats", "--data-dir", str(proc.data_dir), "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["rows"] >= 3 and stats["blobs"] >= 1 and stats["early_triggers"] == 0
    shown = json.loads(
        run(str(BIN / "sdv-fanout"), "inspect", "STATS1", "--data-dir", str(proc.data_dir), "--json").stdout
    )
    assert [p["request_id"] for p in shown["pending"]] == ["task_ota_1", "task_ota_2"]
    human = run(str(BIN / "sdv-fanout"), "inspect", "STATS1", "--data-dir", str(proc.data_dir)).stdout
    assert "2 pending" in human


def test_json_logs_are_one_object_per_line(proc: SubprocessServer) -> None:
    """With --log-format json every log line parses as JSON with an event name."""
    events = list(proc.events())
    assert any(e["event"] == "server_started" for e in events)
    assert all("event" in e and "level" in e for e in events)


def test_check_config_shows_environment(tmp_path: Path) -> None:
    """check-config prints the settings in force, environment included; bad ones exit 2."""
    out = subprocess.run(
        [str(BIN / "sdv-fanout"), "check-config"],
        capture_output=True,
        text=True,
        env={"SDV_FANOUT_MAX_IDS_PER_BATCH": "77", "PATH": ""},
        timeout=60,
    )
    assert "max_ids_per_batch = 77" in out.stdout
    bad = subprocess.run(
        [str(BIN / "sdv-fanout"), "check-config"],
        capture_output=True,
        text=True,
        env={"SDV_FANOUT_LISTEN": "x"},
        timeout=60,
    )
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


def test_sigterm_stops_cleanly(tmp_path: Path) -> None:
    """SIGTERM ends the server with exit code 0 after logging server_stopped."""
    srv = SubprocessServer(tmp_path / "lmdb")
    assert srv.terminate() == 0
    assert any(e["event"] == "server_stopped" for e in srv.events())


def test_metrics_show_real_traffic(proc: SubprocessServer) -> None:
    """/metrics exposes hook calls, latency, stored batches and rejections after real calls."""
    import urllib.request

    c = ExHookClient(proc.port)
    c.batch(["METRIC1"], "task_m_1", "x")
    c.publish("$SDV-FANOUT", b"not json")
    c.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'sdv_fanout_hook_calls_total{hook="OnMessagePublish",outcome="stored"}' in text
    assert 'sdv_fanout_batches_rejected_total{reason="invalid_json"} 1.0' in text
    assert 'sdv_fanout_hook_seconds_count{hook="OnMessagePublish"}' in text
    assert "sdv_fanout_rows_stored_total" in text and "sdv_fanout_lmdb_map_usage_ratio" in text


def test_admin_api_through_grpcurl(proc: SubprocessServer) -> None:
    """Admin GetStats, GetVehicle, ListOnline, TriggerGC and Requeue answer through grpcurl."""
    from exhook_server._proto import exhook_v3_pb2 as pb

    c = ExHookClient(proc.port)
    c.batch(["ADMIN1", "ADMIN2"], "task_adm_1", "x")
    info = pb.ClientInfo(node="emqx@127.0.0.1", clientid="ADMIN1", peerhost="127.0.0.1", peerport=50001)
    c.call("OnSessionSubscribed", pb.SessionSubscribedRequest(clientinfo=info, topic="agent/ADMIN1/proxy/request/+"))
    c.close()
    stats = json.loads(grpcurl(proc.port, "-d", "{}", "sdv.fanout.v1.Admin/GetStats"))
    assert int(stats["rows"]) >= 2 and stats["schema_version"] == 1
    vehicle = json.loads(grpcurl(proc.port, "-d", '{"vin": "ADMIN1"}', "sdv.fanout.v1.Admin/GetVehicle"))
    assert vehicle["online"] is True and vehicle["session"]["peerport"] == 50001
    assert [p["request_id"] for p in vehicle["pending"]] == ["task_adm_1"]
    online = json.loads(grpcurl(proc.port, "-d", '{"page_size": 1}', "sdv.fanout.v1.Admin/ListOnline"))
    assert online["vins"] == ["ADMIN1"] and online["total"] == "1"
    report = json.loads(grpcurl(proc.port, "-d", '{"dry_run": true}', "sdv.fanout.v1.Admin/TriggerGC"))
    assert report["dry_run"] is True
    requeued = json.loads(grpcurl(proc.port, "-d", '{"vin": "ADMIN1"}', "sdv.fanout.v1.Admin/Requeue"))
    assert requeued["online"] is True
    shown = run(str(BIN / "sdv-fanout"), "inspect", "ADMIN1", "--server", f"127.0.0.1:{proc.port}", "--json")
    assert json.loads(shown.stdout)["online"] is True
    stats_cli = run(str(BIN / "sdv-fanout"), "stats", "--server", f"127.0.0.1:{proc.port}", "--json")
    assert int(json.loads(stats_cli.stdout)["rows"]) >= 2


def test_port_in_use_is_a_clear_error(proc: SubprocessServer, tmp_path: Path) -> None:
    """A second server on a taken port exits 2 with a one-line reason, not a traceback."""
    out = subprocess.run(
        [str(BIN / "sdv-fanout"), "serve", "--listen", f"127.0.0.1:{proc.port}", "--data-dir", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SDV_FANOUT_METRICS_LISTEN": "", "SDV_FANOUT_MQTT_URL": ""},
    )
    assert out.returncode == 2 and "cannot listen" in out.stderr
    assert "Traceback" not in out.stderr
