"""The operator's view: the real `sdv-fanout` process, grpcurl through reflection, stats and inspect."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.lmdb.store import SCHEMA_VERSION
from testkit.harness import BIN, ExHookClient, SubprocessServer

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
    """Admin GetStats, GetVehicle, ListOnline, TriggerGC and Requeue answer through grpcurl on the admin port."""
    from exhook_server._proto import exhook_v3_pb2 as pb

    c = ExHookClient(proc.port)
    c.batch(["ADMIN1", "ADMIN2"], "task_adm_1", "x")
    info = pb.ClientInfo(node="emqx@127.0.0.1", clientid="ADMIN1", peerhost="127.0.0.1", peerport=50001)
    c.call("OnSessionSubscribed", pb.SessionSubscribedRequest(clientinfo=info, topic="agent/ADMIN1/proxy/request/+"))
    c.close()
    admin = proc.admin_port
    stats = json.loads(grpcurl(admin, "-d", "{}", "sdv.fanout.v1.Admin/GetStats"))
    assert int(stats["rows"]) >= 2 and stats["schema_version"] == SCHEMA_VERSION
    vehicle = json.loads(grpcurl(admin, "-d", '{"vin": "ADMIN1"}', "sdv.fanout.v1.Admin/GetVehicle"))
    assert vehicle["online"] is True and vehicle["session"]["peerport"] == 50001
    assert [p["request_id"] for p in vehicle["pending"]] == ["task_adm_1"]
    online = json.loads(grpcurl(admin, "-d", '{"page_size": 1}', "sdv.fanout.v1.Admin/ListOnline"))
    assert online["vins"] == ["ADMIN1"] and online["total"] == "1"
    report = json.loads(grpcurl(admin, "-d", '{"dry_run": true}', "sdv.fanout.v1.Admin/TriggerGC"))
    assert report["dry_run"] is True
    requeued = json.loads(grpcurl(admin, "-d", '{"vin": "ADMIN1"}', "sdv.fanout.v1.Admin/Requeue"))
    assert requeued["online"] is True


def test_exhook_port_refuses_admin_and_admin_port_refuses_exhook(proc: SubprocessServer) -> None:
    """Admin on the ExHook port is UNIMPLEMENTED (and not listed); the admin port lists only Admin."""
    refused = run(GRPCURL, "-plaintext", "-d", "{}", f"127.0.0.1:{proc.port}", "sdv.fanout.v1.Admin/GetStats")
    assert refused.returncode != 0 and "Unimplemented" in refused.stderr, refused.stderr
    on_exhook = set(run(GRPCURL, "-plaintext", f"127.0.0.1:{proc.port}", "list").stdout.split())
    on_admin = set(run(GRPCURL, "-plaintext", f"127.0.0.1:{proc.admin_port}", "list").stdout.split())
    assert "sdv.fanout.v1.Admin" not in on_exhook and "emqx.exhook.v3.HookProvider" in on_exhook
    assert on_admin == {"sdv.fanout.v1.Admin", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    health = json.loads(
        grpcurl(proc.admin_port, "-d", '{"service": "sdv.fanout.v1.Admin"}', "grpc.health.v1.Health/Check")
    )
    assert health["status"] == "SERVING"
    hook = run(
        GRPCURL,
        "-plaintext",
        "-d",
        "{}",
        f"127.0.0.1:{proc.admin_port}",
        "emqx.exhook.v3.HookProvider/OnProviderLoaded",
    )
    assert hook.returncode != 0 and "Unimplemented" in hook.stderr, hook.stderr


def test_cli_server_follows_the_admin_listener(proc: SubprocessServer) -> None:
    """stats/inspect --server ask the admin port: by address, or by admin_listen from the environment."""
    c = ExHookClient(proc.port)
    c.batch(["CLISRV1"], "task_cli_1", "x")
    c.close()
    shown = run(str(BIN / "sdv-fanout"), "inspect", "CLISRV1", "--server", f"127.0.0.1:{proc.admin_port}", "--json")
    assert [p["request_id"] for p in json.loads(shown.stdout)["pending"]] == ["task_cli_1"], shown.stderr
    configured = subprocess.run(
        [str(BIN / "sdv-fanout"), "stats", "--server", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SDV_FANOUT_ADMIN_LISTEN": f"0.0.0.0:{proc.admin_port}"},
    )
    assert configured.returncode == 0, configured.stderr
    assert int(json.loads(configured.stdout)["rows"]) >= 1
    wrong = run(str(BIN / "sdv-fanout"), "stats", "--server", f"127.0.0.1:{proc.port}", "--json")
    assert wrong.returncode == 2 and "UNIMPLEMENTED" in wrong.stderr


def test_serve_takes_mqtt_url_and_metrics_listen_flags(tmp_path: Path) -> None:
    """--mqtt-url and --metrics-listen reach the server and beat their environment variables."""
    srv = SubprocessServer(
        tmp_path / "lmdb",
        "--mqtt-url",
        "",
        "--metrics-listen",
        "127.0.0.1:0",
        env={"SDV_FANOUT_MQTT_URL": "mqtt://127.0.0.1:1", "SDV_FANOUT_METRICS_LISTEN": ""},
    )
    try:
        assert srv.metrics_port
        assert any(e["event"] == "delivery_disabled" for e in srv.events())
    finally:
        assert srv.terminate() == 0


def test_cancel_through_grpcurl_and_the_cli(proc: SubprocessServer, tmp_path: Path) -> None:
    """Admin Cancel (grpcurl) and `sdv-fanout cancel --server` end pending rows `cancelled`, for some
    vehicles or every one; `request` then counts them; a bad request id is refused with its reason;
    offline, `cancel` works on a stopped server's data dir."""
    c = ExHookClient(proc.port)
    c.batch(["CAN1", "CAN2", "CAN3"], "task_can_1", "x")
    c.batch(["CAN1", "CAN2"], "task_can_2", "y")
    c.close()
    some = json.loads(
        grpcurl(proc.admin_port, "-d", '{"request_id": "task_can_1", "vins": ["CAN1"]}', "sdv.fanout.v1.Admin/Cancel")
    )
    assert some == {"cancelled": "1"}  # in_flight 0 is the default, left out by grpcurl
    sdv = str(BIN / "sdv-fanout")
    every = run(sdv, "cancel", "task_can_1", "--server", f"127.0.0.1:{proc.admin_port}", "--json")
    assert json.loads(every.stdout) == {"request_id": "task_can_1", "cancelled": 2, "in_flight": 0}, every.stderr
    shown = run(sdv, "request", "task_can_1", "--server", f"127.0.0.1:{proc.admin_port}", "--json")
    [gen] = json.loads(shown.stdout)["generations"]
    assert gen["counts"]["cancelled"] == 3 and gen["counts"]["pending"] == 0
    refused = run(sdv, "cancel", "task/x", "--server", f"127.0.0.1:{proc.admin_port}")
    assert refused.returncode == 2 and "bad_request_id" in refused.stderr
    # Offline, on a store no server runs on.
    data_dir = tmp_path / "offline"
    offline = SubprocessServer(data_dir)
    c = ExHookClient(offline.port)
    c.batch(["OFF1", "OFF2"], "task_off_1", "z")
    c.close()
    offline.terminate()
    env = {**os.environ, "SDV_FANOUT_DATA_DIR": str(data_dir)}
    done = subprocess.run([sdv, "cancel", "task_off_1", "--vin", "OFF2"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "1 pending row(s) cancelled" in done.stdout, done.stderr
    inspect = subprocess.run([sdv, "inspect", "OFF2", "--json"], capture_output=True, text=True, env=env)
    assert [o["outcome"] for o in json.loads(inspect.stdout)["outcomes"]] == ["cancelled"]


def cli_out(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`sdv-fanout argv` in this process: exit code, stdout, stderr."""
    from exhook_server import cli

    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_server_prints_the_offline_table_plus_what_only_the_server_knows(
    proc: SubprocessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect --server` prints the table offline `inspect` prints (not protobuf JSON), after a
    line of presence; `--json` is the offline document plus online, session, in_flight, backlog."""
    c = ExHookClient(proc.port)
    c.batch(["INSP1"], "task_insp_1", "first")
    c.batch(["INSP1"], "task_insp_2", "second", expires_at="2999-01-01T00:00:00Z")
    c.close()
    server = ("--server", f"127.0.0.1:{proc.admin_port}")
    offline = cli_out(capsys, "inspect", "INSP1", "--data-dir", str(proc.data_dir))
    served = cli_out(capsys, "inspect", "INSP1", *server)
    assert offline[0] == served[0] == 0, (offline, served)
    assert offline[1].startswith("INSP1: 2 pending, in delivery order\n")
    assert served[1] == "INSP1: offline\n" + offline[1]
    offline_doc = json.loads(cli_out(capsys, "inspect", "INSP1", "--data-dir", str(proc.data_dir), "--json")[1])
    served_doc = json.loads(cli_out(capsys, "inspect", "INSP1", *server, "--json")[1])
    extra = {"online": False, "session": None, "in_flight": None, "backlog": 2, "at_backlog_bound": False}
    assert served_doc == {**offline_doc, **extra}
    assert [p["request_id"] for p in served_doc["pending"]] == ["task_insp_1", "task_insp_2"]


def test_an_unknown_request_id_exits_1_in_every_command(
    proc: SubprocessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`request` and `cancel`, offline and with --server: an id nothing was stored under is an
    answer (exit 1, one line), not "0 cancelled"; a known one still cancels (exit 0)."""
    offline = ("--data-dir", str(proc.data_dir))
    server = ("--server", f"127.0.0.1:{proc.admin_port}")
    for command in ("request", "cancel"):
        for where in (offline, server):
            code, out, err = cli_out(capsys, command, "task_never_sent", *where)
            assert (code, out) == (1, ""), (command, where, err)
            assert err == "sdv-fanout: no generation of request 'task_never_sent' is stored\n"
    c = ExHookClient(proc.port)
    c.batch(["UNK1"], "task_known_1", "x")
    c.close()
    assert cli_out(capsys, "cancel", "task_known_1", *server)[0] == 0
    assert cli_out(capsys, "cancel", "task_known_1", *server)[0] == 0  # known, nothing left: 0 cancelled
