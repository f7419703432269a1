"""kill -9 mid-campaign keeps the policy: once SetPolicy has answered, a SIGKILLed `sdv-fanout
serve` restarted on the same data (an LMDB data dir, or a PostgreSQL database) has it in force,
and the offline `sdv-fanout policy` reads and writes the same store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from exhook_server import cli
from exhook_server._proto import admin_pb2
from testkit.harness import ExHookClient, SubprocessServer, admin_call

pytestmark = pytest.mark.slow


def test_a_policy_outlives_kill_9(tmp_path: Path, store_env: dict[str, str], capsys: Any) -> None:
    data_dir = tmp_path / "lmdb"
    env = {**store_env, "SDV_FANOUT_PROCESSES": "2"}
    policy = {"max_per_minute": 600, "max_in_flight": 20, "paused": True}
    srv = SubprocessServer(data_dir, env=env)
    try:
        set_reply = admin_call(
            srv.admin_port, "SetPolicy", admin_pb2.SetPolicyRequest(request_id="task_ota_1", policy=json.dumps(policy))
        )
        assert json.loads(set_reply.policy) == policy
    finally:
        srv.kill()
    again = SubprocessServer(data_dir, env=env)
    try:
        got = admin_call(again.admin_port, "GetPolicy", admin_pb2.GetPolicyRequest(request_id="task_ota_1"))
        assert json.loads(got.policy) == policy and got.set_ms == set_reply.set_ms
    finally:
        again.kill()
    # Offline, on the store the crash left: read it, replace it.
    store = ["--store-url", store_env["SDV_FANOUT_STORE_URL"]] if store_env else ["--data-dir", str(data_dir)]
    assert cli.main(["policy", "task_ota_1", "--json", *store]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == policy
    assert cli.main(["policy", "task_ota_1", "--priority", "high", "--json", *store]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == {"priority": "high"}


def test_a_batchs_priority_and_a_policys_outlive_kill_9(tmp_path: Path, store_env: dict[str, str], capsys: Any) -> None:
    """Once their hooks answered, a batch's `"priority": "high"` (a row flag) and a policy's are
    in the store a SIGKILLed server left: the vehicle's queue reads high priority first."""
    data_dir = tmp_path / "lmdb"
    srv = SubprocessServer(data_dir, env=store_env)
    try:
        hooks = ExHookClient(srv.port)
        for rid, extra in (("task_a_1", {}), ("task_b_1", {}), ("task_r_1", {"priority": "high"})):
            doc = {"ids": ["VIN1"], "request_id": rid, "data": rid, **extra}
            reply = hooks.publish("$SDV-FANOUT", json.dumps(doc).encode())
            assert reply.message.headers["allow_publish"] == "false"
        reply = hooks.publish("$SDV-FANOUT/policy", json.dumps({"request_id": "task_b_1", "priority": "high"}).encode())
        assert reply.message.headers["allow_publish"] == "false"
    finally:
        srv.kill()
    store = ["--store-url", store_env["SDV_FANOUT_STORE_URL"]] if store_env else ["--data-dir", str(data_dir)]
    assert cli.main(["inspect", "VIN1", "--json", *store]) == 0
    pending = json.loads(capsys.readouterr().out)["pending"]
    assert [(p["request_id"], p["priority"]) for p in pending] == [
        ("task_b_1", "high"),
        ("task_r_1", "high"),
        ("task_a_1", "normal"),
    ]
