"""Campaign policies end to end on both stores: set on policy_topic through the EMQX-faithful hook
driver (intercepted: allow_publish=false), heard on the status topic of a real mosquitto, read and
set through Admin GetPolicy/SetPolicy, and through `sdv-fanout policy` with and without --server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from exhook_server import cli
from exhook_server._proto import admin_pb2
from testkit.harness import admin_call, poll
from tests.integration.test_delivery_e2e import Rig, make_rig
from tests.integration.test_status_topic import Platform

TOPIC = "$SDV-FANOUT/policy"


@pytest.fixture(params=["lmdb", "postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every test here runs on both stores."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def rig(tmp_path: Path, make_server: Any) -> Iterator[tuple[Rig, Platform]]:
    gen = make_rig(tmp_path, make_server)
    rig = next(gen)
    platform = Platform(rig.broker.port)
    yield rig, platform
    platform.close()
    with pytest.raises(StopIteration):
        next(gen)


def admin(rig: Rig, method: str, request: Any) -> Any:
    assert rig.srv.server is not None
    return admin_call(rig.srv.server.admin_port, method, request)


def test_a_policy_on_its_topic_is_intercepted_stored_and_echoed(rig: tuple[Rig, Platform], capsys: Any) -> None:
    r, platform = rig
    doc = {"request_id": "task_ota_1", "max_per_minute": 600, "start_at": "2026-11-28T18:00:00Z"}
    reply = r.emqx.publish(TOPIC, json.dumps(doc).encode())
    assert reply is not None and reply.message.headers["allow_publish"] == "false"
    [event] = platform.wait(event="policy", request_id="task_ota_1")
    in_force = {"max_per_minute": 600, "start_at": 1_795_888_800_000}
    assert event["policy"] == in_force
    got = admin(r, "GetPolicy", admin_pb2.GetPolicyRequest(request_id="task_ota_1"))
    assert json.loads(got.policy) == in_force and got.set_ms > 0
    bad = {"request_id": "task_ota_1", "max_in_flight": -1}
    r.emqx.publish(TOPIC, json.dumps(bad).encode())
    [rejected] = platform.wait(event="rejected", request_id="task_ota_1")
    assert (rejected["of"], rejected["reason"], rejected["field"]) == ("policy", "bad_policy", "max_in_flight")
    # `sdv-fanout request R` shows the policy in force.
    r.emqx.publish_batch(["VIN9"], "task_ota_1", b"fw")
    poll(lambda: bool(r.srv.generations("task_ota_1")))
    assert r.srv.server is not None
    cfg = r.srv.server.cfg
    # Offline on PostgreSQL (an LMDB environment cannot be opened twice in one process).
    offline = [["--store-url", cfg.store_url]] if cfg.store_url else []
    for where in (["--server", f"127.0.0.1:{r.srv.server.admin_port}"], *offline):
        assert cli.main(["request", "task_ota_1", "--json", *where]) == 0
        assert json.loads(capsys.readouterr().out)["policy"] == in_force


def test_admin_and_cli_set_replace_and_clear_a_policy(rig: tuple[Rig, Platform], capsys: Any) -> None:
    r, platform = rig
    assert r.srv.server is not None
    set_reply = admin(r, "SetPolicy", admin_pb2.SetPolicyRequest(request_id="task_ota_2", policy='{"paused": true}'))
    assert json.loads(set_reply.policy) == {"paused": True}
    with pytest.raises(grpc.RpcError) as caught:
        admin(r, "SetPolicy", admin_pb2.SetPolicyRequest(request_id="task_ota_2", policy='{"priority": "urgent"}'))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad_policy" in str(caught.value.details())
    server = f"127.0.0.1:{r.srv.server.admin_port}"
    argv = ["policy", "task_ota_2", "--max-in-flight", "10", "--window", "0 2 * * *|3600|UTC", "--server", server]
    assert cli.main([*argv, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"] == {"max_in_flight": 10, "windows": [{"cron": "0 2 * * *", "duration_s": 3600, "tz": "UTC"}]}
    assert cli.main(["policy", "task_ota_2", "--clear", "--server", server]) == 0
    capsys.readouterr()
    with pytest.raises(grpc.RpcError) as caught:
        admin(r, "GetPolicy", admin_pb2.GetPolicyRequest(request_id="task_ota_2"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert cli.main(["policy", "task_ota_2", "--server", server]) == 1  # nothing in force
    poll(lambda: len(platform.events(event="policy", request_id="task_ota_2")) == 3)
    assert platform.events(event="policy", request_id="task_ota_2")[-1]["cleared"] is True
    assert cli.main(["policy", "task_ota_2", "--priority", "high", "--abort", "failed:2:10", "--server", server]) == 2
    assert "bad_policy" in capsys.readouterr().err


def test_policy_preview_forecasts_the_rows_of_vehicles_online_now(rig: tuple[Rig, Platform], capsys: Any) -> None:
    """`policy R --preview`: R's pending rows, those of vehicles online now, and when they will all
    have been sent under the policy (start_at, then 60 a minute), from the server and offline."""
    r, _ = rig
    assert r.srv.server is not None
    start_at = 4_000_000_000_000  # in 2096: nothing of R goes during the test
    admin(
        r,
        "SetPolicy",
        admin_pb2.SetPolicyRequest(
            request_id="task_ota_3", policy=json.dumps({"start_at": start_at, "max_per_minute": 60})
        ),
    )
    v = r.online("V1")
    poll(lambda: r.srv.run(r.srv.server.dispatcher.group_online()) == ["V1"])
    r.emqx.publish_batch(["V1", "V2", "V3"], "task_ota_3", "fw")
    poll(lambda: bool(r.srv.generations("task_ota_3")))
    cfg = r.srv.server.cfg
    offline = [["--store-url", cfg.store_url]] if cfg.store_url else []
    for where in (["--server", f"127.0.0.1:{r.srv.server.admin_port}"], *offline):
        assert cli.main(["policy", "task_ota_3", "--preview", "--json", *where]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["pending"], shown["online_now"], shown["completes_at_ms"]) == (3, 1, start_at + 1_000)
    admin(r, "SetPolicy", admin_pb2.SetPolicyRequest(request_id="task_ota_3", policy='{"paused": true}'))
    assert cli.main(["policy", "task_ota_3", "--preview", "--server", f"127.0.0.1:{r.srv.server.admin_port}"]) == 0
    assert "not all sent" in capsys.readouterr().out
    assert v.received == []
