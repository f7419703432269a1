"""kill -9 between an abort's commit and its `aborted` event, on both stores: a `sdv-fanout serve`
whose broker is away records an abort (the event waits in its status queue) and is SIGKILLed;
restarted on the same data with the broker back, it emits the `aborted` event from the stored
record (criterion and counts as recorded), and the record then says the broker took it
(`announced_ms`), so no later start emits it again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from exhook_server._proto import admin_pb2
from testkit.emqx_sim import Mosquitto
from testkit.harness import ExHookClient, SubprocessServer, admin_call, poll
from tests.integration.test_status_topic import Platform

pytestmark = pytest.mark.slow

RID = "task_ota_event9"
CRITERION = {"outcome": "expired", "ratio": 0.5, "min_finished": 10}


def aborted(srv: SubprocessServer) -> dict[str, object]:
    """The abort record of RID as GetPolicy shows it ({} while none)."""
    got = admin_call(srv.admin_port, "GetPolicy", admin_pb2.GetPolicyRequest(request_id=RID))
    return json.loads(got.aborted) if got.aborted else {}


def test_an_aborted_event_the_crash_kept_from_the_platform_comes_after_the_restart(
    tmp_path: Path, store_env: dict[str, str]
) -> None:
    broker = Mosquitto(tmp_path / "mosquitto")  # not started: the first server's events wait
    env = {
        **store_env,
        "SDV_FANOUT_MQTT_URL": broker.url,
        "SDV_FANOUT_EXPIRY_SWEEP_INTERVAL_S": "0.2",
        "SDV_FANOUT_GC_INTERVAL_S": "0",
    }
    data_dir = tmp_path / "lmdb"
    srv = SubprocessServer(data_dir, env=env)
    try:
        policy = json.dumps({"abort": [CRITERION]})
        admin_call(srv.admin_port, "SetPolicy", admin_pb2.SetPolicyRequest(request_id=RID, policy=policy))
        soon = int(time.time() * 1000) + 1000
        ExHookClient(srv.port).batch([f"LEVTEXP{n:09d}" for n in range(20)], RID, "fw", expires_at=soon)
        poll(lambda: srv.logged("campaign_aborted"), timeout_s=60)
        recorded = aborted(srv)
        assert recorded["criterion"] == CRITERION and "announced_ms" not in recorded
    finally:
        srv.kill()
    broker.start()
    platform = Platform(broker.port)
    again = SubprocessServer(data_dir, env=env)
    try:
        (event,) = platform.wait(event="aborted", request_id=RID)
        assert event["criterion"] == CRITERION and event["counts"] == recorded["counts"]
        poll(lambda: "announced_ms" in aborted(again), timeout_s=60)
        assert again.logged("campaign_abort_announced_late")
    finally:
        again.kill()
        platform.close()
        broker.stop()
